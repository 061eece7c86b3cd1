"""Scratch space for the grouped path, sized once from the largest step.

An engine creates one ``SparseMLAWorkspace`` per device at start-up (from its max batched tokens,
topk and heads per rank) and passes it to every ``sparse_mla_fwd`` call; a step then allocates no
device memory for the union (outputs too, with ``out=`` / ``lse=``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import call_cache
from ..kv_format import FP8_DS_MLA
from ..launch_cache import recorder
from . import probe as union_probe
from .grouping import MAX_GROUP_SIZE, default_group_size
from .triton_tl import hash_table_slots

# Union builder programs per SM (each holds one hash table): docs/notes/grouping.md, benchmarks/tune_triton.py.
UNION_PROGRAMS_PER_SM = 2


def _union_programs(device: torch.device) -> int:
    """Persistent programs of the hash union builder: UNION_PROGRAMS_PER_SM per SM on a GPU, 2 under
    the interpreter."""
    if device.type == "cuda":
        return UNION_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 2


@dataclass
class SparseMLAWorkspace:
    """Every scratch buffer of the grouped path, for up to ``max_tokens`` query rows.

    Buffers (device ``device``): ``group_start``, ``group_len``, ``union_len`` [max_groups] int32;
    ``route`` [max_tokens] int8; ``union_rows``, ``union_bits`` [max_groups, G * K] int32; the
    Triton union builder's hash tables ``union_tables`` (-1) and ``union_table_bits`` (0), [P, 2 * G_P * K_P]
    int32 for P persistent programs (the CUDA builder keeps its tables in shared memory and needs no
    buffer of its own); the overlap probe's scratch (``probe_*``, ``sparse_mla.union.probe``).
    About ``max_tokens * K * 8`` bytes plus P * 256 KiB at G = 8,
    topk 2048 (0.27 GiB + 66 MiB for 16K tokens on an H200).
    """

    max_tokens: int
    topk: int
    group_size: int
    max_kv_rows: int
    device: torch.device
    replay_by_identity = True  # sparse_mla.call_cache keys a call by this object and replays with its buffers

    def __post_init__(self) -> None:
        if not 1 <= self.group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"group_size must be in [1, {MAX_GROUP_SIZE}], got {self.group_size}")
        if self.max_tokens < 1 or self.topk < 1:
            raise ValueError(f"max_tokens and topk must be >= 1, got {self.max_tokens}, {self.topk}")
        G, K = self.group_size, self.topk
        self.max_groups = triton.cdiv(self.max_tokens, G)
        dev = torch.device(self.device)
        self.group_start = torch.zeros(self.max_groups, dtype=torch.int32, device=dev)
        self.group_len = torch.zeros(self.max_groups, dtype=torch.int32, device=dev)
        self.union_len = torch.zeros(self.max_groups, dtype=torch.int32, device=dev)
        self.route = torch.zeros(self.max_tokens, dtype=torch.int8, device=dev)
        self.union_rows = torch.empty(self.max_groups, G * K, dtype=torch.int32, device=dev)
        self.union_bits = torch.empty(self.max_groups, G * K, dtype=torch.int32, device=dev)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # the Triton builder's, on first use
        # the overlap probe's scratch (sparse_mla.union.probe): every PROBE_STRIDE-th group, a route copy, the decision
        n_probe = triton.cdiv(self.max_groups, union_probe.PROBE_STRIDE)
        self.probe_group_start = torch.zeros(n_probe, dtype=torch.int32, device=dev)
        self.probe_len_before = torch.zeros(n_probe, dtype=torch.int32, device=dev)
        self.probe_group_len = torch.zeros(n_probe, dtype=torch.int32, device=dev)
        self.probe_union_len = torch.zeros(n_probe, dtype=torch.int32, device=dev)
        self.probe_route = torch.zeros(self.max_tokens, dtype=torch.int8, device=dev)
        self.probe_skip = torch.zeros(1, dtype=torch.int32, device=dev)

    def _hash_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            dev = torch.device(self.device)
            n_tables = min(self.max_groups, _union_programs(dev))
            slots = hash_table_slots(self.group_size, self.topk)
            self._tables = (torch.full((n_tables, slots), -1, dtype=torch.int32, device=dev),
                            torch.zeros((n_tables, slots), dtype=torch.int32, device=dev))
        return self._tables

    def staging_buffer(self, num_rows: int, dtype: torch.dtype) -> torch.Tensor | None:
        """[num_rows, 576] ``dtype`` rows for an FP8 cache's staged route (``sparse_mla.kv_staging``), from a buffer of
        ``max_kv_rows`` rows allocated on first use; None when the cache has more rows (the call allocates them)."""
        if num_rows > self.max_kv_rows:
            return None
        buf = getattr(self, "_staging", None)
        if buf is None or buf.dtype != dtype:
            if recorder() is not None:  # a recorded call must not take this buffer for one of its own allocations
                recorder().fail("the workspace's staging buffer is allocated in this call")
            buf = self._staging = torch.empty(self.max_kv_rows, FP8_DS_MLA.d_qk, dtype=dtype, device=torch.device(self.device))
        return buf[:num_rows]

    @property
    def union_tables(self) -> torch.Tensor:
        """The Triton union builder's hash-table keys [P, slots] int32 (-1 = empty), allocated on first use (the
        CUDA builder keeps its tables in shared memory)."""
        return self._hash_tables()[0]

    @property
    def union_table_bits(self) -> torch.Tensor:
        """The Triton union builder's hash-table membership words [P, slots] int32 (0), allocated with the keys."""
        return self._hash_tables()[1]

    @classmethod
    def for_problem(cls, num_tokens: int, topk: int, num_heads: int, num_kv_rows: int,
                    device: torch.device | str, group_size: int | None = None) -> SparseMLAWorkspace:
        """A workspace for ``num_tokens`` rows of ``num_heads`` heads (G from ``default_group_size``)."""
        G = group_size or default_group_size(num_heads)
        return cls(num_tokens, topk, G, num_kv_rows, torch.device(device))

    def fits(self, num_tokens: int, topk: int, group_size: int, num_kv_rows: int) -> tuple[bool, str]:
        """Whether a call fits this workspace, with the reason when it does not."""
        if num_tokens > self.max_tokens:
            return False, f"{num_tokens} tokens > max_tokens {self.max_tokens}"
        if topk != self.topk:
            return False, f"topk {topk} != workspace topk {self.topk}"
        if group_size != self.group_size:
            return False, f"group_size {group_size} != workspace group_size {self.group_size}"
        return True, ""

    def nbytes(self) -> int:
        """Device bytes held (the Triton builder's hash tables once it has run)."""
        return sum(t.numel() * t.element_size() for t in (
            self.group_start, self.group_len, self.union_len, self.route, self.union_rows, self.union_bits,
            *(self._tables or ()), *((self._staging, ) if getattr(self, "_staging", None) is not None else ()),
            self.probe_group_start, self.probe_len_before,
            self.probe_group_len, self.probe_union_len, self.probe_route, self.probe_skip))


