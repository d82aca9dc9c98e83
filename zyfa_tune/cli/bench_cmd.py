"""`zyfa-tune bench`: ours against FA3 / cuDNN / SDPA in one process; table, JSON, plot."""

from __future__ import annotations

import argparse

from rich.console import Console

from .common import console


def _bench_plan(args: argparse.Namespace):
    """`zyfa-tune bench`'s BenchPlan: the dispatcher's pick per dtype and our registered systems the
    mode runs (`attention()` end to end; both unless --no-dispatch), the --ours configs and the peers,
    on the shapes asked for."""
    from zyfa_tune.bench.inputs import DTYPES
    from zyfa_tune.bench.peers import our_systems, parse_peers
    from zyfa_tune.bench.peers.ours import OursSpec, parse_ours
    from zyfa_tune.bench.run import BenchPlan
    from zyfa_tune.bench.shape import DEFAULT_HEADS, packed_shape, parse_shape, shapes_from
    from zyfa_tune.tuning.inputs import FAMILY_NAMES

    dtypes = DTYPES if args.dtype == "both" else (args.dtype,)
    if args.lengths:
        heads = args.heads or DEFAULT_HEADS
        shapes = (packed_shape(args.lengths, args.head_dim, args.head_dim_v, heads, args.kv_heads),)
    elif args.shape:
        shapes = tuple(parse_shape(s) for s in args.shape)
    else:
        shapes = shapes_from(args.head_dim, args.head_dim_v, args.seqlens, args.batch_heads, args.kv_heads)
    ours = [] if args.no_dispatch else [OursSpec(f"ours-{dt}", dt) for dt in dtypes]
    for text in args.ours or []:
        ours += parse_ours(text, dtypes)
    ours_registered = () if args.no_dispatch else our_systems(dtypes, args.quant)
    peers = parse_peers(args.peers, dtypes, args.quant, packed=bool(args.lengths))
    return BenchPlan(
        shapes=shapes,
        ours=tuple(ours),
        peers=tuple(dict.fromkeys(ours_registered + peers)),
        reps=args.reps,
        seed=args.seed,
        rotate=args.rotate,
        rounds=args.rounds,
        warm_s=args.warm,
        input_family=",".join(FAMILY_NAMES) if args.input_family == "all" else args.input_family,
        quant=args.quant,
        energy_s=args.energy_s,
        ceiling=args.ceiling,
        quant_floor=args.quant_floor,
        paged=_page_size(args.paged),
    )


