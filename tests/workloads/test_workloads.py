"""sparse_mla.workloads: model configs, the synthetic top-k generator, trace files, union stats.

Everything here is plain torch on the CPU except one cross-check against the Triton union
builder (``build_group_union``: interpreter on CPU, the GPU where there is one). Whole file:
about 12 s of CPU time.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from testlib.device import DEVICE
from testlib.tolerances import all_of

from sparse_mla.workloads import (
    MODELS,
    OVERLAP_PRESETS,
    TOPK_STATS_COLUMNS,
    MLAConfig,
    OverlapModel,
    TopkTrace,
    get_model,
    load_trace,
    local_to_global,
    save_trace,
    synthetic_batch,
    synthetic_topk,
    topk_stats,
    topk_stats_table,
    union_ratio,
)

# ---------------------------------------------------------------- model configs


@pytest.mark.parametrize("name, d_qk, heads, scale_dim", [
    ("deepseek-v3.2", 576, 128, 192),
    ("glm-5", 576, 64, 256),
    ("glm-5.3-flash", 512, 64, 256),
])
def test_model_dims(name, d_qk, heads, scale_dim):
    cfg = get_model(name)
    assert cfg is MODELS[name] and cfg.name == name
    assert cfg.d_qk == d_qk and cfg.d_v == 512 and cfg.num_heads == heads and cfg.topk == 2048
    assert cfg.sm_scale == pytest.approx(scale_dim**-0.5)


def test_model_dims_published_order():
    # (heads, kv_lora_rank, qk_nope, qk_rope, v) as in docs/DESIGN.md
    got = {n: (c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) for n, c in MODELS.items()}
    assert got == {"deepseek-v3.2": (128, 512, 128, 64, 128), "glm-5": (64, 512, 192, 64, 256),
                   "glm-5.3-flash": (64, 512, 256, 0, 256)}


def test_heads_per_rank():
    assert get_model("deepseek-v3.2").heads_per_rank(8) == 16
    assert get_model("glm-5").heads_per_rank(4) == 16
    assert get_model("glm-5").heads_per_rank(1) == 64
    with pytest.raises(ValueError, match="not divisible by tp = 3"):
        get_model("deepseek-v3.2").heads_per_rank(3)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        get_model("glm-5").heads_per_rank(0)
    with pytest.raises(TypeError, match="tp must be an int"):
        get_model("glm-5").heads_per_rank(4.0)


def test_model_errors():
    with pytest.raises(ValueError, match="deepseek-v3.2, glm-5, glm-5.3-flash"):
        get_model("llama")
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_model("glm-5").num_heads = 32
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MLAConfig("x", 16, 512, 128, -1, 128)
    with pytest.raises(ValueError, match="num_heads"):
        MLAConfig("x", 0, 512, 128, 64, 128)


# ---------------------------------------------------------------- synthetic top-k


def check_lists(pos: torch.Tensor, valid: torch.Tensor, cached: int, topk: int) -> None:
    """The generator's contract: shapes, dtypes, counts, -1 padding, causal, distinct."""
    new = pos.shape[0]
    assert pos.shape == (new, topk) and pos.dtype == torch.int32
    assert valid.shape == (new,) and valid.dtype == torch.int32
    p = torch.arange(new) + cached
    assert torch.equal(valid.long(), torch.clamp(p + 1, max=topk)), "valid = min(topk, p + 1)"
    pad = torch.arange(topk)[None, :] >= valid[:, None]
    assert torch.all(pos[pad] == -1), "entries after valid[t] must be -1"
    assert torch.all(pos[~pad] >= 0), "the first valid[t] entries must be positions"
    assert torch.all(pos <= p[:, None]), "causal: a query selects positions <= its own"
    s = torch.where(pad, torch.iinfo(torch.int32).max, pos).sort(dim=1).values
    assert not torch.any((s[:, 1:] == s[:, :-1]) & ~pad[:, 1:]), "rows within one list must be distinct"


# (cached, new, topk): prefixes shorter than topk, crossing it, tiny topk (sink + window
# capped), odd sizes, a single token.
GEN_CASES = [(0, 300, 64), (0, 1, 1), (5, 40, 16), (100, 257, 64), (1000, 130, 100), (3000, 70, 3), (63, 65, 64)]


@pytest.mark.parametrize("preset", list(OVERLAP_PRESETS))
@pytest.mark.parametrize("cached, new, topk", GEN_CASES, ids=[f"c{c}-n{n}-k{k}" for c, n, k in GEN_CASES])
def test_generator_contract(preset, cached, new, topk):
    pos, valid = synthetic_topk(cached, new, topk, preset, seed=7)
    check_lists(pos, valid, cached, topk)


