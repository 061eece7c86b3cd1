"""Every Gluon sm_90 kernel variant the package can launch compiles for sm_90, without a GPU.

Triton's front end, LLVM and ptxas run on a CPU, so API drift in ``triton.experimental.gluon`` and a
shared-memory overflow (over the H200's 227 KB per block) fail here, in CI, not on a user's GPU. The
kernels are written against ``gluon_sm90.SUPPORTED_TRITON``; CI compiles them with that Triton,
installed beside the test environment's own by ``make gluon-triton`` (``GLUON_TRITON_DIR``, default
``.cache/triton-gluon``), in a subprocess whose ``PYTHONPATH`` puts it first. Without that directory the
test is skipped on a developer machine and fails under CI (``CI`` set), so CI can never pass it silently.
"""

from __future__ import annotations

import pytest
from testlib.sm90 import run_sm90_compile

SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on the H100 / H200

_SCRIPT = r"""
import json, re, subprocess, sys
import triton
from sparse_mla.mqa import gluon_sm90 as g
ptxas = __import__("os").path.join(__import__("os").path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
from sparse_mla.mqa.gluon_sm90 import l2_hints
HINTED = l2_hints.HINTED_COPY
import tempfile
TMP = tempfile.mkdtemp(prefix="sparse_mla_gluon_check_")  # this run's own files: parallel runs must not share them
PTX, CUBIN = TMP + "/kernel.ptx", TMP + "/kernel.cubin"
def n_param_bits(ttgir):
    # the kernel's parameter N in TTGIR ("%N: i32" or "%N: i64")
    return int(re.search(r"%N: i(\d+)", ttgir).group(1))
rows = []
# every variant, then the L2_VARIANTS again with their kv copies hinted (SPARSE_MLA_GLUON_KV_L2=evict_last)
for v, mode, wide in ([(v, "off", False) for v in g.all_variants()] + [(tuple(v), "evict_last", False) for v in L2_VARIANTS]
                      + [(tuple(v), "off", True) for v in WIDE_N_VARIANTS]):
    g.config.KV_L2 = mode
    try:
        k = g.compile_variant(*v, wide_n=wide)
    except Exception as exc:
        rows.append(dict(variant=list(v), kv_l2=mode, wide_n=wide, error=f"{type(exc).__name__}: {str(exc)[-2000:]}"))
        continue
    spills = None
    with open(PTX, "w") as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", PTX, "-o", CUBIN], capture_output=True, text=True)
    found = re.findall(r"(\d+) bytes spill stores", r.stderr)
    spills = int(found[0]) if found else None
    sass = subprocess.run([cuobjdump, "-sass", CUBIN], capture_output=True,
                          text=True).stdout
    rows.append(dict(variant=list(v), shared=k.metadata.shared, spills=spills, triton=triton.__version__,
                     hot_local=hot_local_accesses(sass), e4m3_cvt="cvt.rn.f16x2.e4m3x2" in k.asm["ptx"],
                     kv_l2=g.config.KV_L2, wide_n=wide, n_param_bits=n_param_bits(k.asm["ttgir"]),
                     plain_copies=len(re.findall(r"cp\.async\.cg\.shared\.global \[", k.asm["ptx"])),
                     hinted_copies=k.asm["ptx"].count(HINTED), ltc256b_sass=sass.count("LDGSTS.E.BYPASS.LTC256B.128")))
__import__("shutil").rmtree(TMP, ignore_errors=True)
print(json.dumps(rows))
"""

# SASS scan, run inside the compile subprocess: local-memory (spill) accesses inside a tile loop, an innermost
# one of the shortest backward-branch ranges around wgmma (HGMMA) and cp.async (LDGSTS) instructions. A save /
# restore once per work item is harmless; one in a tile loop costs every tile.
_SASS_SCAN = r"""
def hot_local_accesses(sass):
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    hot = {a for a, t in ins if "HGMMA" in t or "LDGSTS" in t}
    loops = []
    for a, t in ins:
        m = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            lo = int(m.group(1), 16)
            if any(lo <= h <= a for h in hot):
                loops.append((lo, a))
    # each hot instruction's loop: the shortest range around it (ranges closed by out-of-line retry stubs of
    # mbarrier waits, which jump back from past the kernel body, are longer than the loop they sit in)
    inner = {min((r for r in loops if r[0] <= h <= r[1]), key=lambda r: r[1] - r[0], default=None) for h in hot}
    inner.discard(None)
    # ... and of those the innermost (a work-item loop holding the Q copy also holds the tile loops: not one)
    inner = [r for r in inner if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in inner)]
    return [f"{a:#x} {t.strip()}" for a, t in ins
            if ("LDL" in t or "STL" in t) and any(lo <= a <= hi for lo, hi in inner)]
"""
_SCRIPT = _SCRIPT.replace("rows = []", _SASS_SCAN + "\ncuobjdump = ptxas[:-len('ptxas')] + 'cuobjdump'\nrows = []")


