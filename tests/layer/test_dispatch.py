"""The layer dispatcher as plain Python: ``PrefillStep`` in, (path, reason) out, no tensors.

Covers the automatic choice for each layout and heads per rank, refusals with their reasons,
forcing by argument and by the SPARSE_MLA_PATH environment variable, fallback of an unsupported
forced path (warning, never a crash), the thresholds table being the one that decides, and a
property test that the chosen path always supports the step.
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testlib.tolerances import all_of

from sparse_mla.bench.common import read_json
from sparse_mla.layer import dispatch
from sparse_mla.layer.dispatch import PATH_NAMES, PathFallbackWarning, choose_path, explain
from sparse_mla.layer.problem import PrefillStep, causal_sums
from sparse_mla.workloads.models import MODELS

TOPK = 2048


def step(model: str = "deepseek-v3.2", tp: int = 8, cached=(0,), new=(4096,), **kw) -> PrefillStep:
    return PrefillStep.from_model(MODELS[model], tp_size=tp, cached_lens=cached, new_lens=new, **kw)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


AUTO_CASES = [
    # Measured (results/sweep_paths.json, Gluon attention + CUDA union): grouping at 16 heads from 3K tokens and
    # at 32 heads from 1.5K, behind cached prefixes too; at 64 heads only for 3K-5.6K-token pure prefills.
    # (id, step kwargs, expected path, fragment of the reason)
    ("short-prompt-dense", dict(new=(1500,)), "dense_mha", "whole prefix"),
    ("short-with-cache-dense", dict(cached=(1000,), new=(1000,)), "dense_mha", "2000 <= 2048"),
    ("two-requests-one-long", dict(cached=(0, 0), new=(1000, 3000)), "masked_mha", "work ratio"),
    ("deepseek-tp8-4k-masked", dict(new=(4096,)), "masked_mha", "H = 16"),
    ("deepseek-tp8-mid-grouped", dict(new=(8192,)), "mqa_grouped", "in [3072,"),
    ("deepseek-tp8-long-grouped", dict(new=(32768,)), "mqa_grouped", "pure prefills and cached prefixes"),
    ("deepseek-tp1-mid-per-token", dict(tp=1, new=(16384,)), "mqa_per_token", "G = 1"),
    ("deepseek-tp1-long-per-token", dict(tp=1, new=(65536,)), "mqa_per_token", "nothing to group"),
    ("glm5-tp4-long-grouped", dict(model="glm-5", tp=4, new=(32768,)), "mqa_grouped", "H = 16"),
    ("nope-tp1-long-per-token", dict(model="glm-5.3-flash", tp=1, new=(65536,)), "mqa_per_token", "not grouped"),
    ("nope-tp4-8k-grouped", dict(model="glm-5.3-flash", tp=4, new=(8192,)), "mqa_grouped", "in [3072,"),
    ("nope-tp4-8k-after-cache", dict(model="glm-5.3-flash", tp=4, cached=(4096,), new=(8192,)), "mqa_grouped",
     "cached prefixes"),
    ("nope-tp2-8k-grouped", dict(model="glm-5.3-flash", tp=2, new=(8192,)), "mqa_grouped", "in [1536,"),
    ("nope-tp1-8k-out-of-band", dict(model="glm-5.3-flash", tp=1, new=(8192,)), "mqa_per_token", "not in [3072, 5632]"),
    ("nope-tp1-4k-after-cache", dict(model="glm-5.3-flash", tp=1, cached=(4096,), new=(4096,)), "mqa_per_token",
     "cached prefix"),
    ("chunk-after-long-cache", dict(cached=(60000,), new=(2048,)), "mqa_per_token", "not grouped"),
    ("few-tokens-long-cache", dict(cached=(30000,), new=(8,)), "mqa_per_token", "not grouped"),
    ("cache-heavy-chunk", dict(cached=(20000,), new=(256,)), "mqa_per_token", "not grouped"),
    ("long-prompt-grouped", dict(new=(20000,)), "mqa_grouped", "work ratio"),
]


@pytest.mark.parametrize("kw,expected,why", [c[1:] for c in AUTO_CASES], ids=[c[0] for c in AUTO_CASES])
def test_auto_choice(kw, expected, why):
    name, reason = choose_path(step(**kw))
    assert name == expected, reason
    assert why in reason


def test_explain_lists_every_path_with_reasons():
    d = explain(step(new=(32768,)))
    assert set(d.supports) == set(PATH_NAMES)
    ok, why = d.supports["dense_mha"]
    assert not ok and "32768 > topk 2048" in why
    assert d.supports["mqa_grouped"][0] and d.supports["mqa_per_token"][0]
    assert d.work_ratio == pytest.approx(dispatch.work_ratio(step(new=(32768,))))
    text = str(d)
    assert all(name in text for name in PATH_NAMES)
    d128 = explain(step(tp=1, new=(32768,)))
    assert not d128.supports["mqa_grouped"][0] and "H = 128" in d128.supports["mqa_grouped"][1]


def test_refusals():
    # caller says the lists are partial, or topk_length may cut them: no dense even for short prompts
    assert choose_path(step(new=(100,), dense_topk=False))[0] != "dense_mha"
    d = explain(step(new=(100,), has_topk_length=True))
    assert d.path != "dense_mha" and "topk_length" in d.supports["dense_mha"][1]
    assert choose_path(step(new=(100,), has_topk_length=True, dense_topk=True))[0] == "dense_mha"
    # the caller's promise makes long prompts dense too
    assert choose_path(step(new=(30000,), dense_topk=True))[0] == "dense_mha"
    # no Triton (CPU without TRITON_INTERPRET): only the dense path; a sparse step has no path at all
    assert choose_path(step(new=(100,), kernels_available=False))[0] == "dense_mha"
    d = explain(step(new=(100,), kernels_available=False), path="masked_mha")
    assert d.fell_back and "TRITON_INTERPRET" in d.supports["masked_mha"][1]
    with pytest.raises(ValueError, match="no path supports") as err:
        choose_path(step(new=(30000,), kernels_available=False))
    # the error says what the caller can change: the device / interpreter and fp16, or dense_topk
    assert "What you can change: (1) run on a CUDA GPU" in str(err.value) and "TRITON_INTERPRET=1" in str(err.value)
    assert "float16" in str(err.value) and "(2) if every top-k list is its token's whole causal window, pass dense_topk=True" \
        in str(err.value)
    with pytest.raises(ValueError, match=r"What you can change: .*dense_topk=True.*kv_lora_rank in \(512,\).*<= 512 only$"):
        choose_path(PrefillStep(16, 256, 600, 64, 600, TOPK, (0,), (2**21,)))
    with pytest.raises(ValueError, match=r"What you can change: .*kv_lora_rank in \(512,\).*smaller chunks"):
        choose_path(PrefillStep(16, 256, 128, 64, 128, TOPK, (0,), (2**20,)))
    # dims the MQA kernels do not take: masked MHA is the only sparse path, even when long
    odd = PrefillStep(16, 256, 128, 64, 128, TOPK, (0,), (65536,))
    d = explain(odd)
    assert d.path == "masked_mha" and "only supported" in d.reason
    assert "kv_lora_rank" in d.supports["mqa_per_token"][1]
    # memory caps of the MHA paths
    huge = step(tp=1, new=(2**20,))
    d = explain(huge)
    assert not d.supports["masked_mha"][0] and "GiB" in d.supports["masked_mha"][1]


def test_forcing_by_argument_and_environment(monkeypatch):
    s = step(new=(32768,))
    assert choose_path(s, "mqa_per_token") == ("mqa_per_token", "forced by path=mqa_per_token")
    monkeypatch.setenv(dispatch.ENV_VAR, "masked_mha")
    name, reason = choose_path(s)
    assert name == "masked_mha" and dispatch.ENV_VAR in reason
    assert choose_path(s, "auto")[0] == "masked_mha", "'auto' defers to the environment"
    assert choose_path(s, "mqa_per_token")[0] == "mqa_per_token", "the argument wins over the environment"
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert choose_path(s)[0] == "mqa_grouped"


def test_forced_unsupported_falls_back():
    s = step(new=(32768,))
    d = explain(s, "dense_mha")  # explain itself warns about nothing
    assert d.fell_back and d.requested == "dense_mha" and d.path == "mqa_grouped"
    assert "does not support" in d.reason and "32768 > topk 2048" in d.reason
    with pytest.warns(PathFallbackWarning, match="fell back to mqa_grouped"):
        dispatch.explain(s, "dense_mha", describe_backends=False, log=True)
    d = explain(step(tp=1, new=(32768,)), "mqa_grouped")
    assert d.fell_back and d.path == "mqa_per_token"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not dispatch.explain(s, "mqa_per_token", describe_backends=False, log=True).fell_back


def test_unknown_names(monkeypatch):
    with pytest.raises(ValueError, match="path must be"):
        choose_path(step(), "flash_attn")
    monkeypatch.setenv(dispatch.ENV_VAR, "flash_attn")
    with pytest.warns(PathFallbackWarning, match="not a path"):
        name, _ = choose_path(step(new=(32768,)))
    assert name == "mqa_grouped"


def test_thresholds_table_decides(monkeypatch):
    assert choose_path(step(new=(4096,)))[0] == "masked_mha"
    s = step(new=(8192,))
    R = dispatch.HeadsThresholds
    monkeypatch.setattr(dispatch, "THRESHOLDS", (R(128, 0.0, 0.0, 10**9, 256),))
    assert choose_path(s)[0] == "mqa_grouped"
    monkeypatch.setattr(dispatch, "THRESHOLDS", (R(16, 1.6, 0.1, 4096, 256), R(128, 0.8, 0.7, 10**9, 256)))
    name, reason = choose_path(s)
    assert name == "mqa_grouped" and "longest window 8192 > 4096" in reason
    monkeypatch.setattr(dispatch, "THRESHOLDS", (R(16, 1.6, 0.1, 4096, 10**9), R(128, 0.5, 0.7, 10**9, 256)))
    assert choose_path(s)[0] == "mqa_per_token"
    assert choose_path(step(tp=4, new=(8192,)))[0] == "mqa_grouped"  # 32 heads: the second row
    assert dispatch.thresholds_for(16).masked_max_ratio_pure == 1.6 and dispatch.thresholds_for(17).max_heads == 128
    assert dispatch.thresholds_for(1024).max_heads == 128
    # pure prefill and cached prefix read different limits
    pure, cached = step(new=(2048,), cached=(0,)), step(new=(1024,), cached=(2048,))
    assert not dispatch.has_cached_prefix(pure) and dispatch.has_cached_prefix(cached)
    assert dispatch.masked_ratio_limit(pure) == 1.6 and dispatch.masked_ratio_limit(cached) == 0.1
    assert not dispatch.has_cached_prefix(step(cached=(500, 0), new=(0, 3000)))  # no new tokens behind the cache
    name, reason = choose_path(step(new=(3000,), cached=(2048,)))
    assert name == "mqa_per_token" and "(with a cached prefix)" in reason


def test_dispatcher_within_5pct_of_best_on_committed_sweep():
    """The layer issue's bound, re-checked on the committed H200 sweep: at every measured point the
    automatic choice is within 5% of the fastest measured path (a threshold edit that breaks this
    fails here, on the CPU)."""
    import json

    from testlib.paths import RESULTS as results

    from sparse_mla.layer.calibration import TOLERANCE, evaluate

    ev = evaluate(json.loads((results / "sweep_paths.json").read_text())["rows"])
    assert len(ev) >= 100 and {e["new"] for e in ev} >= {1024, 65536}
    # the benchmark's scenarios (layer paths timed the same way) are measured points too
    bench = evaluate(read_json(results / "bench.json")[2])
    assert len(bench) >= 16
    bad = [e for e in ev + bench if e["slowdown"] > TOLERANCE]
    assert not bad, bad


def test_fit_thresholds_recovers_planted_crossovers():
    """On synthetic rows where masked MHA wins below a known ratio (pure prefills only) and grouping
    wins on pure prefills from 12000 tokens, the fit admits every win and no loss, and leaves other
    buckets alone."""
    from sparse_mla.layer.calibration import evaluate, fit_thresholds

    rows = []
    for new in (3000, 4096, 6000, 8192, 12000, 16384):
        for cached in (0, 4096):
            s = step(new=(new,), cached=(cached,))
            masked = 1.0 if (cached == 0 and dispatch.work_ratio(s) < 0.9) else 2.0
            grouped = 1.2 if (new >= 12000 and cached == 0) else 1.6
            rows.append({"model": "deepseek-v3.2", "heads": 16, "cached": cached, "new": new, "topk": TOPK,
                         "paths": {"masked_mha": {"ms": masked}, "mqa_per_token": {"ms": 1.5},
                                   "mqa_grouped": {"ms": grouped}}})
    fitted = fit_thresholds(rows)
    assert all_of(e["slowdown"] == 1.0 for e in evaluate(rows, fitted)), evaluate(rows, fitted)
    assert fitted[0].masked_max_ratio_cached == 0.0 and 0.6 < fitted[0].masked_max_ratio_pure < 1.3
    assert 8192 < fitted[0].grouped_min_tokens <= 12000
    assert fitted[1:] == dispatch.THRESHOLDS[1:]


def test_work_model():
    for c, n, k in [(0, 10, 4), (3, 10, 4), (10, 5, 4), (0, 1, 1), (7, 0, 3), (2, 9, 100)]:
        brute = sum(c + i + 1 for i in range(n))
        brute_k = sum(min(k, c + i + 1) for i in range(n))
        assert causal_sums(c, n) == brute and causal_sums(c, n, k) == brute_k
    s = step(new=(4096,))
    H = 16
    assert dispatch.mha_work(s) == 2 * H * (192 + 128) * causal_sums(0, 4096)
    assert dispatch.sparse_work(s) == 2 * H * (576 + 512) * causal_sums(0, 4096, TOPK)


def test_step_validation():
    with pytest.raises(ValueError, match="num_heads"):
        PrefillStep(0, 512, 128, 64, 128, TOPK, (0,), (1,))
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        PrefillStep(16, 512, 128, -1, 128, TOPK, (0,), (1,))
    with pytest.raises(ValueError, match="B >= 1"):
        PrefillStep(16, 512, 128, 64, 128, TOPK, (0, 1), (1,))
    with pytest.raises(ValueError, match="new_lens"):
        PrefillStep(16, 512, 128, 64, 128, TOPK, (0,), (-1,))
    with pytest.raises(TypeError, match="cached_lens"):
        PrefillStep(16, 512, 128, 64, 128, TOPK, (0.5,), (1,))
    with pytest.raises(TypeError, match="dense_topk"):
        PrefillStep(16, 512, 128, 64, 128, TOPK, (0,), (1,), dense_topk="yes")
    with pytest.raises(ValueError, match="tp_size"):
        step(tp=3)
    with pytest.raises(TypeError, match="PrefillStep"):
        explain({"num_heads": 16})
    s = step(model="glm-5.3-flash", tp=2, cached=(5, 0), new=(3, 0))
    assert (s.num_heads, s.mha_qk_head_dim, s.latent_d_qk, s.num_tokens, s.max_window) == (32, 256, 512, 3, 8)


@settings(max_examples=200, deadline=None)
@given(
    model=st.sampled_from(sorted(MODELS)),
    tp=st.sampled_from([1, 2, 4, 8]),
    reqs=st.lists(st.tuples(st.integers(0, 70000), st.integers(0, 70000)), min_size=1, max_size=4),
    topk=st.sampled_from([16, 512, 2048]),
    dense_topk=st.sampled_from([None, True, False]),
    has_topk_length=st.booleans(),
    forced=st.sampled_from([None, *PATH_NAMES]),
)
def test_choice_always_supported(model, tp, reqs, topk, dense_topk, has_topk_length, forced):
    s = step(model=model, tp=tp, cached=tuple(r[0] for r in reqs), new=tuple(r[1] for r in reqs), topk=topk,
             dense_topk=dense_topk, has_topk_length=has_topk_length)
    d = explain(s, forced)
    assert _can_run(s, d.path), d
    for name in PATH_NAMES:  # every supports() answer agrees with the first-principles rule below
        assert d.supports[name][0] == _can_run(s, name), (name, d.supports[name])
    assert d.fell_back == (forced is not None and not _can_run(s, forced))
    if forced is not None and not d.fell_back:
        assert d.path == forced
    if forced is None and _can_run(s, "dense_mha"):
        assert d.path == "dense_mha"


def _can_run(s: PrefillStep, path: str) -> bool:
    """Whether ``path`` can compute step ``s`` exactly, from the paths' documented limits (not from
    ``supports()``): dense needs whole-window lists; the MQA kernels kv_lora_rank 512 and qk_rope 0 / 64,
    grouping H <= 64; masked MHA head dims <= 512; the MHA paths' scratch within its caps."""
    windows = [c + n for c, n in zip(s.cached_lens, s.new_lens)]
    longest = max((c + n for c, n in zip(s.cached_lens, s.new_lens) if n > 0), default=0)
    kv_bytes = sum(windows) * s.num_heads * (s.qk_nope_head_dim + s.v_head_dim) * 2
    mask_bytes = sum(n * -(-(c + n) // 32) * 4 for c, n in zip(s.cached_lens, s.new_lens))
    mha_ok = kv_bytes <= 16 * 2**30
    if path == "dense_mha":
        whole = s.dense_topk is True or (s.dense_topk is None and not s.has_topk_length and longest <= s.topk)
        return whole and mha_ok
    if path == "masked_mha":
        return (s.kernels_available and s.qk_nope_head_dim + s.qk_rope_head_dim <= 512 and s.v_head_dim <= 512
                and mha_ok and mask_bytes <= 2 * 2**30)
    mqa = s.kernels_available and s.kv_lora_rank == 512 and s.qk_rope_head_dim in (0, 64)
    return mqa and (path == "mqa_per_token" or s.num_heads <= 64)


def test_fallback_warning_is_an_error_in_the_suite():
    """pyproject's filterwarnings turns PathFallbackWarning into an error: a test that forces a path which
    then falls back fails instead of passing on the fallback's result."""
    with pytest.raises(PathFallbackWarning, match="fell back"):
        dispatch.explain(step(new=(32768,)), "dense_mha", describe_backends=False, log=True)


def test_calibration_edge_cases(monkeypatch):
    """Rows beyond the last bucket's heads fit the last bucket; a fast path whose check failed is not
    'best'; the fit reads dispatch.THRESHOLDS at call time; a rounded limit never admits the next
    measured point."""
    from sparse_mla.layer import calibration

    def row(heads, new, masked, per_token, **masked_extra):
        return {"model": "deepseek-v3.2", "heads": heads, "cached": 0, "new": new, "topk": TOPK,
                "paths": {"masked_mha": {"ms": masked, **masked_extra}, "mqa_per_token": {"ms": per_token}}}

    assert calibration.measured_ms(row(16, 4096, 1.0, 2.0, check_ok=False)) == {"mqa_per_token": 2.0}
    assert calibration.measured_ms(row(16, 4096, 1.0, 2.0, check_failed=True)) == {"mqa_per_token": 2.0}
    R = dispatch.HeadsThresholds
    monkeypatch.setattr(dispatch, "THRESHOLDS", (R(16, 0.0, 0.0, 0, dispatch.NEVER), R(128, 0.0, 0.0, 0, dispatch.NEVER)))
    # 256 heads (beyond the table) with masked MHA winning at 4K: the last row learns it
    fitted = calibration.fit_thresholds([row(256, 4096, 1.0, 2.0), row(256, 16384, 9.0, 3.0)])
    assert len(fitted) == 2 and fitted[0] == dispatch.THRESHOLDS[0]
    assert fitted[1].masked_max_ratio_pure > 0 and calibration.evaluate([row(256, 4096, 1.0, 2.0)], fitted)[0]["slowdown"] == 1.0
    # limits are rounded up to 3 decimals unless that would admit the next measured point
    assert calibration._limit(0.5, [0.5, 0.6]) == 0.548
    x = calibration._limit(0.5, [0.5, 0.5008])
    assert 0.5 <= x < 0.5008


def test_bf16_under_the_interpreter_declines_the_kernel_paths(monkeypatch):
    """The interpreter computes bf16 dots wrongly: the kernel paths say so in supports() (the step
    then runs dense MHA when that is exact, or fails with every path's reason), never garbage."""
    import torch

    from sparse_mla.layer.problem import kernels_available

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    assert kernels_available(cpu, torch.float16) and not kernels_available(cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="no path supports this step.*bf16 dots wrongly"):
        explain(step(new=(8192,), kernels_available=False))
    assert explain(step(new=(1024,), kernels_available=False)).path == "dense_mha"
