"""Synthetic causal top-k lists with a tunable neighbour overlap (a DSA indexer stand-in).

The model (``OverlapModel``), per request with ``cached`` tokens in the cache and ``new`` query
tokens; query t (0-based among the new ones) sits at request-local position p = cached + t and
selects k_t = min(topk, p + 1) distinct positions among 0..p:

1. Local rows, as real DSA indexers pick them: the attention sink (positions 0..sink-1) and
   the w = round(window * topk) most recent positions p - w + 1..p.
2. Anchor rows, from the far positions sink..p - w: queries come in blocks of ``block``
   consecutive tokens (aligned on t); each block has a pool of M = round(pool * topk) slots
   holding far rows visible to the block's first query, laid on a circle. Query t takes the arc
   of A = (1 - fresh) * (k_t - sink - w) rows starting at slot (t * S) mod M,
   S = round(step * topk): a neighbour shares all but S anchor rows, and G neighbours span
   min(M, A + (G - 1) S) anchor rows, so ``step`` sets the G = 2 ratio and ``pool`` the level
   it saturates at for larger G. From one block to the next a fraction ``drift`` of the slots
   is refilled (the "topic" moves slowly). With drift < 1 each slot holds one residue class of
   positions mod M (a random class per slot), so a refill never repeats a row of another slot;
   with drift = 1 the blocks' pools are independent random sets.
3. Fresh rows: the rest of the far part (a fraction ``fresh``, plus whatever the pool cannot
   supply at short prefixes), distinct uniform far positions outside the query's arc.

For G queries of one block far from the prefix limits, the union is about
w + sink + (G - 1) + min(M, A + (G - 1) S) + G * fresh * (topk - sink - w) rows; the union
ratio is that over topk.

Presets (``OVERLAP_PRESETS``), measured with ``sparse_mla.workloads.stats.union_ratio`` at long
context: cached = 28672, new = 4096 (positions 28K..32K), topk = 2048, seeds 0 and 1 (equal to
3 digits), groups of G consecutive queries aligned at t = 0 (the within-request layout):

    preset   G=2     G=4     G=8     G=16     published target (docs/DESIGN.md)
    high     1.150   1.198   1.200   1.204    G=2 ~1.15, G=8 ~1.2
    mid      1.150   1.327   1.401   1.548    G=2 ~1.15, G=8 ~1.4
    low      1.150   1.447   1.701   1.844    G=2 ~1.15, G=8 ~1.7
    none     2.000   4.000   8.000   14.997   worst case: disjoint lists, ratio G
    random   1.933   3.617   6.362   10.023   iid uniform over the prefix (reference)

A whole 32K prefill from an empty cache (cached 0, new 32768: short prefixes, whose lists
are forced to overlap, included) averages lower: high 1.14 / 1.18 / 1.19 / 1.19, mid 1.14 /
1.30 / 1.36 / 1.49, low 1.14 / 1.41 / 1.63 / 1.75, none 1.91 / 3.53 / 6.03 / 8.03, random
1.76 / 2.98 / 4.63 / 6.39 (G = 2 / 4 / 8 / 16; medians are the long-context values).
"none" is exactly G while a group's first query sees at least G * topk rows (G = 16 needs 32K;
at 28K..32K it reaches 15.0). "random" follows n (1 - (1 - topk / n) ** G) / topk for n visible
rows. The per-group spread is small (p90 within 0.01 of the mean for high / mid / low): every
group sees the same structure, where real prompts vary. The ratios depend on the fractions, not
the sizes, except that the window's shift (G - 1 rows) and the 4 sink rows weigh more at small
topk: at topk 256 over positions 3.5K..4K (the CPU test) they are 0.002-0.045 higher.

Cost: vectorized torch in chunks of whole blocks (a Python loop over chunks of ~1000 tokens,
none per token). One CPU thread: 8192 tokens from an empty cache at topk 2048 in 1.5-3.5 s;
4096 tokens at 28K..32K in 1-3 s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Elements per working tensor (tokens per chunk = this // candidates per token): bounds memory,
# and is a constant so that a seed gives the same lists whatever the device's memory.
_CHUNK_ELEMS = 1 << 22
# A query whose far range has fewer than this many times the rows it needs draws them as a random
# permutation of the range (exact); others draw with replacement, deduplicate and fall back to
# the permutation in the rare case that too few distinct rows came out.
_DENSE_FACTOR = 4
_BIG = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class OverlapModel:
    """Parameters of the synthetic top-k model (see the module docstring for the construction).
    The defaults are the "mid" preset.

    Attributes:
        sink: number of leading positions (attention sink) every query selects, >= 0.
        window: recent positions every query selects, as a fraction of topk, in [0, 1).
        pool: anchor pool slots per block, as a fraction of topk, >= 0 (0: no anchors).
        step: anchor rows a query replaces relative to its predecessor, fraction of topk, >= 0.
        fresh: fraction of the far part drawn uniformly at random per query, in [0, 1].
        block: queries per anchor block, >= 1 (groups of G dividing it, aligned at t = 0,
            never straddle two pools).
        drift: fraction of pool slots refilled from one block to the next, in [0, 1].
    """

    sink: int = 4
    window: float = 1 / 16
    pool: float = 1.188
    step: float = 0.131
    fresh: float = 0.02
    block: int = 64
    drift: float = 0.05

    def __post_init__(self) -> None:
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"OverlapModel.sink must be an int >= 0, got {self.sink!r}")
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"OverlapModel.block must be an int >= 1, got {self.block!r}")
        for name, lo, hi in (("window", 0.0, 1.0), ("fresh", 0.0, 1.0), ("drift", 0.0, 1.0),
                             ("pool", 0.0, float("inf")), ("step", 0.0, float("inf"))):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not lo <= v <= hi or (name == "window" and v >= 1):
                close = ")" if name == "window" else "]"
                raise ValueError(f"OverlapModel.{name} must be a number in [{lo}, {hi}{close}, got {v!r}")


OVERLAP_PRESETS: dict[str, OverlapModel] = {
    # G=2 1.15, saturating at 1.2 from G=4 on.
    "high": OverlapModel(sink=4, window=1 / 16, pool=1.132, step=0.15, fresh=0.0),
    # G=2 1.15, G=8 1.4.
    "mid": OverlapModel(sink=4, window=1 / 16, pool=1.188, step=0.131, fresh=0.02),
    # G=2 1.15, G=8 1.7.
    "low": OverlapModel(sink=4, window=1 / 16, pool=1.491, step=0.131, fresh=0.02),
    # Worst case: aligned groups of up to 16 queries take disjoint arcs of one pool per group.
    "none": OverlapModel(sink=0, window=0.0, pool=16.0, step=1.0, fresh=0.0, block=16, drift=1.0),
    # iid uniform distinct rows over the causal prefix.
    "random": OverlapModel(sink=0, window=0.0, pool=0.0, step=0.0, fresh=1.0),
}


def resolve_overlap(overlap: str | OverlapModel) -> OverlapModel:
    """An ``OverlapModel`` from a preset name (``OVERLAP_PRESETS``) or a model itself.

    Raises:
        ValueError: an unknown preset name (the message lists them). TypeError: another type.
    """
    if isinstance(overlap, OverlapModel):
        return overlap
    if isinstance(overlap, str):
        if overlap not in OVERLAP_PRESETS:
            raise ValueError(f"unknown overlap preset {overlap!r}; presets: {', '.join(OVERLAP_PRESETS)}")
        return OVERLAP_PRESETS[overlap]
    raise TypeError(f"overlap must be a preset name or an OverlapModel, got {type(overlap).__name__}")


def _first_distinct(cands: torch.Tensor, need: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first ``need`` distinct non-negative entries of ``cands`` in column order.

    cands [R, C] int64 (negative = hole), need [R] int64 <= width. Returns out [R, width] int64
    (the picks in column order, -1 after) and count [R] int64 (how many were found).
    """
    R, C = cands.shape
    out = torch.full((R, width + 1), -1, dtype=torch.int64, device=cands.device)
    if C == 0 or R == 0:
        return out[:, :width], torch.zeros(R, dtype=torch.int64, device=cands.device)
    v = torch.where(cands >= 0, cands, _BIG)
    sv, perm = torch.sort(v, dim=1, stable=True)
    first = torch.ones_like(sv, dtype=torch.bool)
    first[:, 1:] = sv[:, 1:] != sv[:, :-1]
    first &= sv != _BIG
    # Stable sort: the first of equal values is the leftmost occurrence.
    keep = torch.zeros_like(first).scatter_(1, perm, first)
    rank = torch.cumsum(keep, dim=1)
    sel = keep & (rank <= need[:, None])
    pos = torch.where(sel, rank - 1, width)
    out.scatter_(1, pos, torch.where(sel, cands, -1))
    return out[:, :width], sel.sum(dim=1)


