"""The top-k union builder (Triton): the portable twin of ``cuda_smem``.

``build_union`` makes, per group, the distinct valid rows of its G lists (in no particular order:
the attention kernel does not need them sorted) and a membership word per row (bit i set iff the
row is in query i's list). Its cost is O(G K) per group, independent of the sequence length: each
program of a persistent grid owns an open-addressing hash table of 2 * G_P * K_P slots (load
factor <= 1/2 even with no overlap at all), cleaned by the program after each group. Measured on
the H200 (docs/notes/grouping.md): 3.5 ms for 16K tokens, G = 8, topk 2048, as long as half the grouped
attention itself; tried and slower there: a tl.sort of the G * K keys per group (7.1 ms), and a
chunked variant with plain-store membership bytes (7.0 ms, and racy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import env
from ..launch_cache import LaunchCache


@triton.jit
def _cas_where(ptr, cmp, val, act, PRED_CAS: tl.constexpr):
    """atomic CAS issued by the lanes with ``act`` only (old value -1 elsewhere) when PRED_CAS;
    else every lane CASes (a lane with nothing to insert passes cmp == val == -1, a no-op that
    still costs an atomic). tl.atomic_cas has no mask; the predicated form is inline PTX, which the
    interpreter cannot run.

    PRED_CAS needs a tensor with no replicated elements (at least 32 * num_warps elements, see
    ``use_predicated_cas``): where the layout gives several threads a copy of one element,
    tl.atomic_cas issues the atomic from one copy and broadcasts its result, but inline asm runs in
    every copy, so the second copy sees the first copy's row instead of -1 and the copies disagree
    on whether the row was inserted (rows lost or appended twice)."""
    if PRED_CAS:
        return tl.inline_asm_elementwise(
            """{
            .reg .pred %p;
            setp.ne.s32 %p, $4, 0;
            mov.b32 $0, -1;
            @%p atom.relaxed.gpu.global.cas.b32 $0, [$1], $2, $3;
            }""",
            "=r,l,r,r,r", [ptr, cmp, val, act.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.atomic_cas(ptr, cmp, tl.where(act, val, -1))


@triton.jit(do_not_specialize=["num_groups"])
def _build_union_kernel(
    IDX, TOPK_LEN, GROUP_START, GROUP_LEN, ROUTE, TABLE, TABLE_BITS, ROWS, BITS, ULEN,
    stride_it, stride_rg, N, K, num_groups, guard_ratio,
    G_P: tl.constexpr, K_P: tl.constexpr, LOG_S: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, GUARD: tl.constexpr, PRED_CAS: tl.constexpr,
):
    """Persistent: program p owns hash table p (2**LOG_S slots, all -1 / 0 between calls) and
    builds the unions of groups p, p + nprog, ... Open addressing with linear probing: every
    entry CASes its row into its slot (a lane with nothing to insert CASes -1 -> -1, a no-op),
    ORs its query bit into the slot's word, and an entry that found its row or an empty slot is
    done. The first inserter of a row appends it to the union (prefix sum over the round); a
    second pass reads the words back and resets the touched slots, so tables stay clean."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    S: tl.constexpr = 1 << LOG_S
    TOTAL: tl.constexpr = G_P * K_P
    table = TABLE + pid.to(tl.int64) * S
    table_bits = TABLE_BITS + pid.to(tl.int64) * S
    offs_i = tl.arange(0, G_P)
    offs_k = tl.arange(0, K_P)
    offs_c = tl.arange(0, BLOCK_C)
    for g in range(pid, num_groups, nprog):
        glen = tl.load(GROUP_LEN + g)
        u = glen * 0
        if glen > 0:
            t0 = tl.load(GROUP_START + g)
            q_ok = offs_i < glen
            tok = (t0 + offs_i).to(tl.int64)
            count = tl.full([G_P], K, tl.int32)
            if HAS_TOPK_LEN:
                count = tl.minimum(tl.load(TOPK_LEN + tok, mask=q_ok, other=0), K)
            in_list = q_ok[:, None] & (offs_k[None, :] < count[:, None])
            idx = tl.load(IDX + tok[:, None] * stride_it + offs_k[None, :], mask=in_list, other=-1)
            valid = in_list & (idx >= 0) & (idx < N)
            row = tl.reshape(tl.where(valid, idx, -1), [TOTAL])
            qbit = tl.reshape(tl.broadcast_to((1 << offs_i)[:, None], [G_P, K_P]), [TOTAL])
            act = tl.reshape(valid, [TOTAL])
            h = ((row.to(tl.uint32) * 0x9E3779B1) >> (32 - LOG_S)).to(tl.int32)
            g64 = pid.to(tl.int64) * 0 + g
            out_rows = ROWS + g64 * stride_rg
            out_bits = BITS + g64 * stride_rg
            n_act = tl.sum(act.to(tl.int32), 0)
            n_valid = n_act
            while n_act > 0:
                old = _cas_where(table + h, tl.full([TOTAL], -1, tl.int32), row, act, PRED_CAS)
                placed = act & ((old == -1) | (old == row))
                inserted = act & (old == -1)
                tl.atomic_or(table_bits + h, qbit, mask=placed)
                ins = inserted.to(tl.int32)
                pos = u + tl.cumsum(ins, 0) - 1
                tl.store(out_rows + pos, row, mask=inserted)
                tl.store(out_bits + pos, h, mask=inserted)  # the slot, replaced by the word below
                u += tl.sum(ins, 0)
                act = act & (placed == 0)
                h = tl.where(act, (h + 1) & (S - 1), h)
                n_act = tl.sum(act.to(tl.int32), 0)
            tl.debug_barrier()
            for c0 in range(0, u, BLOCK_C):
                c = c0 + offs_c
                cm = c < u
                slot = tl.load(out_bits + c, mask=cm, other=0)
                word = tl.atomic_xchg(table_bits + slot, tl.zeros([BLOCK_C], tl.int32), mask=cm)
                tl.atomic_xchg(table + slot, tl.full([BLOCK_C], -1, tl.int32), mask=cm)
                tl.store(out_bits + c, word, mask=cm)
            if GUARD:
                # union rows per mean valid list: too many and grouping is slower than per token
                if u.to(tl.float32) * glen.to(tl.float32) > guard_ratio * n_valid.to(tl.float32):
                    tl.store(GROUP_LEN + g, 0)
                    tl.store(ROUTE + tok, tl.full([G_P], 1, tl.int8), mask=q_ok)
        tl.store(ULEN + g, u)
        # the resets above (atomic_xchg of this group's slots) must be done, by every thread,
        # before any thread CASes the next group's rows into the same table
        tl.debug_barrier()



