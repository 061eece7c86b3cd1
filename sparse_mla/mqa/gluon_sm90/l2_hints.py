"""L2 hints on the kv-row cp.async copies of the Gluon kernels, which Triton 3.6's lowering drops.

FlashMLA's SM90 producer gathers kv rows with ``cp.async.cg.shared.global.L2::cache_hint.L2::256B`` under an
``evict_last`` policy (``createpolicy.fractional.L2::evict_last.b64 p, 1.0``): each 16-byte copy has L2 fetch the
256-byte sector group around it, and the rows stay in L2 ahead of streamed data. Gluon's
``async_copy_global_to_shared(..., eviction_policy="evict_last")`` records the policy on the TTGIR op
(``evictionPolicy = evict_last``), but Triton 3.6 lowers every cp.async to the plain form. This module restores the
hint after lowering: a Triton stages hook (``install``) wraps the ``llir`` stage of the package's own kernels
(entry ``sparse_mqa_sm90_*``), reads the source locations of the TTGIR copies that carry ``evict_last``, and
rewrites the LLVM IR copies at those locations (their ``!dbg``) into FlashMLA's form, with one ``createpolicy`` per
basic block. Copies without the policy (Q's) stay as they are. The hook is set only once a marked variant is launched
or compiled, and every other kernel compiles untouched.

The kernels mark their kv copies only with ``SPARSE_MLA_GLUON_KV_L2=evict_last`` (``config.KV_L2``): the constexpr
``KV_EVICT`` is then ``REWRITE_ID``, a digest of this file, so the marked variant is a separate compile whose Triton
cache entry changes with this code, and 0 otherwise (an int, so the launch stays replayable: ``sparse_mla.call_cache``).
A marked copy the rewrite cannot place raises ``RuntimeError`` at compile time rather than run unhinted: one without
a source location (``TRITON_DISABLE_LINE_INFO=1``), a marked location with no plain 16-byte copy in the LLVM IR, or
one shared with an unmarked copy. Written for Triton 3.6's lowering (``SUPPORTED_TRITON``); Triton 3.9's Gluon takes
the hint itself (``async_load(..., cache_policy=...)``, docs/notes/attention-gluon.md). The FP8 producer loads its
NoPE bytes through registers, so only its RoPE copies are hinted.
The text functions (``copy_locations``, ``patch_llir``) need no GPU and no Triton; tests/mqa/test_l2_hints.py
checks them, and tests/mqa/test_gluon_compile.py checks the hinted variants' PTX and SASS.
"""

from __future__ import annotations

import hashlib
import os
import re


def _rewrite_id() -> int:
    try:
        with open(__file__, "rb") as f:
            return int(hashlib.sha1(f.read()).hexdigest()[:7], 16) | 1  # nonzero, < 2**31
    except OSError:  # pragma: no cover - a package without its sources
        return 1


REWRITE_ID = _rewrite_id()  # the constexpr KV_EVICT of a marked variant (module docstring)
KERNEL_PREFIX = "sparse_mqa_sm90_"  # entry names of the package's Gluon kernels (the hook touches no other kernel)
HINTED_COPY = "cp.async.cg.shared.global.L2::cache_hint.L2::256B"
_POLICY_ASM = '"createpolicy.fractional.L2::evict_last.b64 $0, 1.0;", "=l"()'

# TTGIR: an async copy op, and its trailing location.
_TTGIR_COPY = re.compile(r"ttg\.async_copy_global_to_local\b.* loc\((.+)\)\s*$")
_TTGIR_MARK = "evictionPolicy = evict_last"
_TTGIR_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$", re.M)
# The innermost location of a TTGIR location expression: the first file location or alias in it (a callsite's
# callee comes before its caller; a name location wraps its child).
_TTGIR_LOC_ATOM = re.compile(r'"([^"]+)":(\d+):(\d+)|(#loc\d*)')
# LLVM IR: Triton 3.6's 16-byte cp.async (src-size form), its operands and its !dbg.
_LLIR_COPY = re.compile(
    r'^(?P<head>.*call void asm sideeffect )"cp\.async\.cg\.shared\.global \[ \$0 \+ 0 \], \[ \$1 \+ 0 \], 0x10, \$2;", '
    r'"r,l,r"\((?P<args>(?:[^()]|\(\d+\))*)\)(?P<tail>.*!dbg (?P<dbg>!\d+).*)$')
_LLIR_META = re.compile(r"^(!\d+) = (?:distinct )?(.*)$", re.M)
_LLIR_LABEL = re.compile(r"^(?:[\w.$-]+|\d+):")  # a basic block label starts a line


def _ttgir_location(expr: str, defs: dict, depth: int = 0) -> tuple[str, int, int] | None:
    """(file basename, line, column) of the innermost location of a TTGIR location expression, or None."""
    m = _TTGIR_LOC_ATOM.search(expr)
    if m is None or depth > 64:
        return None
    if m.group(4) is not None:
        inner = defs.get(m.group(4))
        return None if inner is None else _ttgir_location(inner, defs, depth + 1)
    return os.path.basename(m.group(1)), int(m.group(2)), int(m.group(3))


