"""Group planning and the top-k union builder (Triton).

``plan_groups`` splits the T query rows into groups of G consecutive rows, either within requests
(``cu_seqlens_q`` given: a request's last ``n % G`` rows are routed per token) or token-major over
all rows (the short tail group is kept as a short group). It writes ``group_start``, ``group_len``
and a per-token ``route`` (1 = the per-token kernel computes this token).

``build_union`` makes, per group, the distinct valid rows of its G lists (in no particular order:
the attention kernel does not need them sorted) and a membership word per row (bit i set iff the
row is in query i's list). Its cost is O(G K) per group, independent of the sequence length: each
program of a persistent grid owns an open-addressing hash table of 2 * G_P * K_P slots (load
factor <= 1/2 even with no overlap at all), cleaned by the program after each group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_GROUP_SIZE = 16
# Linear-probing rounds per entry chunk; a group that needs more (not expected at load factor
# <= 1/2) is reported with union_len = -1 and routed per token.
MAX_PROBES = 64


@triton.jit
def _plan_groups_kernel(
    CU, GROUP_START, GROUP_LEN, ROUTE, B, T, max_groups,
    G: tl.constexpr, SHORT_TAIL: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    if SHORT_TAIL:
        # token-major: one span [0, T), the tail forms a short group
        seq_begin = 0
        seq_end = T
        first_group = 0
        n_groups = tl.cdiv(T, G)
        grouped_end = T
        total_groups = n_groups
    else:
        cu_lo = tl.load(CU + offs_b, mask=offs_b < B, other=0)
        cu_hi = tl.load(CU + 1 + offs_b, mask=offs_b < B, other=0)
        cu_lo = tl.minimum(tl.maximum(cu_lo, 0), T)
        cu_hi = tl.minimum(tl.maximum(cu_hi, cu_lo), T)
        full = (cu_hi - cu_lo) // G
        first_group = tl.sum(tl.where(offs_b < b, full, 0), 0)
        total_groups = tl.sum(full, 0)
        seq_begin = tl.sum(tl.where(offs_b == b, cu_lo, 0), 0)
        seq_end = tl.sum(tl.where(offs_b == b, cu_hi, 0), 0)
        n_groups = (seq_end - seq_begin) // G
        grouped_end = seq_begin + n_groups * G
    for j0 in range(0, n_groups, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = (j < n_groups) & (first_group + j < max_groups)
        start = seq_begin + j * G
        tl.store(GROUP_START + first_group + j, start, mask=ok)
        tl.store(GROUP_LEN + first_group + j, tl.minimum(seq_end - start, G), mask=ok)
    for t0 in range(seq_begin, seq_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tl.store(ROUTE + t, (t >= grouped_end).to(tl.int8), mask=t < seq_end)
    if b == B - 1:  # the last program clears the unused group slots
        for j0 in range(total_groups, max_groups, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ok = j < max_groups
            tl.store(GROUP_START + j, tl.zeros([BLOCK], tl.int32), mask=ok)
            tl.store(GROUP_LEN + j, tl.zeros([BLOCK], tl.int32), mask=ok)



@triton.jit
def _build_union_kernel(
    IDX, TOPK_LEN, GROUP_START, GROUP_LEN, ROUTE, TABLE, TABLE_Q, ROWS, BITS, ULEN,
    stride_it, stride_rg, N, K, num_groups, guard_ratio,
    G_P: tl.constexpr, QB: tl.constexpr, LOG_S: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, GUARD: tl.constexpr, MAX_PROBES: tl.constexpr,
):
    """Program p owns table p: TABLE [S] int32 rows (-1 = empty) and TABLE_Q [S, QB] int8
    membership bytes (0), and builds groups p, p + nprog, ...

    Entries are taken BLOCK_E at a time (one query's list in chunks, so no tensor is larger than
    BLOCK_E). Each valid entry CASes its row into slot hash(row); an entry that finds its row or an
    empty slot is placed: it sets byte [slot, i] (a plain store: rows of one list are distinct, so
    no two entries write the same byte), and the entry that filled the slot appends the row to the
    union (prefix sum); the others probe the next slot (linear probing) until placed. Then the bytes
    of each union row are packed into its membership word and the touched slots are reset.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    S: tl.constexpr = 1 << LOG_S
    table = TABLE + pid.to(tl.int64) * S
    table_q = TABLE_Q + pid.to(tl.int64) * (S * QB)
    offs_e = tl.arange(0, BLOCK_E)
    for g in range(pid, num_groups, nprog):
        glen = tl.load(GROUP_LEN + g)
        u = glen * 0
        if glen > 0:
            t0 = tl.load(GROUP_START + g)
            g64 = pid.to(tl.int64) * 0 + g
            out_rows = ROWS + g64 * stride_rg
            out_bits = BITS + g64 * stride_rg  # holds each union row's slot until the last pass
            n_valid = glen * 0
            overflow = glen * 0
            n_chunks = tl.cdiv(K, BLOCK_E)
            for ci in range(0, glen * n_chunks):
                i = ci // n_chunks
                tok = (t0 + i).to(tl.int64)
                count = K
                if HAS_TOPK_LEN:
                    count = tl.minimum(tl.maximum(tl.load(TOPK_LEN + tok), 0), K)
                k = (ci % n_chunks) * BLOCK_E + offs_e
                row = tl.load(IDX + tok * stride_it + k, mask=k < count, other=-1)
                act = (row >= 0) & (row < N)
                row = tl.where(act, row, -1)
                n_a = tl.sum(act.to(tl.int32), 0)
                n_valid += n_a
                h = ((row.to(tl.uint32) * 0x9E3779B1) >> (32 - LOG_S)).to(tl.int32)
                for _probe in range(0, MAX_PROBES):  # (a while loop here breaks triton 3.6's compiler)
                    if n_a > 0:
                        # a lane with nothing to insert CASes -1 -> -1: no change
                        old = tl.atomic_cas(table + h, tl.full([BLOCK_E], -1, tl.int32), tl.where(act, row, -1))
                        placed = act & ((old == -1) | (old == row))
                        inserted = act & (old == -1)
                        tl.store(table_q + h * QB + i, tl.full([BLOCK_E], 1, tl.int8), mask=placed)
                        ins = inserted.to(tl.int32)
                        pos = u + tl.cumsum(ins, 0) - 1
                        tl.store(out_rows + pos, row, mask=inserted)
                        tl.store(out_bits + pos, h, mask=inserted)
                        u += tl.sum(ins, 0)
                        act = act & (placed == 0)
                        h = tl.where(act, (h + 1) & (S - 1), h)
                        n_a = tl.sum(act.to(tl.int32), 0)
                overflow += n_a
            tl.debug_barrier()
            for c0 in range(0, u, BLOCK_E):
                c = c0 + offs_e
                cm = c < u
                slot = tl.load(out_bits + c, mask=cm, other=0)
                word = tl.zeros([BLOCK_E], tl.int32)
                for b in tl.static_range(QB):
                    qb = tl.load(table_q + slot * QB + b, mask=cm, other=0)
                    word = word | (qb.to(tl.int32) << b)
                    tl.store(table_q + slot * QB + b, tl.zeros([BLOCK_E], tl.int8), mask=cm)
                tl.atomic_xchg(table + slot, tl.full([BLOCK_E], -1, tl.int32), mask=cm)
                tl.store(out_bits + c, word, mask=cm)
            tl.debug_barrier()
            # too many union rows (the overlap guard), or a probe chain longer than MAX_PROBES
            # (not expected at load factor <= 1/2): the group's queries run per token instead
            to_per_token = overflow > 0
            if GUARD:
                to_per_token = to_per_token | (u.to(tl.float32) * glen.to(tl.float32) > guard_ratio * n_valid.to(tl.float32))
            if to_per_token:
                tl.store(GROUP_LEN + g, 0)
                offs_i = tl.arange(0, G_P)
                tl.store(ROUTE + t0 + offs_i, tl.full([G_P], 1, tl.int8), mask=offs_i < glen)
            if overflow > 0:
                u = glen * 0 - 1
        tl.store(ULEN + g, u)