# The variants also compiled with the kv copies' L2 hints (gluon_sm90.l2_hints): both schedules, both D_qk, both
# dtypes, per token and grouped, split-KV, the fp8_ds_mla producer's RoPE copies.
L2_VARIANTS = [(False, True, "bf16", "pair", False, False), (True, False, "fp16", "pair", False, False),
               (False, True, "bf16", "split", False, False), (False, True, "fp16", "split", False, True),
               (True, True, "bf16", "split", True, False)]
# And with N typed int64 (a cache of 2**31 rows or more: launcher._N_ARG), both schedules, per token and grouped.
WIDE_N_VARIANTS = [(False, True, "bf16", "pair", False, False), (True, True, "bf16", "pair", False, False),
                   (False, True, "bf16", "split", False, False)]
_SCRIPT = _SCRIPT.replace("from sparse_mla.mqa import gluon_sm90 as g", "from sparse_mla.mqa import gluon_sm90 as g\n"
                          f"L2_VARIANTS = {L2_VARIANTS!r}\nWIDE_N_VARIANTS = {WIDE_N_VARIANTS!r}")


@pytest.fixture(scope="module")
def compiled_all():
    return run_sm90_compile(_SCRIPT, "the Gluon kernels")


@pytest.fixture(scope="module")
def compiled(compiled_all):
    """The rows of every variant as the package launches it by default (plain cp.async, N int32)."""
    return [r for r in compiled_all if r.get("kv_l2", "off") == "off" and not r.get("wide_n")]


def test_wide_n_variants_compile_without_spilling_in_loops(compiled_all):
    """A launch over a cache of 2**31 rows or more types N int64 (a separate compile): it compiles, within the spill
    budget, none in a tile loop."""
    wide = [r for r in compiled_all if r.get("wide_n")]
    assert len(wide) == len(WIDE_N_VARIANTS)
    for row in wide:
        assert "error" not in row, f"{row['variant']}: {row.get('error')}"
        assert row["n_param_bits"] == 64, row  # N really is int64 in the compiled kernel
        assert row["spills"] is not None and row["spills"] <= SPILL_BUDGET, row
        assert not row["hot_local"], f"{row['variant']}: local-memory accesses in a tile loop: {row['hot_local']}"


@pytest.fixture(scope="module")
def hinted(compiled_all):
    return [r for r in compiled_all if r.get("kv_l2") == "evict_last"]


def test_triton_is_a_supported_version(compiled):
    from sparse_mla.mqa import gluon_sm90

    versions = {row.get("triton") for row in compiled if "triton" in row}
    assert versions and all(gluon_sm90.triton_version_supported(v) for v in versions), versions


def test_every_variant_compiles_within_shared_memory(compiled):
    from sparse_mla.mqa import gluon_sm90

    assert len(compiled) == len(gluon_sm90.all_variants()) > 0
    errors = [row for row in compiled if "error" in row]
    assert not errors, "\n".join(f"{r['variant']}: {r['error']}" for r in errors)
    for row in compiled:
        assert 0 < row["shared"] <= SMEM_LIMIT, f"{row['variant']}: {row['shared']} B of shared memory > {SMEM_LIMIT}"


# The persistent kernels keep a few per-item values in local memory across work items (saved once, reloaded once per
# item, outside the tile loops: tests below), within this budget (split 12-16 B, pair 8 B at triton 3.6).
SPILL_BUDGET = 32
# The fp8_ds_mla variants' producer (register-path dequantization at gluon_sm90.config.FP8_PRODUCER_REGS) saves a few more
# per-item values the same way; still none inside a tile loop.
FP8_SPILL_BUDGET = 64


