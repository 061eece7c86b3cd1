"""The L2-hint rewrite of the Gluon kernels' kv copies (``sparse_mla.mqa.gluon_sm90.l2_hints``) on IR text, no GPU.

The compiled kernels' PTX and SASS with the hints: tests/mqa/test_gluon_compile.py; bit-identical outputs on a GPU:
tests/mqa/test_gluon.py::test_kv_l2_hints_change_no_bit.
"""

from __future__ import annotations

import re

import pytest

from sparse_mla.mqa.gluon_sm90 import l2_hints

# Two marked copies (one through a callsite, one through a name location), one unmarked (Q's) copy.
TTGIR = """\
#loc3 = loc("/src/sparse_mla/mqa/gluon_sm90/pair.py":115:60)
#loc4 = loc("/src/sparse_mla/mqa/gluon_sm90/pair.py":149:33)
#loc5 = loc(callsite(#loc3 at #loc4))
#loc6 = loc("/src/sparse_mla/mqa/gluon_sm90/pair.py":122:64)
#loc7 = loc("base1"(#loc6))
module {
  tt.func public @sparse_mqa_sm90_pair_kernel() {
    %1 = ttg.async_copy_global_to_local %a, %b mask %c evictionPolicy = evict_last : T -> S loc(#loc5)
    %2 = ttg.async_copy_global_to_local %a, %b mask %c evictionPolicy = evict_last : T -> S loc(#loc7)
    %3 = ttg.async_copy_global_to_local %d, %e mask %f : T -> S loc("/src/sparse_mla/mqa/gluon_sm90/common.py":124:4)
  } loc(#loc)
} loc(#loc)
"""

_COPY = ('tail call void asm sideeffect "cp.async.cg.shared.global [ $0 + 0 ], [ $1 + 0 ], 0x10, $2;", '
         '"r,l,r"(ptr addrspace(3) %{s}, ptr addrspace(1) %{g}, i32 %{n}) #9, !dbg !{dbg}')
LLIR = f"""\
define void @sparse_mqa_sm90_pair_kernel(ptr addrspace(1) %0) !dbg !5 {{
  %10 = add i32 0, 0
  {_COPY.format(s=11, g=12, n=13, dbg=20)}
  {_COPY.format(s=14, g=15, n=13, dbg=21)}
  {_COPY.format(s=16, g=17, n=18, dbg=22)}
  br label %30

30:                                               ; preds = %1
  {_COPY.format(s=31, g=32, n=33, dbg=20)}
  ret void
}}

!1 = !DIFile(filename: "pair.py", directory: "/src/sparse_mla/mqa/gluon_sm90")
!9 = !DIFile(filename: "common.py", directory: "/src/sparse_mla/mqa/gluon_sm90")
!5 = distinct !DISubprogram(name: "sparse_mqa_sm90_pair_kernel", linkageName: "k", scope: !1, file: !1, line: 400)
!11 = distinct !DILexicalBlockFile(scope: !5, file: !1, discriminator: 0)
!12 = distinct !DILexicalBlockFile(scope: !5, file: !9, discriminator: 0)
!19 = !DILocation(line: 149, column: 33, scope: !11)
!20 = !DILocation(line: 115, column: 60, scope: !11, inlinedAt: !19)
!21 = !DILocation(line: 122, column: 64, scope: !11, inlinedAt: !19)
!22 = !DILocation(line: 124, column: 4, scope: !12)
"""


def test_marked_copy_locations_are_the_innermost_source_locations():
    assert l2_hints.copy_locations(TTGIR) == ({("pair.py", 115, 60), ("pair.py", 122, 64)}, {("common.py", 124, 4)})
    assert l2_hints.copy_locations(TTGIR.replace("evictionPolicy = evict_last", ""))[0] == set()