def test_generator_full_prefix_when_short():
    # p + 1 <= topk: the list must be exactly 0..p
    pos, valid = synthetic_topk(0, 50, 64, "mid", seed=0)
    for t in (0, 17, 49):
        assert sorted(pos[t, : valid[t]].tolist()) == list(range(t + 1))


def test_generator_sorted_and_empty():
    pos, valid = synthetic_topk(500, 40, 32, "low", seed=1, sort=True)
    check_lists(pos, valid, 500, 32)
    assert torch.all(pos[:, 1:] > pos[:, :-1]), "sort=True: ascending (full lists, no padding)"
    pos, valid = synthetic_topk(10, 0, 32, "mid")
    assert pos.shape == (0, 32) and valid.shape == (0,)


def test_generator_deterministic():
    a = synthetic_topk(700, 96, 64, "mid", seed=3)
    b = synthetic_topk(700, 96, 64, "mid", seed=3)
    c = synthetic_topk(700, 96, 64, "mid", seed=4)
    g = synthetic_topk(700, 96, 64, "mid", generator=torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[0], g[0])
    assert not torch.equal(a[0], c[0])


def test_generator_errors():
    with pytest.raises(ValueError, match="unknown overlap preset 'medium'; presets: high, mid, low, none, random"):
        synthetic_topk(0, 4, 8, "medium")
    with pytest.raises(TypeError, match="overlap must be"):
        synthetic_topk(0, 4, 8, 0.5)
    with pytest.raises(ValueError, match="cached must be >= 0"):
        synthetic_topk(-1, 4, 8)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        synthetic_topk(0, 4, 0)
    with pytest.raises(TypeError, match="new must be an int"):
        synthetic_topk(0, 4.0, 8)
    with pytest.raises(ValueError, match="OverlapModel.fresh"):
        OverlapModel(fresh=1.5)
    with pytest.raises(ValueError, match="OverlapModel.window"):
        OverlapModel(window=1.0)


# Measured union ratios at long context (cached 28672, new 4096, topk 2048; topk.py docstring).
CALIBRATED = {
    "high": {2: 1.150, 4: 1.198, 8: 1.200},
    "mid": {2: 1.150, 4: 1.327, 8: 1.401},
    "low": {2: 1.150, 4: 1.447, 8: 1.701},
}


@pytest.fixture(scope="module")
def small_long_context():
    """Each preset at topk 256 over positions 3584..4095: the same fractions at 1/8 the size."""
    return {name: synthetic_topk(3584, 512, 256, name, seed=11) for name in OVERLAP_PRESETS}


@pytest.mark.parametrize("preset", list(CALIBRATED))
def test_preset_union_ratios(small_long_context, preset):
    # Band: [calibrated - 0.01, calibrated + 0.05]. At topk 256 the ratios sit above the topk 2048
    # calibration by up to 0.045 (measured), because the window's shift of G - 1 rows and the
    # 4 sink rows weigh 8x more; a model that lost its structure would be off by 0.1 or more.
    pos, valid = small_long_context[preset]
    for G, target in CALIBRATED[preset].items():
        r = union_ratio(pos, valid, G).ratio_mean
        assert target - 0.01 <= r <= target + 0.05, f"{preset} G={G}: union ratio {r:.3f}, calibrated {target}"


def test_preset_none_is_disjoint(small_long_context):
    pos, valid = small_long_context["none"]
    for G in (2, 4, 8):  # 8 * 256 <= 3585 rows: room for disjoint lists
        assert union_ratio(pos, valid, G).ratio_mean == pytest.approx(G)
        assert union_ratio(pos, valid, G).ratio_max == pytest.approx(G)


def test_preset_random_matches_iid_formula(small_long_context):
    # G iid uniform K-subsets of n rows: E[union] = n (1 - (1 - K / n) ** G).
    pos, valid = small_long_context["random"]
    n = torch.arange(3584, 4096, dtype=torch.float64) + 1
    for G in (2, 4, 8):
        n0 = n[::G]  # n of a group's first query (the others see up to G - 1 more rows)
        expected = float((n0 * (1 - (1 - 256 / n0) ** G) / 256).mean())
        assert union_ratio(pos, valid, G).ratio_mean == pytest.approx(expected, abs=0.02)