def plan_groups(
    num_tokens: int, group_size: int, cu_seqlens_q: torch.Tensor | None,
    group_start: torch.Tensor, group_len: torch.Tensor, route: torch.Tensor,
) -> None:
    """Fill group_start / group_len ([max_groups] int32) and route ([>= T] int8) on the device."""
    max_groups = group_start.shape[0]
    if cu_seqlens_q is None:
        B, cu, short_tail = 1, group_start, True
    else:
        B, cu, short_tail = cu_seqlens_q.shape[0] - 1, cu_seqlens_q, False
    _plan_groups_kernel[(B,)](
        cu, group_start, group_len, route, B, num_tokens, max_groups,
        G=group_size, SHORT_TAIL=short_tail, BLOCK_B=triton.next_power_of_2(B), BLOCK=1024,
    )


def hash_table_slots(group_size: int, topk: int) -> int:
    """Slots of one union hash table: 2 * G_P * K_P (load factor <= 1/2 even with no overlap)."""
    return 2 * triton.next_power_of_2(group_size) * triton.next_power_of_2(topk)


def membership_bytes(group_size: int) -> int:
    """Bytes per slot of the membership byte table (QB): 8 up to G = 8, else 16."""
    return 8 if group_size <= 8 else 16


def build_union(
    indices: torch.Tensor, topk_length: torch.Tensor | None, num_kv_rows: int, group_size: int,
    group_start: torch.Tensor, group_len: torch.Tensor, route: torch.Tensor,
    tables: torch.Tensor, table_q: torch.Tensor,
    rows: torch.Tensor, bits: torch.Tensor, union_len: torch.Tensor,
    guard_ratio: float | None = None,
) -> None:
    """Launch the union builder over ``group_start.shape[0]`` groups (buffers from a workspace).

    indices [T, K] int32, topk_length [T] int32 or None; tables [P, S] int32 (all -1), table_q
    [P, S * QB] int8 (all 0): per-program hash tables, left clean.
    Writes rows / bits [num_groups, >= G * K] int32 (first union_len[g] entries) and union_len.
    With ``guard_ratio``, a group whose union holds more than ``guard_ratio`` times its mean valid
    list length gets ``group_len = 0`` and its tokens ``route = 1`` (they run per token); so does a
    group whose probing overflowed MAX_PROBES, with ``union_len = -1``.
    """
    num_groups = group_start.shape[0]
    if num_groups == 0:
        return
    K = indices.shape[1]
    _build_union_kernel[(min(tables.shape[0], num_groups),)](
        indices, topk_length if topk_length is not None else indices, group_start, group_len, route,
        tables, table_q, rows, bits, union_len,
        indices.stride(0), rows.stride(0), num_kv_rows, K, num_groups, float(guard_ratio or 0.0),
        G_P=triton.next_power_of_2(group_size), QB=membership_bytes(group_size),
        LOG_S=tables.shape[1].bit_length() - 1, BLOCK_E=min(1024, triton.next_power_of_2(K)),
        HAS_TOPK_LEN=topk_length is not None, GUARD=guard_ratio is not None, MAX_PROBES=MAX_PROBES, num_warps=4,
    )
