"""Masked MHA over decompressed K/V: causal attention in which each query may only see its own top-k.

Two kernels:

* ``_key_bitmask_kernel`` (a scatter): for every new token t and every counted entry of its top-k
  list that lies in its causal window, set bit ``pos % 32`` of word ``pos // 32`` of t's mask row,
  pos = the entry's request-local position (``atomic_or``; the words start zeroed). Request b's
  rows are ``ceil((cached_b + new_b) / 32)`` int32 words long, stored one token after another
  (flat buffer, ``MaskedMHAPlan.tok_wbase[t]`` = the first word of token t).
* ``_masked_mha_fwd_kernel`` (flash-attention style): one program per (block of BLOCK_M consecutive
  queries of one request, head). It walks the key tiles [0, pos0 + q_len) of the request in
  BLOCK_N steps, loads the block's [BLOCK_M, BLOCK_N / 32] mask words, skips the tile when they are
  all zero (no query of the block has an allowed key there), and otherwise computes
  q . k over (qk_nope, qk_rope), masks it elementwise with the bits and runs the online softmax
  against V. The mask encodes causality too (only window positions are ever set).

K/V come from kv_b_proj (``sparse_mla.layer.paths``): k_nope and v are per head, [L, H, d] with any
row / head strides (views of one decompressed buffer), k_pe is shared by all heads and read from the
cache rows directly. Semantics: ``sparse_mla.layer.reference.masked_attention_ref`` and, through
the layer, ``dsa_prefill_ref``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..checks import (
    KERNEL_DTYPES,
    check_tensor,
    require_disjoint,
    require_finite_float,
    require_int,
    require_kernel_tensor,
)
from ..online_softmax import online_softmax_step
from .host import to_device_async

LOG2E = 1.4426950408889634
META_COLS = 8  # q_start, q_len, pos0, kv_start, kpe_row0, word_base, n_words, request


@triton.jit
def _key_bitmask_kernel(
    IDX, TOPK_LEN, TOK_LO, TOK_WIN, TOK_WBASE, WORDS, stride_it, stride_ik, stride_tl, K,
    HAS_TOPK_LEN: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_end = K
    if HAS_TOPK_LEN:
        n_end = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t.to(tl.int64) * stride_tl), 0), K)
    in_list = offs < n_end
    idx = tl.load(IDX + t.to(tl.int64) * stride_it + offs.to(tl.int64) * stride_ik, mask=in_list, other=-1)
    lo = tl.load(TOK_LO + t)
    win = tl.load(TOK_WIN + t)
    pos = idx.to(tl.int64) - lo
    ok = in_list & (idx >= 0) & (pos >= 0) & (pos < win)
    pos = tl.where(ok, pos, 0)
    bit = (1 << (pos % 32).to(tl.int32)).to(tl.int32)
    tl.atomic_or(WORDS + tl.load(TOK_WBASE + t) + pos // 32, bit, mask=ok)


@triton.jit
def _masked_mha_fwd_kernel(
    Q, QPE, KN, KPE, V, WORDS, META, OUT, TILES,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_kl, stride_kh, stride_kpe, stride_vl, stride_vh,
    stride_ot, stride_oh, H, scale_log2,
    D_NOPE: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, D_PE: tl.constexpr, D_PE_P: tl.constexpr,
    D_V: tl.constexpr, D_V_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    COUNT_TILES: tl.constexpr,
):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    meta = META + blk * 8
    q_start = tl.load(meta + 0)
    q_len = tl.load(meta + 1)
    pos0 = tl.load(meta + 2)
    kv0 = tl.load(meta + 3)
    kpe0 = tl.load(meta + 4)
    wbase = tl.load(meta + 5)
    n_words = tl.load(meta + 6)
    NW: tl.constexpr = BLOCK_N // 32

    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    tok = q_start + offs_m
    q_row = Q + tok * stride_qt + h * stride_qh
    offs_a = tl.arange(0, D_A)
    a_ok = offs_a < D_NOPE
    q_a = tl.load(q_row[:, None] + offs_a[None, :], mask=m_ok[:, None] & a_ok[None, :], other=0.0)
    if D_B > 0:
        offs_b = D_A + tl.arange(0, D_B)
        q_b = tl.load(q_row[:, None] + offs_b[None, :], mask=m_ok[:, None] & (offs_b < D_NOPE)[None, :], other=0.0)
    if D_PE > 0:
        offs_pe = tl.arange(0, D_PE_P)
        q_pe = tl.load(QPE + tok[:, None] * stride_pt + h * stride_ph + offs_pe[None, :],
                       mask=m_ok[:, None] & (offs_pe < D_PE)[None, :], other=0.0)
    offs_v = tl.arange(0, D_V_P)
    v_ok = offs_v < D_V
    w_row = WORDS + wbase + offs_m.to(tl.int64) * n_words
    shifts = tl.arange(0, 32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V_P], tl.float32)
    n_tiles = (q_len * 0).to(tl.int32)  # a tensor from the start: loop-carried in the counting variant
    hi = (pos0 + q_len).to(tl.int32)  # keys 0 .. hi - 1 (the last query's window)
    for start_n in range(0, hi, BLOCK_N):
        w_idx = start_n // 32 + tl.arange(0, NW)
        words = tl.load(w_row[:, None] + w_idx[None, :], mask=m_ok[:, None] & (w_idx < n_words)[None, :], other=0)
        occupied = tl.sum(tl.sum(tl.where(words != 0, 1, 0), 1), 0)
        if occupied > 0:
            bits = (words[:, :, None] >> shifts[None, None, :]) & 1
            allowed = tl.reshape(bits, [BLOCK_M, BLOCK_N]) != 0
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            kv_row = kv0 + offs_n
            k_col = KN + kv_row[None, :] * stride_kl + h * stride_kh
            k_a = tl.load(k_col + offs_a[:, None], mask=n_ok[None, :] & a_ok[:, None], other=0.0)
            qk = tl.dot(q_a, k_a)
            if D_B > 0:
                k_b = tl.load(k_col + offs_b[:, None], mask=n_ok[None, :] & (offs_b < D_NOPE)[:, None], other=0.0)
                qk = tl.dot(q_b, k_b, qk)
            if D_PE > 0:
                k_pe = tl.load(KPE + (kpe0 + offs_n)[None, :] * stride_kpe + offs_pe[:, None],
                               mask=n_ok[None, :] & (offs_pe < D_PE)[:, None], other=0.0)
                qk = tl.dot(q_pe, k_pe, qk)
            qk = tl.where(allowed, qk * scale_log2, float("-inf"))
            p, alpha, m_new, l_i = online_softmax_step(qk, m_i, l_i)
            v = tl.load(V + kv_row[:, None] * stride_vl + h * stride_vh + offs_v[None, :],
                        mask=n_ok[:, None] & v_ok[None, :], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
            if COUNT_TILES:
                n_tiles += 1

    has_any = l_i > 0.0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    o_ptr = OUT + tok[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & v_ok[None, :])
    if COUNT_TILES:
        tl.store(TILES + blk * H + h, n_tiles)


@dataclass(frozen=True)
class MaskedMHAPlan:
    """Query blocks and mask layout of one masked-MHA call (``plan_masked_mha``).

    block_meta: [n_blocks, 8] int64 (device): per block of <= block_m consecutive new tokens of one
        request: first token, count, request-local position of the first token, row of position 0
        in the decompressed K/V buffers, global cache row of position 0 (for k_pe), first mask word
        of the first token, words per mask row, request.
    tok_lo, tok_win, tok_wbase: [T] int64 (device): per token, the global row of its request's
        position 0, its window length (cached + i + 1) and its first mask word.
    n_words: per request, ceil((cached + new) / 32) words per mask row. total_words: buffer length.
    block_n_total: per block, the key positions it walks (pos0 + q_len), on the host.
    """

    block_m: int
    block_meta: torch.Tensor
    tok_lo: torch.Tensor
    tok_win: torch.Tensor
    tok_wbase: torch.Tensor
    n_words: tuple[int, ...]
    total_words: int
    block_keys: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_keys)

    @property
    def num_tokens(self) -> int:
        return self.tok_lo.shape[0]


def plan_masked_mha(
    cached_lens: Sequence[int], new_lens: Sequence[int], row_offsets: Sequence[int], kv_starts: Sequence[int],
    block_m: int, device: torch.device | str,
) -> MaskedMHAPlan:
    """Split the new tokens of every request into blocks of ``block_m`` and lay out the mask rows.

    Args:
        cached_lens, new_lens, row_offsets: [B] host ints (``sparse_mla.layer.problem``).
        kv_starts: [B] row of each request's position 0 in the decompressed k_nope / v buffers.
        block_m: queries per block (a power of two >= 16).
        device: where the plan's tensors live.

    Raises:
        ValueError: block_m not a power of two >= 16, or list lengths that differ.
    """
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    B = len(new_lens)
    if not (len(cached_lens) == len(row_offsets) == len(kv_starts) == B):
        raise ValueError("cached_lens, new_lens, row_offsets and kv_starts must have the same length B")
    rows, keys, n_words = [], [], []
    tok_lo, tok_win, tok_wbase = [], [], []
    t0, wbase = 0, 0
    for b in range(B):
        c, n = int(cached_lens[b]), int(new_lens[b])
        nw = -(-(c + n) // 32)
        n_words.append(nw)
        if n > 0:
            i = torch.arange(n, dtype=torch.int64)
            tok_lo.append(torch.full((n,), int(row_offsets[b]), dtype=torch.int64))
            tok_win.append(c + i + 1)
            tok_wbase.append(wbase + i * nw)
        for i0 in range(0, n, block_m):
            q_len = min(block_m, n - i0)
            rows.append((t0 + i0, q_len, c + i0, int(kv_starts[b]), int(row_offsets[b]), wbase + i0 * nw, nw, b))
            keys.append(c + i0 + q_len)
        t0 += n
        wbase += n * nw
    meta = torch.tensor(rows, dtype=torch.int64).reshape(-1, META_COLS)
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    dev = torch.device(device)
    return MaskedMHAPlan(block_m, to_device_async(meta, dev), to_device_async(cat(tok_lo), dev),
                         to_device_async(cat(tok_win), dev), to_device_async(cat(tok_wbase), dev),
                         tuple(n_words), wbase, tuple(keys))


def build_key_bitmask(indices: torch.Tensor, topk_length: torch.Tensor | None, plan: MaskedMHAPlan,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed per-query key masks from the top-k lists (Triton scatter with atomic OR).

    Args:
        indices: [T, K] int32 global rows, any strides; entries < 0, past topk_length or outside
            the token's causal window are ignored.
        topk_length: optional [T] int32, any stride.
        plan: from ``plan_masked_mha`` (T tokens), on indices' device.
        out: optional contiguous [>= plan.total_words] int32 buffer (overwritten).

    Returns:
        [plan.total_words] int32: token t's row starts at ``plan.tok_wbase[t]``; bit j % 32 of its
        word j // 32 is set iff request-local position j is in t's list.

    Raises:
        TypeError, ValueError: a wrong type, dtype, shape, device or layout of an argument (named),
            before the launch.
    """
    if not isinstance(plan, MaskedMHAPlan):
        raise TypeError(f"plan must be a MaskedMHAPlan (plan_masked_mha), got {type(plan).__name__}")
    T = plan.num_tokens
    indices = check_tensor("indices", indices, dims="[T, K]", dtype=torch.int32)
    if indices.dim() != 2 or indices.shape[0] != T or indices.shape[1] < 1:
        raise ValueError(f"indices must be [T, K] with T = {T} (the plan's tokens) and K >= 1, got shape {list(indices.shape)}")
    dev = indices.device
    if plan.tok_lo.device != dev:
        raise ValueError(f"plan is on {plan.tok_lo.device} but indices is on {dev}; build the plan on indices' device")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dims="[T]", shape=(T,), dtype=torch.int32, device=dev)
    if out is not None:
        check_tensor("out", out, dims="[>= plan.total_words]", dtype=torch.int32, device=dev, layout="contiguous")
        if out.dim() != 1 or out.numel() < plan.total_words:
            raise ValueError(f"out must be 1-D with at least plan.total_words = {plan.total_words} int32 words, "
                             f"got shape {list(out.shape)}")
    require_kernel_tensor("indices", indices)
    K = indices.shape[1]
    if out is None:
        out = torch.zeros(max(plan.total_words, 1), dtype=torch.int32, device=dev)
    else:
        out[: plan.total_words].zero_()
    if T == 0:
        return out
    block_k = min(1024, triton.next_power_of_2(K))
    _key_bitmask_kernel[(T, triton.cdiv(K, block_k))](
        indices, topk_length if topk_length is not None else indices, plan.tok_lo, plan.tok_win, plan.tok_wbase, out,
        indices.stride(0), indices.stride(1), topk_length.stride(0) if topk_length is not None else 0, K,
        HAS_TOPK_LEN=topk_length is not None, BLOCK_K=block_k,
    )
    return out


