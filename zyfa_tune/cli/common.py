"""What the commands share: the console, config options and parsing helpers."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.text import Text

from zyfa_tune.generator import KernelConfig

console = Console()


def add_config_options(p: argparse.ArgumentParser) -> None:
    """--dtype / --head-dim / --head-dim-v / --set: the config a kernel command builds."""
    p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="element type of Q, K and V")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension of Q and K")
    p.add_argument("--head-dim-v", type=int, default=None, help="head dimension of V (None: --head-dim)")
    p.add_argument("--set", action="append", metavar="KEY=VAL", help="override a config field")


def add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage",
        default=None,
        help="database path or SQLAlchemy URL (default: $ZYFA_TUNE_DB or the user cache file)",
    )


def plain(value: object) -> Text:
    """Text from a database or an exception, printed as it is: never read as rich markup (a GPU name
    "[/]" would crash the table, "[link=...]" forge it), without control characters."""
    from zyfa_tune.db.checks import clean_text

    return Text(clean_text(str(value)))


def config_from_args(args: argparse.Namespace) -> KernelConfig:
    from zyfa_tune.generator.defaults import config_with, parse_changes

    changes = parse_changes(args.set or [], "--set")
    return config_with(args.dtype, args.head_dim, args.head_dim_v or args.head_dim, changes)


def head_dims(args: argparse.Namespace) -> tuple[int, int] | None:
    if args.head_dim is None:
        return None
    return args.head_dim, args.head_dim_v or args.head_dim


def int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None


def config_changes(config: KernelConfig) -> str:
    """The fields where `config` differs from the default config of its dtype, head dims and backend
    (a Gluon config is named as such: "backend=gluon" first)."""
    from zyfa_tune.generator.defaults import default_config

    base = default_config(config.dtype, config.head_dim_qk, config.head_dim_v, config.backend).all_fields()
    changed = [f"{k}={v}" for k, v in config.to_dict().items() if base[k] != v]
    if config.backend != "triton":
        return " ".join([f"backend={config.backend}", *changed])
    return " ".join(changed) or "(the default config)"
