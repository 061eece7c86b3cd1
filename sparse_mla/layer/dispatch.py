"""Which path computes a prefill step: the registry, the thresholds, forcing, and the explanation.

Plain Python on a ``PrefillStep`` (no tensors), so every decision is testable on the CPU.

Automatic order (the first that applies wins):

1. ``dense_mha`` when every top-k list is the whole causal window (``PrefillStep.dense_eligible``):
   it does the fewest FLOPs at the best rate.
2. ``masked_mha`` when the MHA work over the causal windows is at most a limit times the sparse
   MQA work over the top-k (``THRESHOLDS``: one row per heads-per-rank bucket, with one limit for
   pure prefills and one for steps with a cached prefix) and no window exceeds the row's
   ``masked_max_window``.
3. ``mqa_grouped`` when H <= 64 (two or more queries per 128-row tile) and the step has between the
   row's ``grouped_min_tokens`` and ``grouped_max_tokens`` new tokens, on pure prefills, and behind a
   cached prefix too where the row's ``grouped_cached`` says so (measured with the Gluon attention and
   the shared-memory union: grouping pays at 16 / 32 heads on long steps with or without a cache).
4. ``mqa_per_token``.
5. Any path whose ``supports`` holds (e.g. masked MHA for dims the MQA kernels do not take).

Forcing: ``path=`` (argument) or the environment variable ``SPARSE_MLA_PATH`` (read when the
argument is None or "auto"). A forced path that does not support the step is **not** an error: the
automatic choice runs instead, a ``PathFallbackWarning`` is issued and logged with the reason, at WARNING the
first time that kind of fallback (forced path, its source, the path run instead) happens in the process and at
DEBUG after (a server calls every layer every step), and the decision records ``fell_back=True``. An unknown
name in ``path=`` raises ValueError; an unknown name in the environment variable warns and is ignored (a typo in
the environment must not stop a server).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

from .. import env
from ..choices import NEVER, Choice, line
from .paths import MASKED_MHA_MAX_HEAD_DIM, MQA_KV_LORA_RANKS, MQA_ROPE_DIMS, DenseMHA, MaskedMHA, SparseMQA
from .problem import PrefillStep, causal_sums

logger = logging.getLogger("sparse_mla")

ENV_VAR = env.PATH.name

# The registry: name -> path object (supports(step) -> (ok, reason), run(problem) -> o).
PATHS = {p.name: p for p in (DenseMHA(), MaskedMHA(), SparseMQA("grouped"), SparseMQA("per_token"))}
PATH_NAMES = tuple(PATHS)


@dataclass(frozen=True)
class HeadsThresholds:
    """The crossover limits for steps with at most ``max_heads`` heads per rank (one table row).

    The work ratio is ``mha_work / sparse_work`` (MHA FLOPs over every query's whole causal window
    over sparse MQA FLOPs over its top-k). Pure prefills and steps with a cached prefix get separate
    masked-MHA limits: in a pure prefill the top-k of the early queries covers most of their short
    windows and the masked kernel skips whole key tiles; behind a cached prefix it rarely can
    (measured: masked MHA won at ratio 1.08 on a pure 8K prompt and lost by 25% at ratio 1.03 after
    a 6K cache, H = 16).
    """

    max_heads: int
    masked_max_ratio_pure: float  # masked MHA when no request with new tokens has a cached prefix ...
    masked_max_ratio_cached: float  # ... or when some has, and the work ratio is at most this
    masked_max_window: int  # and no request window (cached + new) is longer than this
    grouped_min_tokens: int  # grouped sparse MQA (else per token) on pure prefills from this many new tokens ...
    grouped_max_tokens: int = NEVER  # ... up to this many
    grouped_cached: bool = False  # ... and in that band behind a cached prefix too


# ---------------------------------------------------------------------------------------------
# The layer path's crossover thresholds (this module's decision; docs/decisions.md lists every decision with its
# switch and result file). Fitted by sparse_mla.layer.calibration.fit_thresholds on results/sweep_paths.json
# (`python benchmarks/sweep_paths.py --budget-s 240` on an H200: 120 points, 3 layouts, 16-128 heads, 1K-64K pure
# prompts, 2K-28K cached prefixes): the automatic choice is the best measured path at every point (within 5%;
# tests/layer/test_dispatch.py re-checks it on the committed JSON). Grouping pays at 16 and 32 heads from a few
# thousand tokens on, behind a cached prefix too (1.2-1.7x over per token at 16K-64K); at 64 heads (G = 2) only for
# 3K-5.6K-token pure prefills; never at 128 heads (G = 1). Each limit sits halfway (geometric) between the last
# measured win and the first loss. grouped_min_tokens = NEVER turns grouping off for a bucket; path="mqa_grouped"
# still forces it.
# ---------------------------------------------------------------------------------------------
THRESHOLDS: tuple[HeadsThresholds, ...] = (
    HeadsThresholds(16, masked_max_ratio_pure=0.67, masked_max_ratio_cached=0.814, masked_max_window=65536,
                    grouped_min_tokens=3072, grouped_max_tokens=NEVER, grouped_cached=True),
    HeadsThresholds(32, masked_max_ratio_pure=0.43, masked_max_ratio_cached=0.559, masked_max_window=65536,
                    grouped_min_tokens=1536, grouped_max_tokens=NEVER, grouped_cached=True),
    HeadsThresholds(64, masked_max_ratio_pure=0.43, masked_max_ratio_cached=0.0, masked_max_window=65536,
                    grouped_min_tokens=3072, grouped_max_tokens=5632),
    HeadsThresholds(128, masked_max_ratio_pure=0.514, masked_max_ratio_cached=0.0, masked_max_window=65536,
                    grouped_min_tokens=NEVER),
)


class PathFallbackWarning(UserWarning):
    """A forced path does not support the step; the automatic choice ran instead."""


def mha_work(step: PrefillStep) -> int:
    """FLOPs of causal MHA over every query's whole window: 2 H (qk_nope + qk_rope + v) sum(window)."""
    keys = sum(causal_sums(c, n) for c, n in zip(step.cached_lens, step.new_lens))
    return 2 * step.num_heads * (step.mha_qk_head_dim + step.v_head_dim) * keys


