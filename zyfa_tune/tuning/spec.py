"""What a study is asked to do: the validated `TuneSpec` (shapes, budget, storage, runner, gate,
seeds), its progress counters and the duration parser of `--time`."""

from __future__ import annotations

import functools
import math
import os
import re
import time
from dataclasses import dataclass, field

from zyfa_tune.db import APIS, DatabaseError, default_db_path
from zyfa_tune.generator import KernelConfig, head_dim_error
from zyfa_tune.search_spaces import get_space
from zyfa_tune.tuning.inputs import check_input_family
from zyfa_tune.tuning.lengths import LengthMix
from zyfa_tune.tuning.runners import parse_runner
from zyfa_tune.tuning.warm_start import stored_bests
from zyfa_tune.tuning.worker import Shape

#: where a study whose runner simulates its measurements writes when no storage is named
SIMULATED_DB = "simulated.db"
SAMPLERS = ("tpe", "random")
#: An accuracy gate at least this loose (allowed error / the exact reference's) admits lean P's linear
#: fold (measured 1.33-1.40x): such a study, or a multi-objective one, is also seeded with the space's
#: `loose_seeds`. The default gate (1.25) is not, so its studies spend no trial on a certain rejection.
LOOSE_GATE = 1.4


@dataclass(frozen=True)
class TuneSpec:
    dtype: str
    head_dim_qk: int
    head_dim_v: int
    seqlens: tuple[int, ...] = ()
    heads: int = 32
    kv_heads: int | None = None  # default: heads (no GQA)
    tokens: int = 16384  # batch = max(1, tokens // seqlen) unless batches is given
    batches: tuple[int, ...] | None = None
    causal: bool = True
    trials: int | None = None
    time_budget_s: float | None = None
    gpus: tuple[int | None, ...] = (None,)
    storage: str | None = None  # tuning database (path or SQLAlchemy URL); None = default (simulated.db
    # beside it for a runner that simulates its measurements)
    study_storage: str | None = None  # Optuna storage URL or journal file; None = journal in cache
    study_name: str | None = None
    resume: bool = False
    sampler: str = "tpe"
    multi_objective: bool = False
    runner: str = "gpu"
    timeout_s: float = 180.0
    seed: int = 0
    gate: float = 1.25
    reps: int = 20
    inputs: str | None = None  # captured q, k, v (.pt / .safetensors): the one shape tuned
    input_family: str = "gaussian"  # random inputs' family for the accuracy gate (kernels.inputs)
    precompile: bool = False  # compile the next trial's kernel in a CPU process while the GPU
    # measures (zyfa_tune.tuning.precompile); opt-in until it measures faster
    enqueue: tuple[str, ...] = ()  # configs to measure first, as 'key=val,...' changes to the
    # head dims' default (what `--ours` / `--set` take)
    warm_start: tuple[str, ...] = ()  # tuning databases (path or URL) whose best configs of these
    # head dims, on any shape, are measured next (see warm_configs)
    api: str = "fp8"  # "fp8": the kernel alone on plain codes; "bf16": the whole call
    # from bf16 inputs, the quantiser's recipe searched beside the kernel
    lengths: LengthMix | None = None  # packed sequences of this mix (flash_attn_varlen_func: Gluon configs
    # on their varlen variant, Triton ones on their serving variant) instead of seqlens: one problem class of
    # its tokens and longest sequence

    def __post_init__(self) -> None:
        if self.dtype not in ("fp8", "bf16"):
            raise ValueError(f"dtype: {self.dtype!r} is not 'fp8' or 'bf16'")
        if self.api not in APIS:
            raise ValueError(f"api: {self.api!r} is not one of {list(APIS)}")
        if self.api == "bf16" and self.dtype != "fp8":
            raise ValueError("api: 'bf16' quantises bf16 inputs to FP8 codes: its kernels are dtype 'fp8'")
        for name in ("head_dim_qk", "head_dim_v"):
            if why := head_dim_error(name, getattr(self, name)):
                raise ValueError(why)
        check_input_family(self.input_family, self.inputs, what="input_family")
        if self.inputs is not None:
            if self.seqlens:
                raise ValueError("seqlens: the shape comes from --inputs; give one or the other")
            if self.lengths is not None:
                raise ValueError("lengths: the shape comes from --inputs; give one or the other")
            _ = self.shapes  # load and check the file now, not in the middle of a study
        elif self.lengths is not None:
            self._check_packed()
        elif not self.seqlens or any(not isinstance(s, int) or s < 1 for s in self.seqlens):
            raise ValueError(f"seqlens: expected positive integers, got {self.seqlens!r}")
        if self.batches is not None and len(self.batches) != len(self.seqlens):
            raise ValueError("batches: give one batch size per seqlen")
        kv = self.kv_heads or self.heads
        if self.heads < 1 or kv < 1 or self.heads % kv:
            raise ValueError(f"kv_heads: {kv} must divide heads={self.heads}")
        if self.trials is None and self.time_budget_s is None:
            raise ValueError("trials / time_budget_s: give at least one")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"trials: expected >= 1, got {self.trials}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler: {self.sampler!r} is not one of {list(SAMPLERS)}")
        if not self.gpus:
            raise ValueError("gpus: need at least one")
        if parse_runner(self.runner).kind != "gpu" and self.storage is None:  # (ValueError naming the runner)
            # the default database feeds the dispatcher: simulated results go beside it, not into it
            object.__setattr__(self, "storage", str(default_db_path().with_name(SIMULATED_DB)))
        if (
            isinstance(self.gate, bool)
            or not isinstance(self.gate, (int, float))
            or not math.isfinite(self.gate)
            or self.gate < 1.0
        ):
            raise ValueError(
                f"gate: expected a finite number >= 1 (allowed error / the exact reference's), got {self.gate!r}"
            )
        _ = self.enqueued, self.warm_configs  # parse and check the configs now, not after the study has started

    def _check_packed(self) -> None:
        """A packed-sequence study: one mix, timed through flash_attn_varlen_func on FP8 codes or bf16."""
        if not isinstance(self.lengths, LengthMix):
            raise ValueError(f"lengths: expected a LengthMix (tuning.lengths.parse_lengths), got {self.lengths!r:.80}")
        if self.seqlens or self.batches is not None:
            raise ValueError("lengths: packed sequences replace seqlens and batches; give one or the other")
        if self.api != "fp8":
            raise ValueError(f"lengths: packed sequences are tuned for api 'fp8' only, not {self.api!r}")

    @property
    def packed(self) -> bool:
        """Whether the study tunes packed sequences (`lengths`), each config as its varlen.packed_twin."""
        return self.lengths is not None

    @functools.cached_property
    def enqueued(self) -> tuple[KernelConfig, ...]:
        """The `enqueue` configs, each a point of the family's space that fits statically."""
        from zyfa_tune.generator.defaults import config_with, parse_changes

        _check_texts("enqueue", self.enqueue, "'key=val,...' strings")
        space, out = get_space(self.dtype), []
        for text in self.enqueue:
            try:
                cfg = config_with(self.dtype, self.head_dim_qk, self.head_dim_v, parse_changes([text], "enqueue"))
                space.as_optuna_params(cfg)
            except ValueError as exc:  # ConfigError is one
                raise ValueError(f"enqueue {text!r}: {exc}") from exc
            reason = space.feasible(cfg)
            if reason is not None:
                raise ValueError(f"enqueue {text!r}: does not fit: {reason}")
            out.append(cfg)
        return tuple(out)

    @functools.cached_property
    def warm_configs(self) -> tuple[KernelConfig, ...]:
        """The best configs that `warm_start` databases hold for this dtype, head-dim pair and
        causality, fastest first, each once and not already in `enqueued`. A kernel tuned at one
        sequence length or batch is often the best at its neighbours too, or a better start than the
        seeds: a study measures these before the sampler's own asks, and a shape tuned long ago
        gets the newer kernels its neighbours found (a 192/128 entry tuned without the two-P-tile
        kernel ran 0.95x FA3 at 32K; re-tuned from its neighbours' kernels, 1.07x). Entries outside
        the current search space or not fitting statically are skipped; a stored config is validated
        (`KernelConfig.from_json`) before anything reads it."""
        _check_texts("warm_start", self.warm_start, "database paths or URLs")
        space, out = get_space(self.dtype), []
        seen = {space.canonical(c).to_json() for c in self.enqueued}
        for target in self.warm_start:
            try:
                stored = stored_bests(
                    space, target, self.head_dim_qk, self.head_dim_v, causal=self.causal, required=True
                )
            except DatabaseError as exc:
                raise ValueError(f"warm_start {target!r}: {exc}") from exc
            for cfg, _ in sorted(stored, key=lambda pair: -(pair[1] or 0.0)):
                try:
                    space.as_optuna_params(cfg)
                except ValueError:  # a point outside this space
                    continue
                if cfg.to_json() not in seen and space.feasible(cfg) is None:
                    seen.add(cfg.to_json())
                    out.append(cfg)
        return tuple(out)

    @functools.cached_property
    def shapes(self) -> tuple[Shape, ...]:
        if self.inputs is not None:
            from zyfa_tune.tuning.verify import load_activations

            q, k, v = load_activations(self.inputs)
            if (q.shape[3], v.shape[3]) != (self.head_dim_qk, self.head_dim_v):
                raise ValueError(
                    f"inputs: head dims {q.shape[3]}/{v.shape[3]} in {self.inputs}, "
                    f"but the study tunes {self.head_dim_qk}/{self.head_dim_v}"
                )
            return (Shape(batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2], seqlen=q.shape[1]),)
        kv = self.kv_heads or self.heads
        if self.lengths is not None:
            return (Shape.packed(self.lengths.lengths, self.heads, kv),)
        batches = self.batches or tuple(max(1, self.tokens // s) for s in self.seqlens)
        return tuple(Shape(batch=b, heads=self.heads, kv_heads=kv, seqlen=s) for b, s in zip(batches, self.seqlens))

    @property
    def name(self) -> str:
        """The study name; by default one study per input family (gaussian keeps the plain name)."""
        family = "" if self.input_family == "gaussian" else f"-{self.input_family}"
        api = "" if self.api == "fp8" else f"{self.api}api-"
        packed = "" if self.lengths is None else f"-varlen-{self.lengths.name}"
        mask = "causal" if self.causal else "full"
        return self.study_name or f"{api}{self.dtype}-{self.head_dim_qk}x{self.head_dim_v}-{mask}{packed}{family}"

    @property
    def inputs_label(self) -> str:
        """What the accuracy gate's inputs were, for the trial's provenance (no schema column)."""
        return f"file:{os.path.basename(self.inputs)}" if self.inputs is not None else self.input_family


def _check_texts(name: str, value: object, what: str) -> None:
    """A TuneSpec field that takes a sequence of strings (a bare string would be read per character)."""
    if isinstance(value, str) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{name}: expected a sequence of {what}, got {value!r}")


@dataclass
class Progress:
    """What the CLI shows while tuning (updated under a lock by the worker threads)."""

    done: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    best_value: float | None = None
    best_config: KernelConfig | None = None
    last_clock_mhz: float | None = None
    started: float = field(default_factory=time.time)
    by_gpu: dict[str, int] = field(default_factory=dict)  # measured trials per worker GPU


def parse_duration(text: str) -> float:
    """'90s', '15m', '2h', '1h30m' or plain seconds -> seconds."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"--time: cannot read {text!r}; use e.g. 90s, 15m, 1h30m")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