def test_local_to_global_and_batch():
    pos = torch.tensor([[0, 2, -1], [1, -1, -1]], dtype=torch.int32)
    assert local_to_global(pos, 10).tolist() == [[10, 12, -1], [11, -1, -1]]
    assert local_to_global(pos, torch.tensor([5, 7])).tolist() == [[5, 7, -1], [8, -1, -1]]
    with pytest.raises(ValueError, match="overflows int32"):
        local_to_global(pos, 2**31 - 2)
    with pytest.raises(TypeError, match="int32"):
        local_to_global(pos.long(), 0)

    batch = synthetic_batch([0, 40, 7], [20, 33, 5], 16, "mid", seed=2)
    assert batch.cu_seqlens_q.tolist() == [0, 20, 53, 58]
    assert batch.row_offsets.tolist() == [0, 20, 93] and batch.num_kv_rows == 105
    for b, c in enumerate([0, 40, 7]):
        lo, hi = int(batch.cu_seqlens_q[b]), int(batch.cu_seqlens_q[b + 1])
        off = int(batch.row_offsets[b])
        local = torch.where(batch.indices[lo:hi] >= 0, batch.indices[lo:hi] - off, -1)
        check_lists(local.to(torch.int32), batch.valid[lo:hi], c, 16)


def test_union_ratio_matches_build_group_union():
    # Independent implementation: the Triton union builder (interpreter on CPU).
    from sparse_mla import build_group_union

    pos, valid = synthetic_topk(200, 64, 32, "low", seed=5)
    gu = build_group_union(pos.to(DEVICE), 8, topk_length=valid.to(DEVICE))
    st = union_ratio(pos, valid, 8)
    mean_valid = valid.double().reshape(-1, 8).mean(dim=1)
    assert torch.allclose(st.per_group * mean_valid, gu.lengths.cpu().double())


# ---------------------------------------------------------------- union_ratio


def test_union_ratio_hand_computed():
    idx = torch.tensor([
        [1, 2, 3, -1],   # group 0: {1, 2, 3}
        [3, 2, 4, 5],    # valid 2 -> {3, 2}; union {1, 2, 3}, mean valid 2.5 -> 1.2
        [7, 8, -1, -1],  # group 1: {7, 8} and {9}, INT_MIN padding -> union 3, mean 1.5 -> 2.0
        [-(2**31), 9, -1, -1],
        [5, -1, -1, -1],  # tail of T % G = 1 row: dropped
    ], dtype=torch.int32)
    valid = torch.tensor([3, 2, 2, 2, 1], dtype=torch.int32)
    st = union_ratio(idx, valid, 2)
    assert st.num_groups == 2
    assert st.per_group.tolist() == pytest.approx([1.2, 2.0])
    assert st.ratio_mean == pytest.approx(1.6) and st.ratio_max == pytest.approx(2.0)
    assert st.union_rows_mean == pytest.approx(3.0) and st.valid_mean == pytest.approx(2.0)
    # Without valid every non-negative entry counts: group 0 = {1, 2, 3, 4, 5} / 3.5.
    assert union_ratio(idx, None, 2).per_group[0].item() == pytest.approx(5 / 3.5)
    # G = 1: every list is its own union.
    assert union_ratio(idx, valid, 1).ratio_mean == pytest.approx(1.0)
    # Groups inside requests [0, 3) and [3, 5): groups {0, 1} and {3, 4} ({9} u {5} over 1 row).
    st = union_ratio(idx, valid, 2, cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32))
    assert st.per_group.tolist() == pytest.approx([1.2, 2.0])
    st = union_ratio(idx, valid, 2, cu_seqlens_q=torch.tensor([0, 1, 5], dtype=torch.int32))
    assert st.per_group.tolist() == pytest.approx([2.0, 2.0])  # groups {1, 2}: {2, 3} u {7, 8} over 2 rows; {3, 4}
    # A group with no valid row is left out; no complete group gives NaN.
    empty = torch.full((2, 4), -1, dtype=torch.int32)
    assert union_ratio(empty, None, 2).num_groups == 0 and math.isnan(union_ratio(empty, None, 2).ratio_mean)