def sparse_work(step: PrefillStep) -> int:
    """Useful FLOPs of sparse MQA: 2 H (kv_lora + qk_rope + kv_lora) sum(min(topk, window))."""
    keys = sum(causal_sums(c, n, step.topk) for c, n in zip(step.cached_lens, step.new_lens))
    return 2 * step.num_heads * (step.latent_d_qk + step.kv_lora_rank) * keys


def work_ratio(step: PrefillStep) -> float:
    """mha_work / sparse_work (inf when the step has no work)."""
    s = sparse_work(step)
    return mha_work(step) / s if s else float("inf")


def has_cached_prefix(step: PrefillStep) -> bool:
    """Whether some request with new tokens has a cached prefix (chunked prefill, prefix cache)."""
    return any(c > 0 for c, n in zip(step.cached_lens, step.new_lens) if n > 0)


def thresholds_for(num_heads: int, table: tuple[HeadsThresholds, ...] | None = None) -> HeadsThresholds:
    """The row of ``table`` (default ``THRESHOLDS``) for ``num_heads`` heads per rank: the first
    with max_heads >= num_heads, the last beyond the table."""
    table = table or THRESHOLDS
    for row in table:
        if num_heads <= row.max_heads:
            return row
    return table[-1]


def masked_ratio_limit(step: PrefillStep, table: tuple[HeadsThresholds, ...] | None = None) -> float:
    """The largest work ratio at which the automatic choice runs masked MHA for ``step``."""
    row = thresholds_for(step.num_heads, table)
    return row.masked_max_ratio_cached if has_cached_prefix(step) else row.masked_max_ratio_pure


@dataclass(frozen=True)
class PathDecision:
    """The outcome of ``explain``: the path that runs, why, and every path's ``supports`` answer."""

    path: str
    reason: str
    requested: str | None = None  # the forced name (argument or environment), None for automatic
    fell_back: bool = False  # a forced path did not support the step
    supports: dict[str, tuple[bool, str]] = field(default_factory=dict)
    work_ratio: float = float("nan")
    attention_backend: str = ""  # which sparse MQA kernel backend the MQA paths launch here, and why
    union_backend: str = ""  # which union builder the grouped MQA path runs here, and why

    @property
    def choice(self) -> Choice:
        """``Choice(path, reason)``."""
        return Choice(self.path, self.reason)

    def __str__(self) -> str:
        lines = [line("path", self.choice)]
        lines += [f"  {name}: {'yes' if ok else 'no'} - {why}" for name, (ok, why) in self.supports.items()]
        if self.attention_backend:
            lines.append(f"  (sparse MQA paths) {self.attention_backend}")
        if self.union_backend:
            lines.append(f"  (grouped MQA path) {self.union_backend}")
        return "\n".join(lines)


