"""``method="auto"``: the rule table (``sparse_mla.mqa.selection``), its fit, the cached workspace of the default
call, and FlashMLA's drop-in call grouping and writing into ``out=``."""

from __future__ import annotations

import json

import pytest
import torch
from testlib.device import DEVICE, DTYPE
from testlib.paths import RESULTS
from testlib.problems import neighbour_rows
from testlib.tolerances import assert_rows_close

from sparse_mla import flash_mla_sparse_fwd, flash_mla_sparse_ref
from sparse_mla.mqa import selection
from sparse_mla.mqa.selection import NEVER, GroupingRule, choose_method, explain_method, fit_grouping_rules
from sparse_mla.union import workspace as ws_mod

RULES = (GroupingRule(8, 100), GroupingRule(16, 200), GroupingRule(32, 400), GroupingRule(64, NEVER),
         GroupingRule(128, NEVER))


@pytest.mark.parametrize("H, T, want", [
    (8, 100, "grouped"), (8, 99, "per_token"), (16, 200, "grouped"), (12, 199, "per_token"), (32, 10**6, "grouped"),
    (64, 10**6, "per_token"), (128, 10**6, "per_token"), (200, 10**6, "per_token"),
])
def test_rule_table(H, T, want):
    chosen, why = choose_method("auto", H, T, rules=RULES)
    assert chosen == want, why


def test_forced_methods_and_errors():
    assert choose_method("per_token", 8, 10**6, rules=RULES) == ("per_token", "forced by method=")
    assert choose_method("grouped", 64, 1, rules=RULES)[0] == "grouped"
    with pytest.raises(ValueError, match="method must be one of"):
        choose_method("union", 16, 10)
    # a caller's G that leaves one query per tile never groups on "auto"
    assert choose_method("auto", 16, 10**6, group_size=1, rules=RULES)[0] == "per_token"
    assert "token-major" in explain_method(16, 10**6) or "per_token" in explain_method(16, 10**6)


def test_fit_takes_the_midpoint_above_the_last_loss():
    pts = []
    for t, win in ((1024, False), (2048, False), (4096, True), (8192, True)):
        pts.append(dict(heads=16, tokens=t, lists="mid", per_token_ms=1.0, grouped_ms=0.9 if win else 1.1))
    pts.append(dict(heads=16, tokens=8192, lists="none", per_token_ms=1.0, grouped_ms=1.5))  # ignored: no overlap
    pts += [dict(heads=64, tokens=t, lists="mid", per_token_ms=1.0, grouped_ms=1.2) for t in (1024, 8192)]
    pts += [dict(heads=32, tokens=t, lists="low", per_token_ms=1.0, grouped_ms=0.5) for t in (1024, 8192)]
    rules = {r.max_heads: r.min_tokens for r in fit_grouping_rules(pts)}
    assert rules[16] == round((2048 * 4096) ** 0.5)
    assert rules[32] == 1 and rules[64] == NEVER and rules[8] == NEVER and rules[128] == NEVER


def test_shipped_rules_are_the_fit_of_the_committed_sweep():
    """GROUPING_RULES equal fit_grouping_rules on the committed H200 sweep, and at every measured point the
    automatic choice is within 5% of the faster of per-token and grouped (the timing noise of one sweep; the bench
    holds the 3% acceptance, and the overlap probe keeps no-overlap lists near per token)."""
    path = RESULTS / "op-sweep-rule.json"
    if not path.exists():
        pytest.skip("results/op-sweep-rule.json not committed")
    rows = json.loads(path.read_text())["rows"]
    pts = [dict(heads=r["heads"], tokens=r["tokens"], lists=r["lists"], per_token_ms=r["calls"]["per_token"]["ms"],
                grouped_ms=r["calls"]["grouped"]["ms"]) for r in rows
           if "ms" in r["calls"].get("per_token", {}) and "ms" in r["calls"].get("grouped", {})]
    assert pts
    assert fit_grouping_rules(pts) == selection.GROUPING_RULES
    for p in pts:
        chosen, _ = choose_method("auto", p["heads"], p["tokens"])
        best = min(p["per_token_ms"], p["grouped_ms"])
        assert p[f"{chosen}_ms"] <= best * 1.05, p


