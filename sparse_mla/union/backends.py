"""The one selection point of the top-k union builder (``build_union``: rows, membership words, lengths).

Backends:

* ``"cuda_smem"``: ``sparse_mla.union.cuda_smem``, CUDA C++ with the hash table in shared memory
  (runtime-compiled through CuPy). Applies on a CUDA device of compute capability >= 8.0 (tested
  on the H200, sm_90) when CuPy imports (the ``cuda12`` / ``cuda13`` extra), not under
  ``TRITON_INTERPRET=1``, for G in 1..16 when the shared-memory table holds every union the caller
  keeps at a load factor <= 3/4 (``cuda_smem.plan_table``): with the overlap guard, the unions it
  keeps; without it, all G * K entries; for ``build_group_union`` (``complete=True``, no per-token
  fallback) always all G * K entries.
* ``"triton"``: ``sparse_mla.union.triton_tl``, the portable builder (hash table in global memory):
  every other case, and the CPU-tested twin the CUDA builder is held to.

``SPARSE_MLA_UNION_BACKEND`` = ``auto`` (default) | ``triton`` | ``cuda_smem`` forces one; forcing
``cuda_smem`` where it cannot run raises ``ValueError`` with the reason. Forced where its table
cannot hold every kept union (e.g. G = 16, K = 2048 without a guard), it still runs: the groups
whose union overflows its capacity run per token (exact, but grouped less than the Triton builder
would). Each call logs one debug line (logger ``sparse_mla``) naming the backend and why.

The decision itself (``choose_union_backend``, ``Choice(backend, reason)``) is plain Python over
``UnionDeviceFacts``, so it is tested on the CPU.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from .. import call_cache, env
from ..choices import Choice, deprecated_alias, line
from . import cuda_smem, triton_tl
from .grouping import default_group_size, overlap_guard_ratio

logger = logging.getLogger("sparse_mla")

BACKENDS = ("triton", "cuda_smem")
ENV_VAR = env.UNION_BACKEND.name
MIN_CAPABILITY = (8, 0)
LABEL = "union builder"  # its row of sparse_mla.choices.DECISIONS


@dataclass(frozen=True)
class UnionDeviceFacts:
    """What the choice depends on besides the shape.

    device_type: "cuda" or "cpu"; capability: (major, minor) of a CUDA device, else None;
    max_smem_per_block: opt-in shared memory per block in bytes (0 off CUDA); interpreted:
    TRITON_INTERPRET=1; cupy_error: None when CuPy imports, else why not.
    """

    device_type: str
    capability: tuple[int, int] | None
    max_smem_per_block: int
    interpreted: bool
    cupy_error: str | None


def device_facts(device: torch.device | str) -> UnionDeviceFacts:
    """The facts of ``device`` (CUDA queries are cached by ``cuda_smem``; CuPy is imported only for
    a CUDA device, once)."""
    device = torch.device(device)
    interp = env.interpreted()
    if device.type != "cuda" or not torch.cuda.is_available():
        return UnionDeviceFacts(device.type, None, 0, interp, None)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    cap, smem, err = _cuda_facts(idx)
    return UnionDeviceFacts("cuda", cap, smem, interp, err)


@functools.cache
def _cuda_facts(device_index: int) -> tuple[tuple[int, int], int, str | None]:
    err = cuda_smem.cupy_import_error()
    return torch.cuda.get_device_capability(device_index), cuda_smem.max_smem_per_block(device_index), err


def cuda_smem_applies(facts: UnionDeviceFacts, group_size: int, topk: int, guard_ratio: float | None = None,
                      complete: bool = False) -> tuple[bool, bool, str]:
    """(runnable, fits, reason) of the CUDA builder: ``runnable`` = it can run here at all;
    ``fits`` = its table holds every union the caller keeps (module docstring)."""
    if facts.interpreted:
        return False, False, "TRITON_INTERPRET=1 (the CPU run uses the Triton twin)"
    if facts.device_type != "cuda" or facts.capability is None:
        return False, False, f"indices are on {facts.device_type}, not a CUDA device"
    if tuple(facts.capability) < MIN_CAPABILITY:
        return False, False, (f"compute capability {facts.capability[0]}.{facts.capability[1]} < "
                              f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}")
    if facts.cupy_error is not None:
        return False, False, (f"CuPy is not importable ({facts.cupy_error}); install the sparse-mla[cuda12] or "
                              "[cuda13] extra matching the CUDA of torch")
    if not 1 <= group_size <= cuda_smem.MAX_GROUP_SIZE:
        return False, False, f"G = {group_size} outside 1..{cuda_smem.MAX_GROUP_SIZE}"
    if group_size * topk > cuda_smem.MAX_ENTRIES:
        return False, False, f"G * K = {group_size * topk} entries per group > {cuda_smem.MAX_ENTRIES}"
    try:
        plan = cuda_smem.plan_table(group_size, topk, guard_ratio, facts.max_smem_per_block)
    except ValueError as exc:
        return False, False, str(exc)
    table = f"{plan.slots}-slot table ({plan.smem_bytes // 1024} KiB, capacity {plan.capacity} rows)"
    if complete:
        if plan.exact:
            return True, True, f"{table} holds all G * K = {group_size * topk} entries"
        return True, False, (f"{table} cannot hold all G * K = {group_size * topk} entries "
                             "and the complete union is asked for")
    if plan.keeps_guarded:
        what = "all G * K entries" if guard_ratio is None else f"every union the overlap guard keeps ({guard_ratio:g} * K)"
        return True, True, f"{table} holds {what}"
    what = f"G * K = {group_size * topk}" if guard_ratio is None else \
        f"the {cuda_smem.guard_limit(group_size, topk, guard_ratio)} rows the overlap guard keeps"
    return True, False, f"{table} < {what}: larger unions would run per token"


def _mode(mode: str | None) -> str:
    """The union-builder mode: ``mode``, or ``SPARSE_MLA_UNION_BACKEND`` when None; empty means auto."""
    mode = env.get(env.UNION_BACKEND) if mode is None else mode
    return (mode or "auto").strip() or "auto"


def choose_union_backend(device: torch.device | str | UnionDeviceFacts, group_size: int, topk: int, *,
                         guard_ratio: float | None = None, complete: bool = False, mode: str | None = None) -> Choice:
    """``Choice(backend, reason)`` for a union build of G = ``group_size`` lists of ``topk`` entries.

    Args:
        device: the indices' device, or its ``UnionDeviceFacts`` (the rule is plain Python over them).
        guard_ratio: the overlap guard's ratio (None: no guard); complete: every union must be built
            (``build_group_union``).
        mode: "auto", "triton" or "cuda_smem"; None reads ``SPARSE_MLA_UNION_BACKEND``.

    Raises:
        ValueError: an unknown mode; "cuda_smem" forced where it cannot run, or with
            ``complete=True`` where its table cannot hold every entry.
    """
    facts = device if isinstance(device, UnionDeviceFacts) else device_facts(device)
    mode = _mode(mode)
    if mode not in ("auto", *BACKENDS):
        raise ValueError(f"{ENV_VAR} must be one of auto, {', '.join(BACKENDS)}; got {mode!r}")
    if mode == "triton":
        return Choice("triton", f"forced by {ENV_VAR}=triton")
    runnable, fits, why = cuda_smem_applies(facts, group_size, topk, guard_ratio, complete)
    if mode == "cuda_smem":
        if not runnable or (complete and not fits):
            raise ValueError(f"{ENV_VAR}=cuda_smem but the CUDA union builder cannot run here: {why}")
        return Choice("cuda_smem", f"forced by {ENV_VAR}=cuda_smem; {why}")
    if runnable and fits:
        return Choice("cuda_smem", why)
    return Choice("triton", f"cuda_smem does not apply: {why}")


select_union_backend = deprecated_alias(choose_union_backend, "select_union_backend")


def choose_inspection_builder(device: torch.device | str | UnionDeviceFacts, group_size: int, topk: int, *,
                              mode: str | None = None, sorted_kernel: str | None = None) -> Choice:
    """``Choice(builder, reason)`` for ``build_group_union`` (sorted, complete unions): "cuda_sorted"
    (``sparse_mla.union.cuda_sorted``, sorted in the kernel) where ``SPARSE_MLA_UNION_SORTED`` is 1, the CUDA
    builders can run and ``SPARSE_MLA_UNION_BACKEND`` is auto; else ``choose_union_backend(complete=True)``'s
    builder, whose unions are then sorted in torch. The kernel is opt-in until a GPU run holds it to the
    reference (tests/union/test_cuda_sorted.py).

    Args:
        mode: as ``choose_union_backend`` (None reads ``SPARSE_MLA_UNION_BACKEND``).
        sorted_kernel: "0" or "1"; None reads ``SPARSE_MLA_UNION_SORTED``.

    Raises:
        ValueError: as ``choose_union_backend``; ``SPARSE_MLA_UNION_SORTED`` neither 0 nor 1.
    """
    facts = device if isinstance(device, UnionDeviceFacts) else device_facts(device)
    mode = _mode(mode)
    sorted_kernel = (env.get(env.UNION_SORTED) if sorted_kernel is None else sorted_kernel).strip() or "0"
    if sorted_kernel not in ("0", "1"):
        raise ValueError(f"{env.UNION_SORTED.name} must be 0 or 1, got {sorted_kernel!r}")
    if mode == "auto" and sorted_kernel == "1":
        runnable, _, _ = cuda_smem_applies(facts, group_size, topk, None, True)  # cuda_sorted shares its limits
        if runnable:
            return Choice("cuda_sorted", f"{env.UNION_SORTED.name}=1 and the CUDA builders run here: unions sorted "
                                         "in the kernel")
    return choose_union_backend(facts, group_size, topk, complete=True, mode=mode)


def describe_union_backend(device: torch.device | str, group_size: int, topk: int,
                           guard_ratio: float | None = None) -> str:
    """One line: which union builder runs for such a call, and why."""
    try:
        return line(LABEL, choose_union_backend(device, group_size, topk, guard_ratio=guard_ratio))
    except ValueError as exc:
        return line(LABEL, ("error", exc))


def describe_for_step(num_heads: int, topk: int, device: torch.device | None = None) -> str:
    """The ``describe_union_backend`` line for a grouped step of ``num_heads`` heads (G =
    ``default_group_size``) and ``topk``, with the default overlap guard, on ``device`` (default: the
    current CUDA device, else the CPU); what ``sparse_mla.layer.explain`` prints."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    G = default_group_size(num_heads)
    return describe_union_backend(device, G, topk, overlap_guard_ratio(G))