_WARNED: set[tuple] = set()  # kinds of fallback already logged at WARNING (a few paths x sources: bounded)


def _log_fallback(kind: tuple, msg: str) -> None:
    """The log line of a fallback: WARNING the first time its ``kind`` is seen (saying that later ones log at DEBUG),
    DEBUG after. ``kind`` holds no step-dependent value, so a server gets one WARNING per kind, not one per call."""
    if kind in _WARNED:
        logger.debug(msg)
        return
    _WARNED.add(kind)
    logger.warning("%s (further fallbacks of this kind are logged at DEBUG)", msg)


def _requested(path: str | None) -> tuple[str | None, str]:
    if path is not None and path != "auto":
        if path not in PATHS:
            raise ValueError(f"path must be 'auto' or one of {PATH_NAMES}, got {path!r}")
        return path, "path="
    value = env.get(env.PATH).strip()
    if not value or value == "auto":
        return None, ""
    if value not in PATHS:
        msg = f"{ENV_VAR}={value!r} is not a path ({', '.join(PATH_NAMES)}); ignoring it"
        _log_fallback(("unknown", value), msg)
        warnings.warn(msg, PathFallbackWarning, stacklevel=4)
        return None, ""
    return value, f"{ENV_VAR}="


def path_rule(step: PrefillStep, sup: dict[str, tuple[bool, str]], ratio: float,
              table: tuple[HeadsThresholds, ...] | None = None) -> Choice:
    """The automatic ``Choice(path, reason)`` given every path's ``supports`` answer and the work
    ratio, under ``table`` (default: ``THRESHOLDS``; the calibration tries candidate tables).

    Raises:
        ValueError: no path supports the step (the message says what the caller can change).
    """
    row = thresholds_for(step.num_heads, table)
    if sup["dense_mha"][0]:
        return Choice("dense_mha", sup["dense_mha"][1])
    limit = masked_ratio_limit(step, table)
    max_win = row.masked_max_window
    kind = "with a cached prefix" if has_cached_prefix(step) else "pure prefill"
    if sup["masked_mha"][0] and ratio <= limit and step.max_window <= max_win:
        return Choice("masked_mha", f"MHA/sparse work ratio {ratio:.2f} <= {limit} for H = {step.num_heads} ({kind}) "
                                    f"and longest window {step.max_window} <= {max_win}")
    why_not_masked = (sup["masked_mha"][1] if not sup["masked_mha"][0] else
                      f"MHA/sparse work ratio {ratio:.2f} > {limit} ({kind})" if ratio > limit else
                      f"longest window {step.max_window} > {max_win}")
    lo, hi = row.grouped_min_tokens, row.grouped_max_tokens
    scope = "pure prefills and cached prefixes" if row.grouped_cached else "pure prefills"
    band = f"[{lo}, {hi}] ({scope})" if lo < NEVER else "(grouping off for this many heads)"
    if sup["mqa_grouped"][0] and lo <= step.num_tokens <= hi and (row.grouped_cached or not has_cached_prefix(step)):
        return Choice("mqa_grouped", f"H = {step.num_heads} <= 64 and T = {step.num_tokens} in {band}; "
                                     f"not masked MHA: {why_not_masked}")
    if sup["mqa_per_token"][0]:
        if not sup["mqa_grouped"][0]:
            why_not_grouped = sup["mqa_grouped"][1]
        elif has_cached_prefix(step) and not row.grouped_cached and lo <= step.num_tokens <= hi:
            why_not_grouped = "a cached prefix (grouping measured to pay on pure prefills only at this many heads)"
        else:
            why_not_grouped = f"T = {step.num_tokens} not in {band}"
        return Choice("mqa_per_token", f"not grouped: {why_not_grouped}; not masked MHA: {why_not_masked}")
    for name, (ok, why) in sup.items():
        if ok:
            return Choice(name, f"the only supported path: {why}")
    details = "; ".join(f"{n}: {w}" for n, (_, w) in sup.items())
    changes = "; ".join(f"({i}) {c}" for i, c in enumerate(what_to_change(step, sup), 1))
    raise ValueError(f"no path supports this step ({details}). What you can change: {changes}")