def test_every_variant_does_not_spill_in_its_loops(compiled):
    """Every variant (both schedules) spills at most SPILL_BUDGET bytes (ptxas -v), and none of it inside a tile loop
    (SASS: no local-memory access in an innermost loop holding wgmma or cp.async)."""
    from sparse_mla.mqa import gluon_sm90

    assert {r["variant"][3] for r in compiled} == set(gluon_sm90.SCHEDULES)
    for row in compiled:
        assert row["spills"] is not None, f"{row['variant']}: no 'spill stores' line in the ptxas -v report"
        budget = FP8_SPILL_BUDGET if row["variant"][4] else SPILL_BUDGET
        assert row["spills"] <= budget, f"{row['variant']}: {row['spills']} bytes of spill stores"
        assert not row["hot_local"], f"{row['variant']}: local-memory accesses in a tile loop: {row['hot_local']}"


def test_fp8_variants_dequantize_with_the_hardware_conversion(compiled):
    """The fp8_ds_mla variants convert e4m3 with the sm_89+ cvt instruction (no software decode); the bf16 ones
    have no e4m3 code at all."""
    fp8 = [r for r in compiled if r["variant"][4]]
    assert fp8 and all(r["e4m3_cvt"] for r in fp8), fp8
    assert not any(r["e4m3_cvt"] for r in compiled if not r["variant"][4])


def test_sass_scan_finds_a_spill_in_a_loop():
    """The SASS scan itself: a local load inside a loop with an HGMMA is reported, one outside it is not."""
    import re

    ns = {"re": re}
    exec(_SASS_SCAN, ns)
    sass = "\n".join([
        "        /*0100*/                   LDL R1, [R1] ;",
        "        /*0110*/                   HGMMA.64x32x16.F32.BF16 R152, gdesc[UR56], RZ, !UPT ;",
        "        /*0120*/                   STL [R1+0x4], R4 ;",
        "        /*0130*/               @P4 BRA 0x110 ;",
        "        /*0140*/                   LDL R2, [R1] ;",
    ])
    assert ns["hot_local_accesses"](sass) == ["0x120 STL [R1+0x4], R4"]


def test_kv_l2_hints_rewrite_every_kv_copy_and_no_q_copy(compiled, hinted):
    """With SPARSE_MLA_GLUON_KV_L2=evict_last every kv-row cp.async of the variant carries FlashMLA's
    L2::cache_hint.L2::256B form (PTX; LDGSTS.E.BYPASS.LTC256B in SASS) and Q's copies stay plain: the 64 x D_qk
    tile in 16-byte copies over the producer's threads, 36 per thread at D_qk 576, 32 at 512. The copy count is
    the default variant's, and the hinted variant keeps within the same spill budget (none in a tile loop)."""
    from sparse_mla.mqa.gluon_sm90 import config

    assert len(hinted) == len(L2_VARIANTS)
    errors = [row for row in hinted if "error" in row]
    assert not errors, "\n".join(f"{r['variant']}: {r['error']}" for r in errors)
    default = {tuple(r["variant"]): r for r in compiled}
    for row in hinted:
        v = tuple(row["variant"])
        producer_threads = 32 * (config.PRODUCER_WARPS if v[3] == "split" else 4)  # pair: the 4-warp default partition
        q_copies = 64 * (576 if v[1] else 512) * 2 // 16 // producer_threads
        assert row["plain_copies"] == q_copies, f"{v}: {row['plain_copies']} plain copies, Q has {q_copies}"
        assert row["hinted_copies"] > 0 and row["ltc256b_sass"] > 0, v
        assert row["hinted_copies"] + row["plain_copies"] == default[v]["plain_copies"], v
        assert default[v]["hinted_copies"] == 0 and default[v]["ltc256b_sass"] == 0, v
        budget = FP8_SPILL_BUDGET if v[4] else SPILL_BUDGET
        assert row["spills"] is not None and row["spills"] <= budget, f"{v}: {row['spills']} bytes of spill stores"
        assert not row["hot_local"], f"{v}: local-memory accesses in a tile loop: {row['hot_local']}"
