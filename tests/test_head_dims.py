"""Head dims beyond the five FA3 ships: which widths each backend accepts, how the Triton backend
splits a width into chunks, and that the widths it accepts compile for sm_90a with no spills and the
expected MMA instructions, the static checks accepting exactly what compiles."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune.generator import HEAD_DIMS, HOPPER, ConfigError, KernelConfig, chunk_skips, emit, head_chunks
from zyfa_tune.generator.build import compile_for_target
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.search_spaces import get_space
from zyfa_tune.search_spaces.seeds import SEEDS

#: widths models use that FA3 has no kernel for, beside the narrowest and the widest
WIDTHS = (32, 40, 48, 72, 80, 112, 160, 200, 256)
#: asymmetric Q/K vs V widths
PAIRS = tuple((d, d) for d in WIDTHS) + ((160, 128), (128, 64), (128, 80))


def test_head_dims_are_the_multiples_of_8_from_32_to_256():
    assert HEAD_DIMS == tuple(range(32, 257, 8))
    for bad in (16, 24, 36, 264, 80.0):
        with pytest.raises(ConfigError, match="head_dim_qk"):
            KernelConfig(head_dim_qk=bad, head_dim_v=128)


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("min_width", [16, 32])
def test_head_chunks_cover_the_head_once_inside_it(dim, min_width):
    """Power-of-two chunks of >= min_width columns, inside [0, dim), covering every column; the
    columns an overlapping chunk repeats are exactly its skipped ones."""
    chunks = head_chunks(dim, min_width)
    covered = []
    for (off, w), skip in zip(chunks, chunk_skips(chunks)):
        assert w & (w - 1) == 0 and w >= min_width and 0 <= off and off + w <= dim
        covered += range(off + skip, off + w)
    assert covered == list(range(dim))


def test_head_chunks_of_the_shipped_widths_do_not_overlap():
    for dim in (64, 96, 128, 192, 256):
        assert chunk_skips(head_chunks(dim, 32)) == [0] * len(head_chunks(dim, 32))
    assert head_chunks(80, 32) == [(0, 64), (48, 32)] and chunk_skips(head_chunks(80, 32)) == [0, 16]
    assert head_chunks(80) == [(0, 64), (64, 16)]


@pytest.mark.parametrize("dqk,dv", PAIRS)
def test_triton_accepts_every_width(dqk, dv):
    for dtype in ("fp8", "bf16"):
        cfg = default_config(dtype, dqk, dv)
        assert (cfg.head_dim_qk, cfg.head_dim_v) == (dqk, dv)
        # FP8 rows of 8 but not 16 columns are not 16-byte aligned for TMA: the default loads by pointer
        assert cfg.loads == ("pointer" if dtype == "fp8" and (dqk % 16 or dv % 16) else "tma")
    with pytest.raises(ConfigError, match="loads='pointer'"):
        KernelConfig(head_dim_qk=40, head_dim_v=40, loads="tma")


@pytest.mark.parametrize("dqk,dv", PAIRS)
def test_gluon_takes_q_k_widths_of_16s(dqk, dv):
    """FP8 wgmma reduces 32 columns: the Gluon backend zero-pads Q and K to a multiple of 32 through TMA views
    whose head stride must be 16-byte aligned, so it needs head_dim_qk a multiple of 16, and says so."""
    if dqk % 16:
        with pytest.raises(ConfigError, match="head_dim_qk=.*multiple of 16"):
            default_config("fp8", dqk, dv, "gluon")
    else:
        cfg = default_config("fp8", dqk, dv, "gluon")
        assert emit(cfg).source
    with pytest.raises(ConfigError, match="v_layout='natural'"):
        default_config("fp8", 128, 40, "gluon").replace(v_layout="natural", v_permute=False)


def _cases() -> list[tuple[str, str, int, int]]:
    """One default config per width pair and backend (modest: every compile costs seconds)."""
    out = [("triton", "fp8", dqk, dv) for dqk, dv in PAIRS]
    out += [("triton", "bf16", dqk, dv) for dqk, dv in PAIRS if dqk in (40, 80, 200, 160)]
    out += [("gluon", "fp8", dqk, dv) for dqk, dv in PAIRS if dqk % 16 == 0]
    return out


def _compiles_clean(cfg: KernelConfig):
    """The compiled kernel if it builds for sm_90a with no spills within the shared memory, else None."""
    try:
        art = compile_for_target(emit(cfg))
    except Exception:  # (ptxas refusing a register allocation: not a usable kernel either)
        return None
    return art if art.spill_bytes == 0 and art.shared_bytes <= HOPPER.shared_memory_bytes else None


@pytest.mark.parametrize("backend,dtype,dqk,dv", _cases())
def test_default_of_each_width_compiles_as_the_static_checks_say(backend, dtype, dqk, dv):
    """The default config of a width compiles for sm_90a with the dtype's MMA (QGMMA for FP8, HGMMA for
    bf16), no spills and within shared memory, and the search space's static checks pass it."""
    cfg = default_config(dtype, dqk, dv, backend)
    art = _compiles_clean(cfg)
    assert art is not None, f"{cfg.summary()} {dqk}/{dv} does not compile clean"
    assert get_space(dtype).feasible(cfg) is None, get_space(dtype).feasible(cfg)
    assert art.count("QGMMA" if dtype == "fp8" else "HGMMA") > 0
    assert art.count("HGMMA" if dtype == "fp8" else "QGMMA") == 0


@pytest.mark.parametrize("dims", [(160, 128), (80, 80), (144, 144)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: s.name)
def test_static_checks_accept_exactly_the_seeds_that_compile(seed, dims):
    """At widths no seed was measured at, 160/128 (Q/K in five 32-column parts, O of 128) and 80 and 144 (Q/K
    zero-padded to 96 and 160, O padded to 128 and 256): each named seed the space calls feasible compiles
    clean, and each it rejects does not (spills, too much shared memory)."""
    try:
        cfg = seed.build("fp8", *dims)
    except ConfigError:  # (a seed built for other head dims only)
        return
    why = get_space("fp8").feasible(cfg)
    assert (why is None) == (_compiles_clean(cfg) is not None), (seed.name, why)


@pytest.mark.parametrize("dim", [32, 40, 48, 72, 80, 112, 160, 200])
def test_quantiser_rotation_of_any_width_is_orthonormal(dim):
    """A width that is not a power of two is rotated in Hadamard blocks of the largest power of two
    dividing it (80: five of 16; 40: five of 8), still an orthonormal matrix."""
    import torch

    from zyfa_tune.kernels.hadamard import hadamard_matrix, rotation_block

    block = rotation_block(dim)
    assert dim % block == 0 and block & (block - 1) == 0 and (dim // block) % 2 == 1 or dim == block
    h = hadamard_matrix(dim, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(dim, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("dim", [48, 80, 112, 160])
@pytest.mark.parametrize("seqlen,batch", [(8192, 2), (16384, 1)])
def test_the_shipped_h100_database_serves_its_tuned_widths(dim, seqlen, batch):
    """An H100 gets its own tuned Gluon entry at these widths FA3 only runs padded (docs/results.md), not
    the width's untuned default and not an entry borrowed from the H200."""
    from zyfa_tune.api import explain

    q, k, v = (torch.empty(batch, seqlen, 32, dim, dtype=torch.float8_e4m3fn, device="meta") for _ in range(3))
    choice = explain(q, k, v, gpu="NVIDIA H100 80GB HBM3")
    assert choice.source == "exact" and choice.config.backend == "gluon"
    assert (choice.config.head_dim_qk, choice.config.head_dim_v) == (dim, dim)