def test_default_call_caches_one_workspace_per_shape_class():
    ws_mod.clear_workspace_cache()
    a = ws_mod.cached_workspace(10, 32, 8, 100, torch.device(DEVICE))
    assert ws_mod.cached_workspace(ws_mod.CACHE_TOKEN_STEP, 32, 8, 100, torch.device(DEVICE)) is a
    b = ws_mod.cached_workspace(ws_mod.CACHE_TOKEN_STEP + 1, 32, 8, 100, torch.device(DEVICE))
    assert b is not a and b.max_tokens == 2 * ws_mod.CACHE_TOKEN_STEP
    assert ws_mod.cached_workspace(5, 32, 8, 100, torch.device(DEVICE)) is b
    assert ws_mod.cached_workspace(5, 32, 4, 100, torch.device(DEVICE)) is not b  # another G
    ws_mod.clear_workspace_cache()
    assert ws_mod.cached_workspace(5, 32, 8, 100, torch.device(DEVICE)) is not b


@pytest.mark.parametrize("with_out", [False, True])
def test_drop_in_groups_and_writes_out(with_out, monkeypatch):
    """flash_mla_sparse_fwd at 16 heads with grouping on (a rule table that groups from 8 rows): token-major groups
    spanning what would be requests, attn_sink and topk_length; out= (FlashMLA ba89a346) is written and returned;
    every row, max_logits and lse match the reference."""
    monkeypatch.setattr(selection, "GROUPING_RULES", (GroupingRule(16, 8), GroupingRule(128, NEVER)))
    g = torch.Generator().manual_seed(4)
    T, H, K, N = 19, 16, 24, 200
    q = torch.randn(T, H, 576, generator=g).to(DTYPE).to(DEVICE)
    kv = torch.randn(N, 1, 576, generator=g).to(DTYPE).to(DEVICE)
    idx = neighbour_rows(T, K, N, 0.7, generator=g)[:, None].to(DEVICE)
    idx[3, 0, 5:] = -1
    lens = torch.randint(0, K + 1, (T,), generator=g).to(torch.int32).to(DEVICE)
    sink = torch.randn(H, generator=g).to(DEVICE)
    out = torch.full((T, H, 512), float("nan"), dtype=DTYPE, device=DEVICE) if with_out else None
    o, ml, lse = flash_mla_sparse_fwd(q, kv, idx, 0.05, 512, sink, lens, out=out)
    if with_out:
        assert o is out
    ro, rml, rlse = flash_mla_sparse_ref(q, kv, idx, 0.05, 512, sink, lens)
    assert_rows_close(o, ro, DTYPE, "drop-in out")
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin) and torch.allclose(lse[fin], rlse[fin], atol=1e-3, rtol=1e-3)
    assert torch.allclose(ml[fin], rml[fin], atol=1e-3, rtol=1e-3) and (ml[~fin] == float("-inf")).all()


def test_drop_in_rejects_a_bad_out():
    q = torch.randn(4, 16, 576).to(DTYPE).to(DEVICE)
    kv = torch.randn(20, 1, 576).to(DTYPE).to(DEVICE)
    idx = torch.zeros(4, 1, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="out"):
        flash_mla_sparse_fwd(q, kv, idx, 0.1, out=torch.empty(4, 16, 256, dtype=DTYPE, device=DEVICE))
    with pytest.raises(TypeError, match="out"):
        flash_mla_sparse_fwd(q, kv, idx, 0.1, out=torch.empty(4, 16, 512, dtype=torch.float32, device=DEVICE))
