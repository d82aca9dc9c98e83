"""How bf16 inputs become the FP8 codes a kernel reads: the quantisation recipe.

A recipe is data like a `KernelConfig`: it names the options of `zyfa_tune.quantize_fp8` that a
kernel is measured with (and that `zyfa_tune.attention` then applies before launching that
kernel), so it can be searched, stored beside the kernel and validated when read back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from .config import ConfigError

#: allowed values of each recipe field
RECIPE_CHOICES: dict[str, tuple] = {
    "hadamard": (False, True),  # rotate Q and K by one orthonormal Hadamard matrix (QK^T unchanged)
    "smooth_k": (False, True),  # subtract K's token mean (softmax unchanged)
    "v_rounding": ("nearest", "balanced"),  # V's codes to nearest, or balanced along the keys
    "v_layout": ("natural", "k_major"),  # V codes as given, or written keys-fastest (no V^T copy later)
}


@dataclass(frozen=True)
class Recipe:
    """Per-(batch, kv head) descales always; the rest as named. The default is the plain recipe
    FlashAttention-3's users apply (nearest codes, no rotation, V as given)."""

    hadamard: bool = False
    smooth_k: bool = False
    v_rounding: str = "nearest"
    v_layout: str = "natural"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            allowed = RECIPE_CHOICES[f.name]
            if type(value) is not type(allowed[0]) or value not in allowed:
                raise ConfigError(f"recipe {f.name}: {value!r} is not one of {list(allowed)}")

    def quantize_kwargs(self) -> dict:
        """The keyword arguments of `quantize_fp8` that apply this recipe."""
        return asdict(self)

    def summary(self) -> str:
        parts = [name for name in ("hadamard", "smooth_k") if getattr(self, name)]
        parts += [
            f"{name}={getattr(self, name)}"
            for name in ("v_rounding", "v_layout")
            if getattr(self, name) != RECIPE_CHOICES[name][0]
        ]
        return " ".join(parts) or "plain"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Recipe":
        """Parse stored text; unknown fields or values raise ConfigError (stored data is checked)."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"recipe: not JSON: {exc}") from None
        if not isinstance(data, dict) or set(data) - set(RECIPE_CHOICES):
            raise ConfigError(f"recipe: expected an object with fields from {sorted(RECIPE_CHOICES)}")
        return cls(**data)


#: the recipe of the FP8 API: inputs quantised plainly, as FlashAttention-3's users do
PLAIN = Recipe()