# The default call's workspaces (``sparse_mla_fwd`` without ``workspace=``): one per (device, topk, G), grown to the
# largest step seen, rounded up to CACHE_TOKEN_STEP rows so that a sweep of step sizes reallocates rarely.
CACHE_TOKEN_STEP = 4096
_CACHE: dict[tuple, SparseMLAWorkspace] = {}


def cached_workspace(num_tokens: int, topk: int, group_size: int, num_kv_rows: int,
                     device: torch.device) -> SparseMLAWorkspace:
    """A workspace for a grouped call that brought none: the cached one of (device, topk, G) when it holds
    ``num_tokens`` rows, else a new one (cached, replacing the smaller). During CUDA-graph capture a new one is
    not cached (its memory belongs to the graph's pool); capture after a call of the largest step, or pass a
    workspace. Calls on several streams at once must pass their own workspaces."""
    key = (str(device), topk, group_size)
    ws = _CACHE.get(key)
    if ws is not None and ws.max_tokens >= num_tokens:
        return ws
    rows = -(-num_tokens // CACHE_TOKEN_STEP) * CACHE_TOKEN_STEP
    ws = SparseMLAWorkspace(rows, topk, group_size, num_kv_rows, torch.device(device))
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:
        _CACHE[key] = ws
        call_cache.invalidate()  # replay plans hold the replaced workspace's buffers
    return ws


def clear_workspace_cache() -> None:
    """Release the default call's cached workspaces (their memory returns to torch's caching allocator)."""
    _CACHE.clear()
    call_cache.invalidate()