def hash_table_slots(group_size: int, topk: int) -> int:
    """Slots of one union hash table: 2 * G_P * K_P (load factor <= 1/2 even with no overlap)."""
    return 2 * triton.next_power_of_2(group_size) * triton.next_power_of_2(topk)


def union_num_warps(group_size: int, topk: int) -> int:
    """num_warps of the union builder for G, K: 4 up to G_P * K_P = 2048, 8 up to 8192, else 16."""
    total = triton.next_power_of_2(group_size) * triton.next_power_of_2(topk)
    return 4 if total <= 2048 else (8 if total <= 8192 else 16)


def use_predicated_cas(is_cuda: bool, group_size: int, topk: int, predicated_cas: bool | None = None) -> bool:
    """Whether ``build_union`` issues its probing CAS as predicated inline PTX (``_cas_where``).

    Only where every element of the [G_P * K_P] probe tensor lives in exactly one thread:
    G_P * K_P >= 32 * num_warps (the builder's 1-D layout puts one element per thread, so smaller
    tensors are replicated across threads, and inline asm would run the atomic once per copy), and
    only on CUDA (the interpreter cannot run PTX). ``predicated_cas``: None = wherever allowed,
    False = never.

    Raises:
        ValueError: ``predicated_cas=True`` where it is not allowed (a tensor too small for the
            block, or not CUDA).
    """
    total = triton.next_power_of_2(group_size) * triton.next_power_of_2(topk)
    threads = 32 * union_num_warps(group_size, topk)
    if predicated_cas is not None and not predicated_cas:
        return False
    if total < threads:
        if predicated_cas:
            raise ValueError(
                f"predicated_cas=True needs G_P * K_P >= 32 * num_warps = {threads} probe entries per group, got "
                f"{total} (G = {group_size}, K = {topk}): a smaller tensor is replicated across threads and the "
                "inline-PTX CAS would run once per copy, building wrong unions; leave predicated_cas None or False"
            )
        return False
    if not is_cuda:
        if predicated_cas:
            raise ValueError("predicated_cas=True needs CUDA tensors: the inline-PTX CAS cannot run in the interpreter")
        return False
    return True