def unpack_key_bitmask(words: torch.Tensor, plan: MaskedMHAPlan) -> torch.Tensor:
    """[T, max_window] bool: the packed masks unpacked (position j of token t's request allowed)."""
    T = plan.num_tokens
    width = 32 * max(plan.n_words, default=0)
    out = torch.zeros(T, width, dtype=torch.bool, device=words.device)
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    meta = plan.block_meta.cpu().tolist()
    for q_start, q_len, _pos0, _kv0, _kpe0, wbase, nw, _b in meta:
        w = words[wbase: wbase + q_len * nw].view(q_len, nw)
        bits = ((w[:, :, None] >> shifts) & 1).bool().reshape(q_len, nw * 32)
        out[q_start: q_start + q_len, : nw * 32] = bits
    return out


def tile_occupancy(words: torch.Tensor, plan: MaskedMHAPlan, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block: (tiles the kernel computes, tiles it walks), both [n_blocks] int64 (host).

    A tile is the block's [block_m queries x block_n keys] square of keys [s, s + block_n) for
    s = 0, block_n, ... < pos0 + q_len; it is computed iff some query of the block has an allowed
    key in it. ``masked_mha_fwd(..., tile_counts=...)`` reports the same counts per head.
    """
    if block_n % 32:
        raise ValueError(f"block_n must be a multiple of 32, got {block_n}")
    occ, walked = [], []
    for (_q_start, q_len, _pos0, _kv0, _kpe0, wbase, nw, _b), keys in zip(plan.block_meta.cpu().tolist(), plan.block_keys):
        w = words[wbase: wbase + q_len * nw].view(q_len, nw).cpu()
        n_t = -(-keys // block_n)
        per_word = (w != 0).any(0)  # [nw]
        pad = torch.zeros(n_t * (block_n // 32), dtype=torch.bool)
        take = min(nw, pad.numel())
        pad[:take] = per_word[:take]
        occ.append(int(pad.view(n_t, block_n // 32).any(1).sum()))
        walked.append(n_t)
    return torch.tensor(occ, dtype=torch.int64), torch.tensor(walked, dtype=torch.int64)


def _pow2_split(d: int) -> tuple[int, int]:
    """d = D_A + (rest padded to a power of two D_B, 0 if none): 128 -> (128, 0), 192 -> (128, 64)."""
    a = 1 << (d.bit_length() - 1)
    rest = d - a
    return max(a, 16), (max(16, triton.next_power_of_2(rest)) if rest else 0)


def default_config(d_qk: int, d_v: int, device_type: str = "cuda") -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for these head dims (estimate; sweep_paths.py measures).
    On the CPU (Triton interpreter) small tiles: its dots are numpy fp16 products, slow at 64 rows."""
    if device_type != "cuda":
        return 16, 32, 4, 1
    wide = max(triton.next_power_of_2(d_qk), triton.next_power_of_2(d_v)) >= 256
    return 64, 64, (8 if wide else 4), 2


def _check_masked_mha_args(q_nope, q_pe, k_nope, k_pe, v, words, plan, out, tile_counts) -> None:
    """Shapes, dtypes, devices and layouts of ``masked_mha_fwd``'s tensors (see its docstring)."""
    check_tensor("q_nope", q_nope, dims="[T, H, qk_nope]", dtype=KERNEL_DTYPES, layout="last_dim")
    if q_nope.dim() != 3:
        raise ValueError(f"q_nope must be [T, H, qk_nope], got shape {list(q_nope.shape)}")
    T, H, d_nope = q_nope.shape
    dt, dev = q_nope.dtype, q_nope.device
    if not isinstance(plan, MaskedMHAPlan):
        raise TypeError(f"plan must be a MaskedMHAPlan (plan_masked_mha), got {type(plan).__name__}")
    if plan.num_tokens != T or plan.block_meta.device != dev:
        raise ValueError(f"plan must be for the T = {T} tokens of q_nope on {dev}, got a plan for {plan.num_tokens} "
                         f"tokens on {plan.block_meta.device}")
    if (q_pe is None) != (k_pe is None):
        raise ValueError(f"q_pe and k_pe must both be given (a rope part) or both be None (NoPE), got q_pe "
                         f"{'None' if q_pe is None else 'a tensor'} and k_pe {'None' if k_pe is None else 'a tensor'}")
    if q_pe is not None:
        check_tensor("q_pe", q_pe, dims="[T, H, qk_rope]", dtype=dt, device=dev, layout="last_dim")
        if q_pe.dim() != 3 or q_pe.shape[:2] != (T, H) or q_pe.shape[2] < 1:
            raise ValueError(f"q_pe must be [T, H, qk_rope] = [{T}, {H}, >= 1], got shape {list(q_pe.shape)}")
        check_tensor("k_pe", k_pe, dims=f"[N, qk_rope = {q_pe.shape[2]}]", dtype=dt, device=dev, layout="last_dim")
        if k_pe.dim() != 2 or k_pe.shape[1] != q_pe.shape[2]:
            raise ValueError(f"k_pe must be [N, qk_rope] = [N, {q_pe.shape[2]}], got shape {list(k_pe.shape)}")
    check_tensor("k_nope", k_nope, dims="[L, H, qk_nope]", dtype=dt, device=dev, layout="last_dim")
    if k_nope.dim() != 3 or k_nope.shape[1:] != (H, d_nope):
        raise ValueError(f"k_nope must be [L, H, qk_nope] = [L, {H}, {d_nope}], got shape {list(k_nope.shape)}")
    check_tensor("v", v, dims="[L, H, v_head_dim]", dtype=dt, device=dev, layout="last_dim")
    if v.dim() != 3 or v.shape[:2] != (k_nope.shape[0], H):
        raise ValueError(f"v must be [L, H, v_head_dim] = [{k_nope.shape[0]}, {H}, *] (k_nope's rows), got shape "
                         f"{list(v.shape)}")
    check_tensor("words", words, dims="[>= plan.total_words]", dtype=torch.int32, device=dev, layout="contiguous")
    if words.dim() != 1 or words.numel() < plan.total_words:
        raise ValueError(f"words must be 1-D with at least plan.total_words = {plan.total_words} int32 words "
                         f"(build_key_bitmask), got shape {list(words.shape)}")
    check_tensor("out", out, dims="[T, H, v_head_dim]", shape=(T, H, v.shape[2]), dtype=dt, device=dev,
                 layout="last_dim", writable=True)
    if tile_counts is not None:
        check_tensor("tile_counts", tile_counts, dims="[n_blocks, H]", shape=(plan.num_blocks, H), dtype=torch.int32,
                     device=dev, layout="contiguous", writable=True)
    require_disjoint({"out": out, "tile_counts": tile_counts},
                     {"q_nope": q_nope, "q_pe": q_pe, "k_nope": k_nope, "k_pe": k_pe, "v": v, "words": words})


def masked_mha_fwd(
    q_nope: torch.Tensor, q_pe: torch.Tensor | None, k_nope: torch.Tensor, k_pe: torch.Tensor | None, v: torch.Tensor,
    words: torch.Tensor, plan: MaskedMHAPlan, sm_scale: float, out: torch.Tensor, *,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    tile_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the masked MHA kernel; every argument is checked here, before the launch.

    Args:
        q_nope: [T, H, qk_nope] fp16/bf16, any token / head strides, last dim contiguous.
        q_pe: [T, H, qk_rope] or None (NoPE); q_nope's dtype and device, last dim contiguous.
        k_nope: [L, H, qk_nope], v: [L, H, v_head_dim] decompressed keys / values, any row and head
            strides, last dim contiguous; request b's position j is row ``kv_start_b + j``.
        k_pe: [N, qk_rope] cache rows (shared by all heads), given exactly when q_pe is, any row
            stride, last dim contiguous; position j of request b is row ``row_offsets[b] + j``.
        words: packed masks from ``build_key_bitmask(..., plan)``: contiguous int32, at least
            ``plan.total_words`` long.
        plan: ``plan_masked_mha`` output for these T tokens (its block_m is BLOCK_M).
        sm_scale: softmax scale on q . k (a finite float).
        out: [T, H, v_head_dim] output in q's dtype, any token / head strides, last dim contiguous,
            its own memory (not overlapping an input); written (a query with no allowed key gets 0).
        block_n, num_warps, num_stages: overrides of ``default_config``; block_n a multiple of 32.
        tile_counts: optional [n_blocks, H] int32, receives the number of key tiles each program
            computed (debug mode: compiles a counting variant).

    Returns:
        out.

    Raises:
        ValueError: a shape, device or layout mismatch (named), out overlapping itself or an input,
            block_n not a power-of-two multiple of 32, a non-finite sm_scale, a tensor on neither
            CUDA nor the CPU under TRITON_INTERPRET=1.
        TypeError: a non-tensor or a wrong dtype, a bf16 q / k / v under the interpreter (its bf16
            tl.dot is wrong; ``sparse_mla.checks.require_kernel_tensor``), a non-int block_n / num_warps /
            num_stages.
    """
    for name, x, dims in (("q_nope", q_nope, "[T, H, qk_nope]"), ("q_pe", q_pe, "[T, H, qk_rope]"),
                          ("k_nope", k_nope, "[L, H, qk_nope]"), ("k_pe", k_pe, "[N, qk_rope]"), ("v", v, "[L, H, v_head_dim]")):
        if x is not None:
            require_kernel_tensor(name, check_tensor(name, x, dims=dims))
    _check_masked_mha_args(q_nope, q_pe, k_nope, k_pe, v, words, plan, out, tile_counts)
    sm_scale = require_finite_float("sm_scale", sm_scale)
    for name, x in (("block_n", block_n), ("num_warps", num_warps), ("num_stages", num_stages)):
        if x is not None:
            require_int(name, x, minimum=1)
    T, H, d_nope = q_nope.shape
    if T == 0 or plan.num_blocks == 0:
        return out
    d_pe = 0 if q_pe is None else q_pe.shape[2]
    d_v = v.shape[2]
    _, bn, warps, stages = default_config(d_nope + d_pe, d_v, q_nope.device.type)
    bn = block_n or bn
    if bn % 32 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two multiple of 32, got {bn}")
    d_a, d_b = _pow2_split(d_nope)
    qpe = q_pe if q_pe is not None else q_nope
    kpe = k_pe if k_pe is not None else q_nope
    _masked_mha_fwd_kernel[(plan.num_blocks, H)](
        q_nope, qpe, k_nope, kpe, v, words, plan.block_meta, out, tile_counts if tile_counts is not None else words,
        q_nope.stride(0), q_nope.stride(1), qpe.stride(0), qpe.stride(1), k_nope.stride(0), k_nope.stride(1),
        kpe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1), H, sm_scale * LOG2E,
        D_NOPE=d_nope, D_A=d_a, D_B=d_b, D_PE=d_pe, D_PE_P=max(16, triton.next_power_of_2(d_pe)) if d_pe else 0,
        D_V=d_v, D_V_P=max(16, triton.next_power_of_2(d_v)), BLOCK_M=plan.block_m, BLOCK_N=bn,
        COUNT_TILES=tile_counts is not None, num_warps=num_warps or warps, num_stages=num_stages or stages,
    )
    return out


__all__ = ["MaskedMHAPlan", "plan_masked_mha", "build_key_bitmask", "unpack_key_bitmask", "tile_occupancy",
           "masked_mha_fwd", "default_config"]