def what_to_change(step: PrefillStep, sup: dict[str, tuple[bool, str]]) -> list[str]:
    """What a caller can change so that some path supports ``step``, one item per refusal reason
    (for the error raised when no path does)."""
    out = []
    if not step.kernels_available:
        out.append("run on a CUDA GPU, or on a CPU set TRITON_INTERPRET=1 before importing sparse_mla and pass "
                   "float16 tensors (the interpreter computes bf16 dots wrongly)")
    if not sup["dense_mha"][0] and step.dense_topk is not True:
        out.append("if every top-k list is its token's whole causal window, pass dense_topk=True (then the dense MHA "
                   "path, plain PyTorch, runs anywhere)")
    if step.kv_lora_rank not in MQA_KV_LORA_RANKS or step.qk_rope_head_dim not in MQA_ROPE_DIMS:
        out.append(f"the sparse MQA paths take kv_lora_rank in {MQA_KV_LORA_RANKS} and qk_rope_head_dim in "
                   f"{MQA_ROPE_DIMS} only")
    if step.mha_qk_head_dim > MASKED_MHA_MAX_HEAD_DIM or step.v_head_dim > MASKED_MHA_MAX_HEAD_DIM:
        out.append(f"masked MHA takes qk_nope + qk_rope and v_head_dim <= {MASKED_MHA_MAX_HEAD_DIM} only")
    if any("cap" in why for _, why in sup.values()):
        out.append("split the step into smaller chunks (fewer new tokens or shorter cached windows per call) to fit "
                   "the MHA paths' memory caps")
    return out or ["nothing known: please report the step (explain(step) prints every path's reason)"]


def explain(step: PrefillStep, path: str | None = None, *, describe_backends: bool = True,
            log: bool = False) -> PathDecision:
    """The decision for ``step`` with every path's ``supports`` answer.

    Args:
        step: the plain-Python step description.
        path: None or "auto" (automatic, or the environment variable if set), or a path name.
        describe_backends: fill ``attention_backend`` / ``union_backend`` (device queries and string
            building: ~0.1 ms of host time, which ``dsa_prefill``'s own call skips).
        log: the one log line of a ``dsa_prefill`` call: DEBUG, or WARNING (the first fallback of its kind: module
            docstring) and a ``PathFallbackWarning`` when a forced path fell back. Without it nothing is logged or
            warned, except for an unknown name in the environment variable.

    Returns:
        ``PathDecision``; ``fell_back`` is True when the forced path does not support the step.

    Raises:
        TypeError: ``step`` is not a ``PrefillStep``.
        ValueError: an unknown ``path`` name; no path supports the step.
    """
    if not isinstance(step, PrefillStep):
        raise TypeError(f"step must be a PrefillStep, got {type(step).__name__}")
    requested, source = _requested(path)
    sup = {name: p.supports(step) for name, p in PATHS.items()}
    ratio = work_ratio(step)
    from ..mqa.backends import describe_for_device
    from ..union.backends import describe_for_step

    backend = describe_for_device(num_heads=step.num_heads, num_tokens=step.num_tokens,
                                  kv_fp8=step.kv_format is not None) if describe_backends else ""
    union = describe_for_step(step.num_heads, step.topk) if describe_backends else ""
    if requested is not None and sup[requested][0]:
        d = PathDecision(requested, f"forced by {source}{requested}", requested, False, sup, ratio, backend, union)
    else:
        name, why = path_rule(step, sup, ratio)
        if requested is not None:
            why = f"forced {requested} ({source}) does not support the step: {sup[requested][1]}; fell back to {name}: {why}"
        d = PathDecision(name, why, requested, requested is not None, sup, ratio, backend, union)
    if log and d.fell_back:
        _log_fallback(("fell back", requested, source, d.path), f"dsa_prefill: {d.reason}")
        warnings.warn(d.reason, PathFallbackWarning, stacklevel=3)
    elif log:
        logger.debug("dsa_prefill: path=%s T=%d H=%d B=%d max_window=%d topk=%d (%s)", d.path, step.num_tokens,
                     step.num_heads, step.num_requests, step.max_window, step.topk, d.reason)
    return d


def choose_path(step: PrefillStep, path: str | None = None) -> Choice:
    """``Choice(path name, reason)`` for ``step``: ``explain`` without the backend lines (module docstring).

    Raises:
        TypeError: ``step`` is not a ``PrefillStep``.
        ValueError: an unknown ``path`` name; no path supports the step.
    """
    return explain(step, path, describe_backends=False).choice


__all__ = ["PATHS", "PATH_NAMES", "THRESHOLDS", "NEVER", "ENV_VAR", "HeadsThresholds", "PathDecision",
           "PathFallbackWarning", "explain", "choose_path", "path_rule", "mha_work", "sparse_work",
           "work_ratio", "thresholds_for", "masked_ratio_limit", "has_cached_prefix", "what_to_change"]