def test_a_marked_copy_the_rewrite_cannot_place_is_an_error():
    # no source location (TRITON_DISABLE_LINE_INFO=1 leaves loc(unknown)): raise, never run unhinted
    no_loc = TTGIR.replace("loc(#loc5)", "loc(#loc)").replace("} loc(#loc)\n} loc(#loc)", "}\n}") + "#loc = loc(unknown)\n"
    with pytest.raises(RuntimeError, match="TRITON_DISABLE_LINE_INFO"):
        l2_hints.copy_locations(no_loc)
    # the same location marked and unmarked (a helper inlined with and without the policy)
    shared = TTGIR.replace('loc("/src/sparse_mla/mqa/gluon_sm90/common.py":124:4)', "loc(#loc3)")
    with pytest.raises(RuntimeError, match="share the source locations"):
        l2_hints.copy_locations(shared)


def test_patch_rewrites_exactly_the_marked_copies_with_one_policy_per_block():
    marked = l2_hints.copy_locations(TTGIR)[0]
    out, counts = l2_hints.patch_llir(LLIR, marked)
    assert counts == {("pair.py", 115, 60): 2, ("pair.py", 122, 64): 1}
    lines = out.splitlines()
    hinted = [ln for ln in lines if l2_hints.HINTED_COPY in ln]
    assert len(hinted) == 3
    assert all('"r,l,r,l"(' in ln and re.search(r", i64 %sparse_mla_l2_policy\d\) #9, !dbg !2[01]$", ln) for ln in hinted)
    assert all("0x10, $2, $3;" in ln for ln in hinted)
    # Q's copy (common.py) is untouched, byte for byte
    assert "  " + _COPY.format(s=16, g=17, n=18, dbg=22) in lines
    # one createpolicy per basic block, each before the block's first rewritten copy, each used in its block
    pol = [i for i, ln in enumerate(lines) if "createpolicy.fractional.L2::evict_last.b64" in ln]
    assert len(pol) == 2
    assert "%sparse_mla_l2_policy0" in lines[pol[0]] and "%sparse_mla_l2_policy1" in lines[pol[1]]
    assert l2_hints.HINTED_COPY in lines[pol[0] + 1] and l2_hints.HINTED_COPY in lines[pol[1] + 1]
    assert "i64 %sparse_mla_l2_policy1)" in lines[pol[1] + 1]
    assert lines.index("30:                                               ; preds = %1") < pol[1]
    # everything else is unchanged
    rest = [ln for ln in lines if l2_hints.HINTED_COPY not in ln and "createpolicy" not in ln]
    assert rest == [ln for ln in LLIR.splitlines() if "cp.async" not in ln or "!dbg !22" in ln]


def test_patch_without_marks_or_matches_changes_nothing():
    assert l2_hints.patch_llir(LLIR, set()) == (LLIR, {})
    assert l2_hints.patch_llir(LLIR, {("pair.py", 999, 1)}) == (LLIR, {("pair.py", 999, 1): 0})
    other_file = ("split.py", 115, 60)  # same line and column, other file
    assert l2_hints.patch_llir(LLIR, {other_file}) == (LLIR, {other_file: 0})