def build_union(
    indices: torch.Tensor, topk_length: torch.Tensor | None, num_kv_rows: int, group_size: int,
    group_start: torch.Tensor, group_len: torch.Tensor, route: torch.Tensor,
    tables: torch.Tensor, table_bits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor, union_len: torch.Tensor,
    guard_ratio: float | None = None, predicated_cas: bool | None = None,
) -> None:
    """Launch the union builder over ``group_start.shape[0]`` groups (buffers from a workspace).

    indices [T, K] int32, topk_length [T] int32 or None; tables [P, S] int32 (all -1) and
    table_bits [P, S] int32 (all 0): one hash table per persistent program, left clean.
    Writes rows / bits [num_groups, >= G * K] int32 (first union_len[g] entries, unsorted) and
    union_len. With ``guard_ratio``, a group whose union holds more than ``guard_ratio`` times its
    mean valid list length gets ``group_len = 0`` and its tokens ``route = 1`` (they run per token).

    ``predicated_cas`` issues the probing CAS from the still-active lanes only (inline PTX) instead
    of ``tl.atomic_cas`` on every lane (the interpreter's form). None (default): predicated on CUDA
    when G_P * K_P >= 32 * num_warps (``use_predicated_cas``); below that, threads hold replicated
    copies of the probe entries and the inline PTX would run the CAS once per copy. False: never.
    True: forced; raises ValueError (before any launch) where it is not allowed.
    """
    K = indices.shape[1]
    pred = use_predicated_cas(indices.is_cuda and not env.interpreted(), group_size, K, predicated_cas)
    num_groups = group_start.shape[0]
    if num_groups == 0:
        return
    g_p, k_p = triton.next_power_of_2(group_size), triton.next_power_of_2(K)
    slots = tables.shape[1]
    constexprs = dict(G_P=g_p, K_P=k_p, LOG_S=slots.bit_length() - 1, BLOCK_C=1024,
                      HAS_TOPK_LEN=topk_length is not None, GUARD=guard_ratio is not None, PRED_CAS=pred)
    options = dict(num_warps=union_num_warps(group_size, K))
    s_it, s_rg = indices.stride(0), rows.stride(0)
    # the key: constexprs, options, and the specialization (== 1, % 16) of the specialized integers
    key = (*constexprs.values(), options["num_warps"],
           *((v == 1, v % 16 == 0) for v in (s_it, s_rg, num_kv_rows, K)))
    _BUILD((key, ), (min(tables.shape[0], num_groups), ), (
        indices, topk_length if topk_length is not None else indices, group_start, group_len, route,
        tables, table_bits, rows, bits, union_len, s_it, s_rg, num_kv_rows, K, num_groups, float(guard_ratio or 0.0)),
        constexprs, options)


_BUILD = LaunchCache(namespace=globals(), name="_build_union_kernel", align=tuple(range(10)), wide=(12, ))
