"""The automatic choices of the package: one return shape (``Choice``), one sentinel (``NEVER``), one table
(``DECISIONS``).

Every chooser is a plain-Python function named ``choose_*`` that returns ``Choice(name, reason)``, so it is tested
on the CPU and its reason reaches the debug log (logger ``sparse_mla``), ``sparse_mla.mqa.interface.explain_fwd``
and ``sparse_mla.layer.explain``. ``DECISIONS`` lists each choice once: the label its explain line starts with, what
it decides, its chooser and constants, how to force it, and the result files it rests on. docs/decisions.md holds
``markdown_table()`` verbatim (tests/test_choices.py checks it). Imports nothing from the package: a leaf.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import NamedTuple

NEVER = 2**31  # a token count no step reaches: a threshold at NEVER turns its option off


class Choice(NamedTuple):
    """What an automatic choice picked, and why.

    name: the option chosen (a backend, path, method or route name; the int S for the split count).
    reason: one human-readable clause (the rule and the facts that decided it, or what forced it).
    """

    name: str | int
    reason: str


@dataclass(frozen=True)
class Decision:
    """One row of ``DECISIONS``.

    label: the start of its explain line (``label: name (reason)``); what: what it decides; chooser: the
    function that returns its ``Choice`` (module path), or None for a rule applied on the device or at import;
    home: its module and constants (Markdown); force: how a caller forces it; evidence: the result files;
    explained_by: the explain functions that print its line.
    """

    label: str
    what: str
    chooser: str | None
    home: str
    force: str
    evidence: str
    explained_by: tuple[str, ...] = ()


_FWD = "sparse_mla.mqa.interface.explain_fwd"
_LAYER = "sparse_mla.layer.explain"

DECISIONS: tuple[Decision, ...] = (
    Decision(
        "path", "layer path: dense MHA / masked MHA / grouped sparse MQA / per-token sparse MQA",
        "sparse_mla.layer.dispatch.choose_path",
        "`sparse_mla/layer/dispatch.py`: `THRESHOLDS`, `path_rule` (fitted by `layer/calibration.py`)",
        "`dsa_prefill(path=...)`; `SPARSE_MLA_PATH` where `path=` is not given (both: the switch reaches an engine's "
        "call sites without editing them; unsupported: `PathFallbackWarning`, the automatic choice runs)",
        "`results/sweep_paths.json`, `results/bench.json` (docs/notes/layer-dispatch.md)", (_LAYER, )),
    Decision(
        "method", "per-token or grouped kernel for `sparse_mla_fwd(method=\"auto\")` and `flash_mla_sparse_fwd`",
        "sparse_mla.mqa.selection.choose_method",
        "`sparse_mla/mqa/selection.py`: `GROUPING_RULES` (fitted by `fit_grouping_rules`)",
        "`method=\"per_token\"` / `\"grouped\"`", "`results/op-sweep-rule.json` (docs/notes/default-call.md)", (_FWD, )),
    Decision(
        "FP8 cache", "FP8 cache: staged to q's dtype first, or dequantized in the kernel's gather",
        "sparse_mla.kv_staging.choose_kv_dequant",
        "`sparse_mla/kv_staging.py`: `STAGE_NS_PER_ROW`, `INKERNEL_NS_PER_GATHERED_ROW`, `GROUPED_UNION_RATIO_ESTIMATE` "
        "(`estimated_union_rows`; the op stages the cache, `layer/staging.py` the windows)",
        "`kv_dequant=\"staged\"` / `\"in_kernel\"` on `sparse_mla_fwd` and `dsa_prefill`",
        "`results/op-final.json`, `results/op-a1.json` (docs/notes/default-call.md)", (_FWD, )),
    Decision(
        "kv splits", "split-KV count S of a launch (S work items share one list; exact lse-weighted combine)",
        "sparse_mla.mqa.kv_splits.choose_kv_splits",
        "`sparse_mla/mqa/kv_splits.py`: `KV_SPLIT_MODEL` (first estimates, not yet fitted); "
        "`backends.kv_split_missing` (no Gluon split variant for grouped tiles on an FP8 cache)",
        "`sparse_mla_fwd(kv_splits=S)`, `flash_mla_with_kvcache(kv_splits=S)`",
        "none yet: the H200 issue times it", (_FWD, )),
    Decision(
        "attention backend", "attention backend: Gluon sm_90 or Triton, including the few-heads rule",
        "sparse_mla.mqa.backends.choose_backend",
        "`sparse_mla/mqa/backends.py`: `triton_small_tiles_win`, `GLUON_MIN_PSEUDO_HEADS`",
        "`SPARSE_MLA_MQA_BACKEND=auto\\|triton\\|gluon_sm90` (inapplicable: ValueError with the reason)",
        "`results/gluon-v3.json`, `results/bench-0cfdc34-rule.json`, `results/bench-0cfdc34-norule.json` "
        "(docs/notes/attention-gluon.md)", (_FWD, _LAYER)),
    Decision(
        "union builder", "union builder of the grouped path: CUDA shared memory or Triton",
        "sparse_mla.union.backends.choose_union_backend", "`sparse_mla/union/backends.py`: `cuda_smem_applies`",
        "`SPARSE_MLA_UNION_BACKEND=auto\\|triton\\|cuda_smem` (inapplicable: ValueError with the reason)",
        "`results/union-cuda.json` (docs/notes/grouping.md)", (_FWD, _LAYER)),
    Decision(
        "inspection union", "`build_group_union`'s builder: one sorting CUDA kernel (opt-in) or a step builder + torch sort",
        "sparse_mla.union.backends.choose_inspection_builder",
        "`sparse_mla/union/backends.py`: `cuda_smem_applies`; `sparse_mla/union/cuda_sorted.py`: `plan_passes`, "
        "`MAX_PASSES` (a wider window falls back)",
        "`SPARSE_MLA_UNION_SORTED=0\\|1`, `SPARSE_MLA_UNION_BACKEND`",
        "`results/history/union-inspect-2e27016.json` (docs/notes/grouping.md); the kernel: none yet"),
    Decision(
        "overlap guard", "per-group fallback: a group whose union is too large runs per token (on the device)",
        None, "`sparse_mla/union/grouping.py`: `overlap_guard_ratio`, `GUARD_FRACTION_OF_G`, `GUARD_MIN_LISTS`",
        "`sparse_mla_fwd(overlap_guard=...)` (`math.inf`: off)", "`results/bench-none.json` (docs/notes/grouping.md)", (_FWD, )),
    Decision(
        "overlap probe", "per-step fallback: skip the union build when most probed groups are guarded (on the device)",
        None, "`sparse_mla/union/probe.py`: `PROBE_STRIDE`, `PROBE_MIN_GROUPS`, `PROBE_SKIP_FRACTION`",
        "- (runs with the overlap guard; `method=\"per_token\"` avoids grouping altogether)",
        "`results/bench-none.json` (docs/notes/grouping.md)"),
    Decision(
        "Gluon schedule", "Gluon schedule: pair or split (an FP8 cache always split; at import); a sub-decision of the backend",
        None, "`sparse_mla/mqa/gluon_sm90/config.py`: `schedule_for`",
        "`SPARSE_MLA_GLUON_SCHEDULE=pair\\|split` (read at import)",
        "`results/gluon-v12-full.json` (docs/notes/attention-gluon.md)"),
)

LABELS = tuple(d.label for d in DECISIONS)


def line(label: str, choice: Choice | tuple) -> str:
    """The explain line of a choice: ``label: name (reason)``.

    Raises:
        KeyError: ``label`` is not a row of ``DECISIONS``.
    """
    if label not in LABELS:
        raise KeyError(f"{label!r} is not a decision label ({', '.join(LABELS)})")
    name, reason = choice
    return f"{label}: {name} ({reason})"


def explain_lines(decided: dict[str, Choice | tuple]) -> list[str]:
    """The explain lines of ``decided`` (label -> choice), in the order of ``DECISIONS``.

    Raises:
        KeyError: a label that is not a row of ``DECISIONS``.
    """
    unknown = set(decided) - set(LABELS)
    if unknown:
        raise KeyError(f"not decision labels: {sorted(unknown)} ({', '.join(LABELS)})")
    return [line(label, decided[label]) for label in LABELS if label in decided]


def markdown_table() -> str:
    """``DECISIONS`` as a Markdown table: docs/decisions.md holds this text verbatim."""
    rows = ["| explain label | decision | chooser and constants | how to force it | evidence |", "|---|---|---|---|---|"]
    for d in DECISIONS:
        chooser = f"`{d.chooser.rpartition('.')[2]}`; " if d.chooser else ""
        rows.append(f"| `{d.label}` | {d.what} | {chooser}{d.home} | {d.force} | {d.evidence} |")
    return "\n".join(rows) + "\n"


def deprecated_alias(func, old_name: str):
    """``func`` under its former name ``old_name``: the same call, with a ``DeprecationWarning`` naming the new one."""

    @functools.wraps(func)
    def alias(*args, **kwargs):
        warnings.warn(f"{old_name} is deprecated; use {func.__module__}.{func.__name__}", DeprecationWarning,
                      stacklevel=2)
        return func(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old_name
    alias.__doc__ = f"Deprecated alias of ``{func.__name__}`` (same arguments, same result)."
    return alias


__all__ = ["NEVER", "Choice", "Decision", "DECISIONS", "LABELS", "line", "explain_lines", "markdown_table",
           "deprecated_alias"]