def _page_size(paged: int | None) -> int:
    """--paged's page size (0 where not given; 0 or less given is refused, not read as none)."""
    if paged is not None and paged <= 0:
        raise ValueError(f"--paged: expected a page size > 0, got {paged}")
    return paged or 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Ours (dispatcher + forced configs) against the peers on the same inputs; table, JSON, plot."""
    from zyfa_tune.bench import report as bench_report
    from zyfa_tune.bench import run as bench_run
    from zyfa_tune.bench.results import BenchResult

    if args.plot:
        bench_report.require_matplotlib()
    if args.from_json:
        result = BenchResult.load(args.from_json)
    else:
        import torch

        if not torch.cuda.is_available():
            console.print(
                "[red]bench: no CUDA device is visible; measuring needs the GPU.[/red] "
                "A saved run is redrawn without one: zyfa-tune bench --from results.json --plot out.png"
            )
            return 2
        result = bench_run.run(
            _bench_plan(args), on_row=lambda r: console.print(bench_report.row_line(r), markup=False, highlight=False)
        )
    wide = console if console.is_terminal else Console(width=200)  # logs: one line per row
    wide.print(bench_report.results_table(result))
    floor = bench_report.floor_table(result)
    if floor is not None:
        wide.print(floor)
    if args.json:
        result.save(args.json)
        console.print(f"results: {args.json}")
    if args.plot:
        console.print(f"plot: {bench_report.plot(result, args.plot)}")
    return 1 if any(r.error for r in result.rows if r.kind != "peer") else 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="ours vs FA3 / cuDNN / torch SDPA on the same inputs: table, JSON, plot")
    p.add_argument("--dtype", choices=["fp8", "bf16", "both"], default="fp8", help="input dtype of the benched systems")
    p.add_argument("--head-dim", type=int, default=128, help="head dim of Q and K (and V unless --head-dim-v)")
    p.add_argument("--head-dim-v", type=int, default=None, help="head dim of V where it differs (e.g. 192/128)")
    p.add_argument("--seqlens", default="4096,8192,16384", help="comma list of sequence lengths")
    p.add_argument(
        "--batch-heads",
        default=None,
        metavar="BxH,...",
        help="one batch x heads per seqlen, or one for all (default: 16384 tokens / seqlen x 32)",
    )
    p.add_argument("--kv-heads", type=int, default=None, help="GQA: fewer KV heads (default: = heads)")
    p.add_argument(
        "--lengths",
        default=None,
        metavar="SPEC",
        help="bench packed sequences (flash_attn_varlen_func vs FA3's varlen) of one length mix instead of "
        "--seqlens: a comma list, a file of lengths (one per line, or a .json list), or a named mix: chat "
        "(64 sequences of 128 to 8K, ~128K tokens) or long-doc (8 of 8K to 32K); per-tensor inputs",
    )
    p.add_argument("--heads", type=int, default=None, help="query heads of --lengths (default 32)")
    p.add_argument(
        "--paged",
        type=int,
        default=None,
        metavar="PAGE_SIZE",
        help="with --lengths: also run each of ours on a paged KV cache of these pages, shuffled "
        "(flash_attn_with_kvcache, every token a query), and the same call on pages in order "
        "(<name>-paged-contiguous): what scattered pages cost the same kernel; FA3 varlen peers also run "
        "FA3's KV-cache entry on the same pages (<peer>-paged)",
    )
    p.add_argument(
        "--shape",
        action="append",
        metavar="DQK,DV,B,S,H[,HK]",
        help="an explicit shape (repeatable; replaces --head-dim/--seqlens/--batch-heads)",
    )
    p.add_argument(
        "--peers",
        default=None,
        help="comma list of peers (e.g. fa3-fp8,sdpa-flash-bf16; an unknown name lists every one), or "
        "'none' (default: every peer of the benched dtypes that runs in the --quant mode)",
    )
    p.add_argument(
        "--ours",
        action="append",
        metavar="[LABEL:]KEY=VAL,...",
        help="also time a forced config: the default config with these fields changed (repeatable)",
    )
    p.add_argument(
        "--no-dispatch",
        action="store_true",
        help="leave out flash_attn_func's own pick: only --ours configs and peers (e.g. one system "
        "under ncu: zyfa-tune bench --no-dispatch --peers fa3-fp8 --rounds 1 --reps 5)",
    )
    p.add_argument("--reps", type=int, default=30, help="timed calls per system (median reported)")
    p.add_argument("--rotate", type=int, default=1, help="input sets timed round-robin (for shapes that fit in L2)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timing rounds per shape, systems interleaved in a rotated order (clock drift hits all alike)",
    )
    p.add_argument(
        "--input-family",
        default="gaussian",
        metavar="NAME[,NAME...]",
        help="inputs of these tuning.inputs families, every shape on each (gaussian, outliers, sink, "
        "rope, peaky, flat, llm; 'all' for every one): a variant x family table in one run",
    )
    p.add_argument(
        "--quant",
        choices=["per-tensor", "native", "end-to-end"],
        default="per-tensor",
        help="FP8 inputs: one shared per-tensor quantisation (kernel error only), or each system's "
        "own with errors against the unquantised inputs (then --ours NAME:smooth_k=true, hadamard=true, "
        "k_major_v=true: V quantised keys-fastest, read without the V^T copy, or balanced_v=true: V's "
        "rounding errors cancelling along the keys, with v_weight=K its kappa, work); end-to-end: as "
        "native, but FA3 and ours quantise the bf16 inputs inside each timed call (quantiser + "
        "attention), and zyfa_tune.attention() runs as model code calls it (row ours-attention)",
    )
    p.add_argument(
        "--quant-floor",
        action="store_true",
        help="also time quantize_fp8 alone (plain, k_major V, balanced V, smooth_k+hadamard, the --ours "
        "options and attention()'s recipe) and a device-to-device copy of the same bytes, interleaved "
        "with the other systems: each quantiser's GB/s and time / floor (bytes read + written at the "
        "copy's rate)",
    )
    p.add_argument("--warm", type=float, default=3.0, help="seconds of GEMMs to reach sustained clocks first")
    p.add_argument(
        "--energy-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="TFLOP/J: after its timing, run each system back to back this long (>= 1 s; NVML's energy "
        "counter is noise over shorter windows) and read the energy counter around it (default 0: none)",
    )
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="also time the FP8 GEMM ceiling (torch._scaled_mm, 8192^3) at the start and end of the run; "
        "FP8 rows then show their share of it",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (and sampler)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="save every row and the GPU state")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="TFLOP/s vs seqlen (needs zyfa-tune[plot])")
    p.add_argument(
        "--from",
        dest="from_json",
        default=None,
        metavar="RESULTS.json",
        help="no measuring: redraw the table / --plot of a saved run (no GPU needed)",
    )
    p.set_defaults(fn=cmd_bench)