class _Module:
    """A stand-in for the TTGIR module the llir stage receives (only ``str`` is read)."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


def _stage_of(monkeypatch, make_llir):
    """The llir stage as the installed hook leaves it (the knob restored after the test)."""
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", None)
    l2_hints.install()
    stages = {"ttgir": None, "llir": make_llir}
    knobs.runtime.add_stages_inspection_hook(object(), stages, None, None, 90)
    return stages["llir"]


def test_hook_rewrites_only_the_package_kernels(monkeypatch):
    stage = _stage_of(monkeypatch, lambda src, metadata: LLIR)
    out = stage(_Module(TTGIR), {})
    assert out.count(l2_hints.HINTED_COPY) == 3
    other = TTGIR.replace("@sparse_mqa_sm90_pair_kernel", "@user_kernel")
    assert stage(_Module(other), {}) == LLIR


def test_hook_raises_when_a_marked_copy_is_missed(monkeypatch):
    """Every marked location must be rewritten somewhere: none (no debug locations in the LLVM IR) or one of two
    (its copy lowered in another form) raises."""
    stage = _stage_of(monkeypatch, lambda src, metadata: re.sub(r", !dbg !\d+", "", LLIR))
    with pytest.raises(RuntimeError, match=r"\('pair.py', 115, 60\), \('pair.py', 122, 64\)"):
        stage(_Module(TTGIR), {})
    other_form = LLIR.replace(_COPY.format(s=14, g=15, n=13, dbg=21), _COPY.format(s=14, g=15, n=13, dbg=21).replace(
        "0x10", "0x8"))
    stage = _stage_of(monkeypatch, lambda src, metadata: other_form)
    with pytest.raises(RuntimeError, match=r"\[\('pair.py', 122, 64\)\]"):
        stage(_Module(TTGIR), {})


def test_install_chains_once_and_again_after_a_foreign_hook(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    seen = []
    first = lambda *a: seen.append("first")  # noqa: E731
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", first)
    l2_hints.install()
    ours = knobs.runtime.add_stages_inspection_hook
    l2_hints.install()
    assert knobs.runtime.add_stages_inspection_hook is ours is not first
    stages = {"llir": lambda src, metadata: LLIR}
    ours(object(), stages, None, None, 90)
    assert seen == ["first"] and stages["llir"](_Module(TTGIR), {}).count(l2_hints.HINTED_COPY) == 3
    # a hook set after ours (a profiler replacing the knob) is chained in front of ours again at the next install
    later = lambda *a: seen.append("later")  # noqa: E731
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", later)
    l2_hints.install()
    knobs.runtime.add_stages_inspection_hook(object(), {"llir": lambda src, metadata: LLIR}, None, None, 90)
    assert seen == ["first", "later"]
    # ours twice in one chain (a foreign hook that chained ours, then ours again) wraps the stage once
    stages = {"llir": lambda src, metadata: LLIR}
    twice = l2_hints._chained(l2_hints._chained(None))
    twice(object(), stages, None, None, 90)
    assert stages["llir"](_Module(TTGIR), {}).count(l2_hints.HINTED_COPY) == 3


def test_unknown_mode_is_a_clear_error(monkeypatch):
    from sparse_mla.mqa.gluon_sm90 import config

    monkeypatch.setattr(config, "KV_L2", "evict_first")
    with pytest.raises(ValueError, match="SPARSE_MLA_GLUON_KV_L2 must be one of"):
        config.variant_constexprs(False, True, "pair")
    monkeypatch.setattr(config, "KV_L2", "evict_last")
    assert config.variant_constexprs(False, True, "pair")["KV_EVICT"] == l2_hints.REWRITE_ID > 0
    assert config.variant_constexprs(True, True, "split", kv_fp8=True)["KV_EVICT"] == l2_hints.REWRITE_ID
    monkeypatch.setattr(config, "KV_L2", "off")
    assert config.variant_constexprs(False, True, "pair")["KV_EVICT"] == 0


@pytest.mark.parametrize("mode", ["off", "evict_last"])
def test_every_constexpr_is_a_replayable_launch_argument(monkeypatch, mode):
    """The constexprs go into every recorded launch (``LaunchCache``), and ``sparse_mla.call_cache`` replays only
    launches whose non-tensor arguments are None / int / float / bool: a str there would turn replay off for every
    Gluon call."""
    from sparse_mla.mqa.gluon_sm90 import config

    monkeypatch.setattr(config, "KV_L2", mode)
    for v in config.all_variants():
        grouped, has_pe, _, schedule, kv_fp8, kv_split = v
        cx = config.variant_constexprs(grouped, has_pe, schedule, kv_fp8, kv_split)
        assert all(x is None or type(x) in (int, float, bool) for x in cx.values()), (v, cx)


def test_rewrite_id_is_a_digest_of_the_rewrite():
    """A change of l2_hints.py changes the marked variants' constexpr, hence their Triton cache key."""
    import hashlib

    with open(l2_hints.__file__, "rb") as f:
        assert l2_hints.REWRITE_ID == int(hashlib.sha1(f.read()).hexdigest()[:7], 16) | 1