# build_union's choice per (device, G, K, guard, complete, switch, interpreter, call_cache generation): device facts are
# fixed; a changed rule or table is announced by call_cache.invalidate()
_CHOSEN: dict = {}


def build_union(
    indices: torch.Tensor, topk_length: torch.Tensor | None, num_kv_rows: int, group_size: int,
    group_start: torch.Tensor, group_len: torch.Tensor, route: torch.Tensor, workspace,
    rows: torch.Tensor, bits: torch.Tensor, union_len: torch.Tensor, *,
    guard_ratio: float | None = None, complete: bool = False,
) -> str:
    """Build the unions of the planned groups with the selected backend; returns its name.

    Tensors as ``triton_tl.build_union`` / ``cuda_smem.build_union`` (same outputs: the first
    union_len[g] entries of rows / bits, unsorted; guarded groups get group_len 0 and route 1).
    ``workspace``: the ``SparseMLAWorkspace`` whose hash tables the Triton builder uses.
    ``complete``: every union must be built (no per-token fallback; ``build_group_union``).
    With ``cuda_smem`` a group whose union overflows its table gets union_len -1, group_len 0 and
    route 1 (its rows run per token); with ``complete=True`` that cannot happen (selection).
    """
    key = (str(indices.device), group_size, indices.shape[1], guard_ratio, complete, env.get(env.UNION_BACKEND),
           env.interpreted(), call_cache.generation())
    chosen = _CHOSEN.get(key)
    if chosen is None:
        chosen = _CHOSEN[key] = choose_union_backend(indices.device, group_size, indices.shape[1],
                                                     guard_ratio=guard_ratio, complete=complete)
    name, why = chosen
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("union builder: backend %s (%s)", name, why)
    if name == "cuda_smem":
        cuda_smem.build_union(indices, topk_length, num_kv_rows, group_size, group_start, group_len, route, rows, bits,
                              union_len, guard_ratio=guard_ratio)
    else:
        triton_tl.build_union(indices, topk_length, num_kv_rows, group_size, group_start, group_len, route,
                              workspace.union_tables, workspace.union_table_bits, rows, bits, union_len,
                              guard_ratio=guard_ratio)
    return name


def warmup(device: torch.device | str) -> bool:
    """Compile the CUDA builder for ``device`` when it can run there (no launch); True if it can."""
    facts = device_facts(device)
    runnable, _, _ = cuda_smem_applies(facts, 1, 1)
    if runnable:
        device = torch.device(device)
        cuda_smem.get_kernel(device.index if device.index is not None else torch.cuda.current_device())
    return runnable


__all__ = [
    "BACKENDS", "ENV_VAR", "UnionDeviceFacts", "build_union", "choose_inspection_builder", "choose_union_backend",
    "cuda_smem_applies", "describe_for_step", "describe_union_backend", "device_facts", "select_union_backend",
    "warmup"
]