def _compact(x: torch.Tensor, width: int) -> torch.Tensor:
    """[R, C] int64 with -1 holes -> [R, width]: the non-negative entries in order, then -1."""
    out = torch.full((x.shape[0], width + 1), -1, dtype=torch.int64, device=x.device)
    keep = x >= 0
    rank = torch.cumsum(keep, dim=1)
    pos = torch.where(keep & (rank <= width), rank - 1, width)
    out.scatter_(1, pos, torch.where(pos < width, x, -1))
    return out[:, :width]


def _uniform_draws(lo: torch.Tensor, size: torch.Tensor, m: int, gen: torch.Generator) -> torch.Tensor:
    """[R, m] int64 iid uniform in [lo, lo + size) per row (with repeats); -1 where size <= 0."""
    u = torch.rand(lo.shape[0], m, generator=gen, device=lo.device, dtype=torch.float64)
    x = (u * size[:, None]).floor().to(torch.int64)
    x = torch.minimum(x, (size - 1).clamp(min=0)[:, None])
    return torch.where(size[:, None] > 0, x + lo[:, None], -1)


def _sample_fresh(lo: torch.Tensor, size: torch.Tensor, need: torch.Tensor, taken: torch.Tensor,
                  in_taken, gen: torch.Generator) -> torch.Tensor:
    """Per row, a uniformly random set of ``need`` distinct rows of [lo, lo + size) that are not in
    ``taken`` ([R, C] int64, -1 holes, distinct valid entries), in random order.

    ``in_taken(row_ids, draws) -> bool [len(row_ids), m]`` tests membership in ``taken`` without a
    per-row sort (None: test by sorting). The caller guarantees enough free rows. Returns
    [R, max(need)] int64, -1 after each row's picks.
    """
    R = lo.shape[0]
    width = int(need.max()) if R else 0
    out = torch.full((R, width), -1, dtype=torch.int64, device=lo.device)
    if width == 0:
        return out
    hi = lo + size
    n_taken = ((taken >= lo[:, None]) & (taken < hi[:, None])).sum(dim=1)
    avail = size - n_taken
    dense = avail < _DENSE_FACTOR * need
    sp = ((~dense) & (need > 0)).nonzero()[:, 0]
    if sp.numel():
        # Sparse: draw with replacement (about twice the needed free rows), drop taken and repeats.
        m = int(torch.ceil(2.0 * need[sp] * size[sp] / avail[sp]).max()) + 64
        draws = _uniform_draws(lo[sp], size[sp], m, gen)
        if taken.shape[1]:
            hit = in_taken(sp, draws) if in_taken is not None else _member(draws, taken[sp])
            draws = torch.where(hit, -1, draws)
        got, count = _first_distinct(draws, need[sp], width)
        out[sp] = got
        dense[sp[count < need[sp]]] = True  # rare: too few distinct draws, redo exactly
    dn = (dense & (need > 0)).nonzero()[:, 0]
    if dn.numel():
        # Dense: random keys over the whole range, taken rows excluded, the `need` smallest.
        F = int(size[dn].max())
        per = max(1, _CHUNK_ELEMS // F)
        ar_f = torch.arange(F, device=lo.device)
        for i in range(0, dn.numel(), per):
            r = dn[i:i + per]
            free = torch.zeros(r.numel(), F + 1, dtype=torch.bool, device=lo.device)
            free[:, :F] = ar_f[None, :] < size[r][:, None]
            rel = taken[r] - lo[r][:, None]
            ok = (taken[r] >= 0) & (rel >= 0) & (rel < size[r][:, None])
            free.scatter_(1, torch.where(ok, rel, F), False)
            keys = torch.where(free[:, :F], torch.rand(r.numel(), F, generator=gen, device=lo.device), 2.0)
            w = min(width, F)
            vals, idx = torch.topk(keys, w, dim=1, largest=False, sorted=True)
            pick = (torch.arange(w, device=lo.device)[None, :] < need[r][:, None]) & (vals < 2.0)
            out[r, :w] = torch.where(pick, idx + lo[r][:, None], -1)
    return out


def _member(x: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
    """bool [R, m]: x[r, j] >= 0 occurs in sets[r] ([R, C] int64, -1 holes)."""
    srt = torch.where(sets >= 0, sets, _BIG).sort(dim=1).values
    pos = torch.searchsorted(srt, x).clamp(max=srt.shape[1] - 1)
    return (srt.gather(1, pos) == x) & (x >= 0)


def _check_int(name: str, v: object, lo: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def synthetic_topk(
    cached: int,
    new: int,
    topk: int = 2048,
    overlap: str | OverlapModel = "mid",
    *,
    seed: int = 0,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
    sort: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal synthetic top-k lists of one request (the DSA indexer's request-local output).

    Query t (0 <= t < new) sits at request-local position p = cached + t and selects
    k_t = min(topk, p + 1) distinct positions among 0..p (causal), built by ``overlap``'s model
    (module docstring: sink + recent window + a slowly rotating anchor arc + fresh rows). The
    neighbour overlap and the union ratios of each preset are tabulated in the module docstring.

    Args:
        cached: tokens of the request already in the cache (>= 0).
        new: query tokens of this step (>= 0).
        topk: K, the list width (>= 1; 2048 for DSA models).
        overlap: a preset name of ``OVERLAP_PRESETS`` ("high", "mid", "low", "none", "random")
            or an ``OverlapModel``.
        seed: seeds a fresh ``torch.Generator`` on ``device`` (ignored when ``generator`` is given).
        generator: a generator on ``device`` to draw from (advanced by the call).
        device: where the work runs and the outputs live. Deterministic for a given seed and device
            type (CPU and CUDA generators give different lists).
        sort: False: each list in the order built (sink ascending, window newest first, anchors
            in the pool's random circle order, fresh rows in random order), not by position,
            as an engine's top-k returns rows by score; True: ascending. Padding is at the end.

    Returns:
        positions: [new, topk] int32 request-local positions on ``device``; row t holds k_t
            distinct values in [0, cached + t], then -1.
        valid: [new] int32, k_t = min(topk, cached + t + 1).

    Raises:
        TypeError: cached / new / topk not ints, overlap of the wrong type, generator not a
            torch.Generator. ValueError: negative sizes, topk < 1, an unknown preset, a generator
            on another device type than ``device``.
    """
    cached = _check_int("cached", cached, 0)
    new = _check_int("new", new, 0)
    K = _check_int("topk", topk, 1)
    model = resolve_overlap(overlap)
    dev = torch.device(device)
    if generator is None:
        gen = torch.Generator(device=dev)
        gen.manual_seed(_check_int("seed", seed, 0))
    elif not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    else:
        gen = generator
    if gen.device.type != dev.type:
        raise ValueError(f"generator is on {gen.device} but device is {dev}; they must match")
    s = min(model.sink, K)
    W = min(int(round(model.window * K)), K - s)  # local rows capped to fit in topk
    M, S = int(round(model.pool * K)), int(round(model.step * K))

    positions = torch.full((new, K), -1, dtype=torch.int32, device=dev)
    valid = torch.clamp(torch.arange(new, device=dev, dtype=torch.int64) + cached + 1, max=K).to(torch.int32)
    if new == 0:
        return positions, valid

    B = model.block
    per_token = s + W + 2 * K + 64  # columns per token (local + extended arc + fresh), estimate
    chunk = max(1, _CHUNK_ELEMS // per_token // B) * B  # whole blocks per chunk
    ar_s = torch.arange(s, device=dev)
    ar_w = torch.arange(W, device=dev)
    pool_state = None  # the last block's pool, carried across chunks
    residue = torch.randperm(M, generator=gen, device=dev) if M > 0 and model.drift < 1.0 else None
    for start in range(0, new, chunk):
        t = torch.arange(start, min(new, start + chunk), device=dev, dtype=torch.int64)
        p = t + cached
        R = t.numel()
        k = torch.clamp(p + 1, max=K)
        far_lo = torch.full((R,), s, dtype=torch.int64, device=dev)
        far_size = torch.clamp(p - W - s + 1, min=0)  # far positions s .. p - W
        sink = torch.where(ar_s[None, :] <= p[:, None], ar_s[None, :], -1).expand(R, s)
        win = p[:, None] - ar_w[None, :]  # most recent first; rows < s belong to the sink
        parts = [sink, torch.where(win >= s, win, -1)]
        arc = torch.full((R, 0), -1, dtype=torch.int64, device=dev)
        in_arc = None
        if M > 0:
            pool, Mb, filled, pool_state = _block_pools(start // B, -(-R // B), B, cached, s, W, M, model.drift,
                                                        residue, pool_state, gen, dev)
            b = t // B - start // B
            Mb, filled = Mb[b], filled[b]
            Mb1 = Mb.clamp(min=1)
            kfar = k - torch.clamp(p + 1, max=s + W)
            A = torch.minimum(filled, torch.floor((1.0 - model.fresh) * kfar + 0.5).to(torch.int64))
            Amax = int(A.max())
            if Amax > 0:
                # Read past the arc's end over empty slots (see _block_pools) and keep the first
                # A rows; L = slots consumed.
                extra = Amax // 4 + 32
                ar_a = torch.arange(Amax + extra, device=dev)
                o = (t * S) % Mb1
                ext = pool[b[:, None], (o[:, None] + ar_a[None, :]) % Mb1[:, None]]
                span = torch.minimum(A + extra, Mb)
                ext = torch.where(ar_a[None, :] < span[:, None], ext, -1)
                keep = ext >= 0
                rank = torch.cumsum(keep, dim=1)
                arc = torch.where(keep & (rank <= A[:, None]), ext, -1)
                L = torch.minimum(((rank - keep.long()) < A[:, None]).sum(dim=1), span)
                parts.append(arc)
                sk, slot_of = _pool_index(pool)

                def in_arc(rows, draws, b=b, o=o, L=L, Mb1=Mb1, sk=sk, slot_of=slot_of):
                    q = b[rows][:, None] * (1 << 32) + draws
                    pos = torch.searchsorted(sk, q).clamp(max=sk.numel() - 1)
                    found = (sk[pos] == q) & (draws >= 0)
                    j = slot_of[pos]
                    return found & (((j - o[rows][:, None]) % Mb1[rows][:, None]) < L[rows][:, None])
        fixed = torch.cat(parts, dim=1)
        missing = k - (fixed >= 0).sum(dim=1)
        if int(missing.max()) > 0:
            fixed = torch.cat([fixed, _sample_fresh(far_lo, far_size, missing, arc, in_arc, gen)], dim=1)
        rows = _compact(fixed, K)
        if sort:
            rows = torch.where(rows >= 0, rows, _BIG).sort(dim=1).values
            rows = torch.where(rows == _BIG, -1, rows)
        positions[start:start + R] = rows.to(torch.int32)
    return positions, valid


def _block_pools(b0: int, nb: int, B: int, cached: int, s: int, W: int, M: int, drift: float,
                 residue: torch.Tensor, prev: tuple[torch.Tensor, torch.Tensor] | None,
                 gen: torch.Generator, dev: torch.device):
    """Anchor pools of blocks b0 .. b0 + nb - 1, from the far rows s .. p0 - W visible to each
    block's first query p0.

    drift >= 1: independent pools, min(M, r) distinct random rows in the first slots (r = rows
    in range). drift < 1: slot i only ever holds rows s + residue[i] + u * M (one residue class
    mod M per slot, ``residue`` a random permutation of 0..M-1), so refilled slots can never
    repeat a row another slot holds; a slot whose class has no row in range yet stays empty.

    Returns ([nb, M] int64 rows, -1 = empty; [nb] int64 circle sizes (slots used, arcs wrap
    at it); [nb] int64 filled slots; the last block's (pool, r) to pass as ``prev``).
    """
    first_pos = cached + (b0 + torch.arange(nb, device=dev, dtype=torch.int64)) * B
    r = torch.clamp(first_pos - W - s + 1, min=0)  # far rows visible to the block's first query
    if drift >= 1.0:
        size = torch.clamp(r, max=M)
        lo = torch.full((nb,), s, dtype=torch.int64, device=dev)
        got = _sample_fresh(lo, r, size, torch.full((nb, 0), -1, dtype=torch.int64, device=dev), None, gen)
        pool = torch.full((nb, M), -1, dtype=torch.int64, device=dev)
        pool[:, :got.shape[1]] = got
        return pool, size, size, (pool[-1].clone(), r[-1].clone())
    n_cls = torch.where(residue[None, :] < r[:, None], (r[:, None] - 1 - residue[None, :]) // M + 1, 0)
    u = torch.rand(nb, M, generator=gen, device=dev, dtype=torch.float64)
    u = torch.minimum((u * n_cls).floor().to(torch.int64), (n_cls - 1).clamp(min=0))
    cand = torch.where(n_cls > 0, s + residue[None, :] + u * M, -1)
    replaced = torch.rand(nb, M, generator=gen, device=dev) < drift
    # A slot empty in the previous block is refilled (its class may have a row in range now).
    prev_r = torch.full((1,), -1, dtype=torch.int64, device=dev) if prev is None else prev[1].reshape(1)
    replaced |= residue[None, :] >= torch.cat([prev_r, r[:-1]])[:, None]
    blk = torch.arange(nb, device=dev)[:, None].expand(nb, M)
    age = torch.cummax(torch.where(replaced, blk, -1), dim=0).values  # block of the last refill
    pool = cand.gather(0, age.clamp(min=0))
    if prev is not None:
        pool = torch.where(age >= 0, pool, prev[0][None, :])
    circle = torch.full((nb,), M, dtype=torch.int64, device=dev)
    return pool, circle, (pool >= 0).sum(dim=1), (pool[-1].clone(), r[-1].clone())


def _pool_index(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted keys block * 2**32 + row of the valid pool entries (holes sort last) and their slots."""
    nb, M = pool.shape
    blk = torch.arange(nb, device=pool.device, dtype=torch.int64)[:, None]
    key = torch.where(pool >= 0, blk * (1 << 32) + pool, _BIG).flatten()
    sk, order = key.sort()
    return sk, order % M


def local_to_global(positions: torch.Tensor, row_offset: int | torch.Tensor) -> torch.Tensor:
    """Request-local positions -> global cache rows for a contiguous cache: row = offset + position.

    Args:
        positions: [T, K] int32 request-local positions, negative = padding.
        row_offset: an int (one request stored at rows offset .. offset + len - 1) or a [T] int
            tensor (each query's request offset).

    Returns:
        [T, K] int32 global rows, -1 where positions is negative.

    Raises:
        TypeError: positions not an int32 tensor. ValueError: a negative offset, an offset tensor
            not of shape [T], or rows that overflow int32.
    """
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int32:
        raise TypeError(f"positions must be an int32 tensor [T, K], got {getattr(positions, 'dtype', type(positions))}")
    if positions.dim() != 2:
        raise ValueError(f"positions must be [T, K], got shape {tuple(positions.shape)}")
    if isinstance(row_offset, torch.Tensor):
        if row_offset.shape != (positions.shape[0],):
            raise ValueError(f"row_offset must be an int or [T] = [{positions.shape[0]}], got shape {tuple(row_offset.shape)}")
        off = row_offset.to(device=positions.device, dtype=torch.int64)[:, None]
        if off.numel() and int(off.min()) < 0:
            raise ValueError("row_offset must be >= 0")
        max_off = int(off.max()) if off.numel() else 0
    else:
        off = _check_int("row_offset", row_offset, 0)
        max_off = off
    if positions.numel() and max_off + int(positions.max()) > torch.iinfo(torch.int32).max:
        raise ValueError("row_offset + position overflows int32 rows")
    return torch.where(positions >= 0, positions.to(torch.int64) + off, -1).to(torch.int32)


@dataclass
class SyntheticBatch:
    """A prefill step of several requests over one contiguous latent cache.

    indices: [T, K] int32 global rows (-1 padding); valid: [T] int32 list lengths;
    cu_seqlens_q: [B + 1] int32 query boundaries; row_offsets: [B] int64 first cache row of each
    request; num_kv_rows: N = total cached + new tokens (request b's rows are
    row_offsets[b] .. row_offsets[b] + cached[b] + new[b] - 1).
    """

    indices: torch.Tensor
    valid: torch.Tensor
    cu_seqlens_q: torch.Tensor
    row_offsets: torch.Tensor
    num_kv_rows: int


def synthetic_batch(
    cached: list[int],
    new: list[int],
    topk: int = 2048,
    overlap: str | OverlapModel = "mid",
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> SyntheticBatch:
    """``synthetic_topk`` for several requests laid out one after another in a contiguous cache.

    Args:
        cached, new: per-request cached and new token counts (same length B >= 1).
        topk, overlap, device: as in ``synthetic_topk``; one generator seeded with ``seed`` draws
            all requests in order.

    Returns:
        SyntheticBatch with global ``indices`` [sum(new), topk] int32 ready for ``sparse_mla_fwd``
        (with ``cu_seqlens_q`` for the within-request layout), ``valid`` as ``topk_length``.

    Raises:
        ValueError: lists of different lengths or empty; the errors of ``synthetic_topk``.
    """
    if len(cached) != len(new) or not cached:
        raise ValueError(f"cached and new must be non-empty lists of equal length, got {len(cached)} and {len(new)}")
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(_check_int("seed", seed, 0))
    idx, val, offsets, off = [], [], [], 0
    for c, n in zip(cached, new):
        pos, v = synthetic_topk(c, n, topk, overlap, generator=gen, device=dev)
        idx.append(local_to_global(pos, off))
        val.append(v)
        offsets.append(off)
        off += c + n
    cu = torch.zeros(len(new) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new, dtype=torch.int64), 0).to(torch.int32)
    return SyntheticBatch(torch.cat(idx), torch.cat(val), cu.to(dev), torch.tensor(offsets, dtype=torch.int64, device=dev), off)