def copy_locations(ttgir: str) -> tuple[set[tuple[str, int, int]], set[tuple[str, int, int]]]:
    """(marked, unmarked): the source locations (file basename, line, column) of the TTGIR async copies that carry
    ``evict_last`` and of those that do not.

    Raises:
        RuntimeError: a marked copy has no source location, or a location holds marked and unmarked copies.
    """
    defs = dict(_TTGIR_LOC_DEF.findall(ttgir))
    marked, unmarked = set(), set()
    for line in ttgir.splitlines():
        m = _TTGIR_COPY.search(line)
        if not m:
            continue
        is_marked = _TTGIR_MARK in line
        loc = _ttgir_location(m.group(1), defs)
        if loc is None:
            if is_marked:
                raise RuntimeError("SPARSE_MLA_GLUON_KV_L2=evict_last: a marked kv copy has no source location (is "
                                   "TRITON_DISABLE_LINE_INFO set?); unset it or set SPARSE_MLA_GLUON_KV_L2=off")
            continue
        (marked if is_marked else unmarked).add(loc)
    if marked & unmarked:
        raise RuntimeError(f"SPARSE_MLA_GLUON_KV_L2=evict_last: marked and unmarked copies share the source locations "
                           f"{sorted(marked & unmarked)}")
    return marked, unmarked


def _llir_location(node: str, meta: dict) -> tuple[str, int, int] | None:
    """(file basename, line, column) of an LLVM IR ``!DILocation`` node id: its scope chain up to a ``file:``."""
    text = meta.get(node, "")
    m = re.search(r"DILocation\(line: (\d+), column: (\d+), scope: (!\d+)", text)
    if m is None:
        return None
    scope = m.group(3)
    for _ in range(64):
        s = meta.get(scope, "")
        f = re.search(r"\bfile: (!\d+)", s)
        if f:
            fm = re.search(r'DIFile\(filename: "([^"]+)"', meta.get(f.group(1), ""))
            return (os.path.basename(fm.group(1)) if fm else None), int(m.group(1)), int(m.group(2))
        up = re.search(r"\bscope: (!\d+)", s)
        if up is None:
            return None
        scope = up.group(1)
    return None


def patch_llir(llir: str, marked: set[tuple[str, int, int]]) -> tuple[str, dict]:
    """``llir`` with every 16-byte cp.async whose ``!dbg`` location is in ``marked`` rewritten to the
    ``L2::cache_hint.L2::256B`` form under an ``evict_last`` policy (one ``createpolicy`` per basic block, before
    its first rewritten copy); returns (text, copies rewritten per marked location: 0 where none matched)."""
    counts = dict.fromkeys(marked, 0)
    if not marked:
        return llir, counts
    meta = dict(_LLIR_META.findall(llir))
    out, n_pol, block_pol, cache = [], 0, None, {}
    for line in llir.splitlines():
        if _LLIR_LABEL.match(line) or line.startswith("define "):
            block_pol = None
        m = _LLIR_COPY.match(line)
        if m:
            dbg = m.group("dbg")
            if dbg not in cache:
                cache[dbg] = _llir_location(dbg, meta)
            if cache[dbg] in marked:
                if block_pol is None:
                    block_pol = f"%sparse_mla_l2_policy{n_pol}"
                    n_pol += 1
                    out.append(f"  {block_pol} = tail call i64 asm {_POLICY_ASM}")
                out.append(f'{m.group("head")}"{HINTED_COPY} [ $0 + 0 ], [ $1 + 0 ], 0x10, $2, $3;", '
                           f'"r,l,r,l"({m.group("args")}, i64 {block_pol}){m.group("tail")}')
                counts[cache[dbg]] += 1
                continue
        out.append(line)
    return "\n".join(out) + ("\n" if llir.endswith("\n") else ""), counts


def _ours(src) -> bool:
    """Whether the TTGIR module ``src`` is one of the package's kernels (its entry name; the module text otherwise)."""
    name = getattr(src, "get_entry_func_name", None)
    if name is not None:
        try:
            return name().startswith(KERNEL_PREFIX)
        except Exception:  # noqa: BLE001 - no single entry: read the text
            pass
    return f"@{KERNEL_PREFIX}" in str(src)


def _wrap_llir(make_llir):
    def llir_stage(src, metadata):
        marked = copy_locations(str(src))[0] if _ours(src) else set()
        llir = make_llir(src, metadata)
        if not marked:
            return llir
        patched, counts = patch_llir(llir, marked)
        missed = sorted(loc for loc, n in counts.items() if n == 0)
        if missed:
            raise RuntimeError(
                f"SPARSE_MLA_GLUON_KV_L2=evict_last: no plain 16-byte cp.async in the LLVM IR at the marked kv copies "
                f"{missed} (another Triton lowering?); set SPARSE_MLA_GLUON_KV_L2=off")
        return patched

    llir_stage.sparse_mla_l2_hints = True
    return llir_stage


def _chained(prev):
    def hook(*args):
        if prev is not None:
            prev(*args)
        stages = args[-4]  # (backend, stages, options, language, capability); the Protocol omits the backend
        if "llir" in stages and not getattr(stages["llir"], "sparse_mla_l2_hints", False):  # wrapped once only
            stages["llir"] = _wrap_llir(stages["llir"])

    hook.sparse_mla_l2_hints = True
    return hook


def install() -> None:
    """Make Triton compile with the stages hook (``triton.knobs.runtime.add_stages_inspection_hook``, chained after
    the hook set before) that rewrites the marked kv copies of kernels named ``sparse_mqa_sm90_*``; every other kernel
    compiles untouched. Called before every launch (``launcher.launch``) and compile (``aot.compile_variant``) of a
    marked variant, so a hook set later by someone else is chained again instead of lost; a no-op when it is
    already there."""
    from triton import knobs

    current = knobs.runtime.add_stages_inspection_hook
    if not getattr(current, "sparse_mla_l2_hints", False):
        knobs.runtime.add_stages_inspection_hook = _chained(current)