def test_union_ratio_errors():
    idx = torch.zeros(4, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="indices must be an integer tensor"):
        union_ratio(idx.float(), None, 2)
    with pytest.raises(ValueError, match=r"valid must be \[T\] = \[4\]"):
        union_ratio(idx, torch.zeros(3, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"valid must be in \[0, K = 3\]"):
        union_ratio(idx, torch.full((4,), 4, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        union_ratio(idx, None, 0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        union_ratio(idx, None, 2, cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32))


# ---------------------------------------------------------------- trace files


def make_traces(layers=(3, 0, 7)) -> list[TopkTrace]:
    out = []
    for i, layer in enumerate(layers):
        pos, valid = synthetic_topk(30 + i, 12 + i, 16, "mid", seed=i)
        out.append(TopkTrace(layer, pos, valid))
    return out


def assert_same_traces(got: list[TopkTrace], want: list[TopkTrace]) -> None:
    assert [t.layer for t in got] == [t.layer for t in want]
    for g, w in zip(got, want):
        assert g.topk.dtype == torch.int32 and g.valid.dtype == torch.int32
        assert torch.equal(g.topk, w.topk) and torch.equal(g.valid, w.valid)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_trace_round_trip(tmp_path, suffix):
    traces = make_traces()
    path = tmp_path / f"trace{suffix}"
    save_trace(path, traces)
    got = load_trace(path)
    want = traces if suffix == ".pt" else sorted(traces, key=lambda t: t.layer)  # layer keys come back sorted
    assert_same_traces(got, want)
    single = TopkTrace(None, traces[0].topk, traces[0].valid)
    save_trace(path, single)
    assert_same_traces(load_trace(path), [single])


def test_trace_pt_layouts(tmp_path):
    t = make_traces((2, 5))
    flat = tmp_path / "flat.pt"
    torch.save({"layer_5.topk": t[1].topk, "layer_5.valid": t[1].valid,
                "layer2.topk": t[0].topk, "layer2.valid": t[0].valid}, flat)
    assert_same_traces(load_trace(flat), t)
    one = tmp_path / "one.pt"
    torch.save({"topk": t[0].topk, "valid": t[0].valid, "layer": torch.tensor(2)}, one)
    assert_same_traces(load_trace(one), t[:1])


def test_trace_stats_table(tmp_path):
    traces = make_traces((1, 4))
    path = tmp_path / "t.safetensors"
    save_trace(path, traces)
    rows = topk_stats_table(str(path), (2, 4))
    assert [(r["layer"], r["G"]) for r in rows] == [(1, 2), (1, 4), (4, 2), (4, 4)]
    assert all_of(tuple(r) == TOPK_STATS_COLUMNS for r in rows)
    expect = union_ratio(traces[1].topk, traces[1].valid, 4)
    assert rows[3]["ratio_mean"] == pytest.approx(expect.ratio_mean) and rows[3]["groups"] == expect.num_groups
    assert rows[3]["tokens"] == traces[1].topk.shape[0] and rows[3]["topk"] == 16
    assert topk_stats(traces[0].topk, (2,), valid=traces[0].valid)[0]["ratio_mean"] == pytest.approx(rows[0]["ratio_mean"])


class _NotATensor:
    pass


def test_trace_errors(tmp_path):
    t = make_traces((0,))[0]
    cases = {
        "int64.pt": ({"topk": t.topk.long(), "valid": t.valid}, TypeError, r"int64\.pt keys 'topk'/'valid': topk must be int32"),
        "novalid.pt": ({"topk": t.topk}, ValueError, r"novalid\.pt: missing key 'valid'"),
        "shape.pt": ({"topk": t.topk, "valid": t.valid[:-1]}, ValueError, r"valid must be \[T\]"),
        "range.pt": ({"topk": t.topk, "valid": t.valid + 100}, ValueError, r"valid must be in \[0, K = 16\]"),
        "extra.pt": ({"topk": t.topk, "valid": t.valid, "pos": t.topk}, ValueError, "unexpected keys"),
        "half.pt": ({"layer_1.topk": t.topk}, ValueError, r"layer 1 has no 'valid' key"),
        "badkey.pt": ({"layer_1.topk": t.topk, "layer_1.valid": t.valid, "misc": t.valid}, ValueError, "unexpected key 'misc'"),
        "list.pt": ([{"topk": t.topk, "valid": t.valid}, {"topk": t.topk, "valid": t.valid.long()}], TypeError,
                    r"list\.pt\[1\] keys 'topk'/'valid': valid must be int32"),
    }
    for name, (obj, exc, pattern) in cases.items():
        torch.save(obj, tmp_path / name)
        with pytest.raises(exc, match=pattern):
            load_trace(tmp_path / name)

    from safetensors.torch import save_file
    save_file({"layer_0.topk": t.topk, "layer_0.valid": t.valid.long()}, str(tmp_path / "st.safetensors"))
    with pytest.raises(TypeError, match=r"st\.safetensors keys 'layer_0.topk'/'layer_0.valid': valid must be int32"):
        load_trace(tmp_path / "st.safetensors")

    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"junk\.safetensors: cannot read"):
        load_trace(tmp_path / "junk.safetensors")
    torch.save({"topk": t.topk, "valid": t.valid, "layer": _NotATensor()}, tmp_path / "pickle.pt")
    with pytest.raises(ValueError, match=r"pickle\.pt: cannot read"):  # weights_only=True refuses arbitrary objects
        load_trace(tmp_path / "pickle.pt")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="unknown trace file type"):
        load_trace(tmp_path / "trace.npz")
    with pytest.raises(ValueError, match="distinct int layers"):
        save_trace(tmp_path / "x.safetensors", [TopkTrace(None, t.topk, t.valid), TopkTrace(None, t.topk, t.valid)])
    with pytest.raises(TypeError, match="topk must be int32"):
        TopkTrace(0, t.topk.long(), t.valid)
