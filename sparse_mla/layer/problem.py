"""What the layer-level DSA prefill works on: a plain-Python step description and validated tensors.

``PrefillStep`` holds only Python numbers (dims, per-request lengths, flags), so the dispatcher can
be decided and tested without tensors. ``DSAPrefillProblem`` is the validated tensor view of one
``dsa_prefill`` call; ``sparse_mla.layer.checks.validate_dsa_prefill_args`` builds it (checks run before any
kernel launch).

Request layout (the contiguous-cache form; a paged ``block_table`` form belongs to the integration
layer): request b has ``cached_lens[b]`` positions already in the cache and ``new_lens[b]`` new
tokens, which are its last ``new_lens[b]`` positions. Its position p (0 <= p < cached + new) is the
global kv row ``row_offsets[b] + p``. The new tokens of all requests are the T rows of ``q``, request
by request (T = sum(new_lens)). New token i of request b (position cached_b + i) may see the rows
``row_offsets[b] .. row_offsets[b] + cached_b + i``: its causal *window*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import env
from ..kv_format import KV_FORMATS, check_kv_format
from .host import to_device_async


def _lengths(name: str, x: object) -> tuple[int, ...]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints [B], got {x.dtype} {tuple(x.shape)}")
        x = x.tolist()
    if not isinstance(x, Sequence) or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints [B] (host-side lengths), got {type(x).__name__}")
    out = []
    for b, v in enumerate(x):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}[{b}] must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name}[{b}] = {v} must be >= 0")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True)
class PrefillStep:
    """Plain-Python description of one prefill step: what the dispatcher decides on.

    Fields:
        num_heads: H, query heads on this rank (heads per rank under TP).
        kv_lora_rank: r, latent width (512 for every supported model).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head dims of the MHA form
            (qk_rope_head_dim may be 0: the NoPE layout).
        topk: K, entries per query in ``indices``.
        cached_lens, new_lens: [B] per-request lengths (see the module docstring).
        dense_topk: the caller's statement that every query's top-k list is its whole causal
            window (True), is not (False), or unknown (None: inferred as True when every window is
            <= topk and no ``topk_length`` is given, as DSA's indexer selects every position then).
        has_topk_length: whether a ``topk_length`` tensor comes with the indices.
        kernels_available: whether the Triton kernels can run (CUDA, or CPU with TRITON_INTERPRET=1).
        kv_format: the cache's format: None (rows in q's dtype) or "fp8_ds_mla" (``sparse_mla.kv_format``:
            the MQA paths dequantize in the kernel, the MHA paths dequantize the window rows first).

    Raises:
        TypeError, ValueError: a non-int dim or length, a negative value, mismatched list lengths, an
            unknown kv_format.
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    topk: int
    cached_lens: tuple[int, ...]
    new_lens: tuple[int, ...]
    dense_topk: bool | None = None
    has_topk_length: bool = False
    kernels_available: bool = True
    kv_format: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "topk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        r = self.qk_rope_head_dim
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"qk_rope_head_dim must be an int >= 0, got {r!r}")
        object.__setattr__(self, "cached_lens", _lengths("cached_lens", self.cached_lens))
        object.__setattr__(self, "new_lens", _lengths("new_lens", self.new_lens))
        if len(self.cached_lens) != len(self.new_lens) or not self.new_lens:
            raise ValueError(
                f"cached_lens and new_lens must both have B >= 1 entries, got {len(self.cached_lens)} and {len(self.new_lens)}"
            )
        if self.dense_topk not in (None, True, False):
            raise TypeError(f"dense_topk must be None, True or False, got {self.dense_topk!r}")
        check_kv_format(self.kv_format)

    @classmethod
    def from_model(cls, model: object, *, cached_lens: Sequence[int], new_lens: Sequence[int], tp_size: int = 1,
                   topk: int | None = None, **flags) -> PrefillStep:
        """A step for a model config (any object with ``num_heads``, ``kv_lora_rank``,
        ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``topk``, e.g.
        ``sparse_mla.workloads.models.MLAConfig``), with ``num_heads // tp_size`` heads per rank.

        Raises:
            ValueError: num_heads not divisible by tp_size.
        """
        heads = int(model.num_heads)
        if tp_size < 1 or heads % tp_size:
            raise ValueError(f"tp_size must divide num_heads = {heads}, got {tp_size}")
        return cls(heads // tp_size, int(model.kv_lora_rank), int(model.qk_nope_head_dim), int(model.qk_rope_head_dim),
                   int(model.v_head_dim), int(topk if topk is not None else model.topk),
                   tuple(cached_lens), tuple(new_lens), **flags)

    @property
    def num_requests(self) -> int:
        return len(self.new_lens)

    @property
    def num_tokens(self) -> int:
        """T = sum(new_lens)."""
        return sum(self.new_lens)

    @property
    def windows(self) -> tuple[int, ...]:
        """Per request, cached + new: the rows its last new token sees."""
        return tuple(c + n for c, n in zip(self.cached_lens, self.new_lens))

    @property
    def max_window(self) -> int:
        """Longest visible window of any new token (0 when no request has new tokens)."""
        return max((c + n for c, n in zip(self.cached_lens, self.new_lens) if n > 0), default=0)

    @property
    def mha_qk_head_dim(self) -> int:
        """qk head dim of the MHA form: qk_nope + qk_rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_d_qk(self) -> int:
        """D_qk of the MQA (absorbed) form: kv_lora_rank + qk_rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def dense_eligible(self) -> tuple[bool, str]:
        """Whether every query's top-k is its whole causal window, with the reason."""
        if self.dense_topk is True:
            return True, "caller says every top-k list is the whole causal prefix (dense_topk=True)"
        if self.dense_topk is False:
            return False, "caller says the top-k lists are not the whole prefix (dense_topk=False)"
        if self.has_topk_length:
            return False, "topk_length given: the lists may be cut short (pass dense_topk=True if they are whole prefixes)"
        if self.max_window > self.topk:
            return False, f"longest window {self.max_window} > topk {self.topk}: the top-k is a strict subset"
        return True, f"every window <= topk ({self.max_window} <= {self.topk}): the top-k is the whole prefix"


def causal_sums(cached: int, new: int, topk: int | None = None) -> int:
    """sum over the new tokens i of min(topk, cached + i + 1) (no cap when topk is None): the keys
    a request's queries see in total (dense) or read (sparse)."""
    total = new * cached + new * (new + 1) // 2
    if topk is None:
        return total
    m = min(max(topk - cached, 0), new)  # tokens whose window is <= topk
    return m * cached + m * (m + 1) // 2 + (new - m) * topk


def kernels_available(device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Triton kernels run on CUDA, or on the CPU through the interpreter (TRITON_INTERPRET=1), and not
    in bf16 under the interpreter (its bf16 tl.dot is wrong; ``sparse_mla.checks.require_kernel_tensor``)."""
    interpreted = env.interpreted()
    if dtype == torch.bfloat16 and interpreted:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted)


@dataclass(frozen=True)
class DSAPrefillProblem:
    """Validated tensors of one ``dsa_prefill`` call (see ``validate_dsa_prefill_args``).

    With an FP8 cache (``kv_format="fp8_ds_mla"``) there is no kv_c / k_pe tensor in q's dtype: ``kv_rows`` is
    the cache's uint8 rows [N, 656] and ``kv_c`` / ``k_pe`` are None; ``latent_rows`` and ``k_pe_rows``
    dequantize what a path reads (``sparse_mla.kv_format``).
    """

    q_nope: torch.Tensor  # [T, H, qk_nope] last dim contiguous
    q_pe: torch.Tensor | None  # [T, H, qk_rope], None when qk_rope == 0
    w_kv_b: torch.Tensor  # [H, qk_nope + v, r] (view of kv_b_proj.weight)
    kv_c: torch.Tensor | None  # [N, r]; None for an FP8 cache
    k_pe: torch.Tensor | None  # [N, qk_rope], None when qk_rope == 0 or for an FP8 cache
    kv_rows: torch.Tensor | None  # [N, r + qk_rope] one row tensor when available without a copy; the FP8 cache's bytes
    indices: torch.Tensor  # [T, K] int32
    topk_length: torch.Tensor | None  # [T] int32
    sm_scale: float
    row_offsets: tuple[int, ...]  # [B] global row of each request's position 0
    step: PrefillStep
    kv_format: str | None = None  # None or "fp8_ds_mla" (then kv_rows is uint8 [N, 656])
    kv_dequant: str = "auto"  # an FP8 cache's route in the MQA paths (``sparse_mla.layer.staging``)

    @property
    def w_uk(self) -> torch.Tensor:
        """[H, qk_nope, r]: W_UK, k_nope[h] = kv_c @ w_uk[h].T."""
        return self.w_kv_b[:, : self.step.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """[H, v, r]: W_UV, v[h] = kv_c @ w_uv[h].T."""
        return self.w_kv_b[:, self.step.qk_nope_head_dim:]

    @property
    def num_kv_rows(self) -> int:
        return (self.kv_c if self.kv_c is not None else self.kv_rows).shape[0]

    @property
    def cache_device(self) -> torch.device:
        return (self.kv_c if self.kv_c is not None else self.kv_rows).device

    def latent_rows(self, rows: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(kv_c[rows] [L, r], k_pe[rows] [L, qk_rope] or None) in q_nope's dtype: views of the cache for plain
        rows, the dequantized rows (a new [L, r + qk_rope] buffer) for an FP8 cache. ``rows``: a slice or a 1-D
        int64 tensor of row ids on the cache's device."""
        if self.kv_format is None:
            return self.kv_c[rows], None if self.k_pe is None else self.k_pe[rows]
        fmt = KV_FORMATS[self.kv_format]
        if isinstance(rows, torch.Tensor):
            deq = fmt.dequantize(self.kv_rows, self.q_nope.dtype, rows=rows)
        else:
            deq = fmt.dequantize(self.kv_rows[rows], self.q_nope.dtype)
        r = self.step.kv_lora_rank
        return deq[:, :r], deq[:, r:]

    def k_pe_rows(self) -> torch.Tensor | None:
        """k_pe of every cache row [N, qk_rope] in q_nope's dtype (None without a rope part): the k_pe view,
        or for an FP8 cache its bf16 k_pe bytes viewed (no copy for a bf16 q) or converted to q's dtype."""
        if self.kv_format is None:
            return self.k_pe
        pe = KV_FORMATS[self.kv_format].rope(self.kv_rows)
        return pe if pe.dtype == self.q_nope.dtype else pe.to(self.q_nope.dtype)


def window_rows(p: DSAPrefillProblem) -> tuple[torch.Tensor | slice, list[int]]:
    """The cache rows of every request's window, concatenated request by request, and where each
    request starts in that concatenation. A slice when the windows are adjacent (always for one request: no
    gather), else int64 row ids built on the host and copied to the cache's device in one transfer."""
    starts, acc, rows = [], 0, []
    for o, L in zip(p.row_offsets, p.step.windows):
        starts.append(acc)
        acc += L
        rows.append((o, L))
    if all(rows[b][0] == rows[0][0] + starts[b] for b in range(len(rows))):
        return slice(rows[0][0], rows[0][0] + acc), starts
    ids = torch.cat([torch.arange(o, o + L) for o, L in rows])
    return to_device_async(ids, p.cache_device), starts


def token_windows(new_lens: Sequence[int], cached_lens: Sequence[int], row_offsets: Sequence[int],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per new token: (lo [T] int64, win [T] int64) on ``device``; token i of request b may see the
    global rows lo .. lo + win - 1, lo = row_offsets[b], win = cached_b + i + 1. One request is built on
    the device directly (no host tensor, no copy: the common prefill step costs two small kernels)."""
    new_lens, cached_lens, row_offsets = list(new_lens), list(cached_lens), list(row_offsets)
    if len(new_lens) == 1:
        T, c = int(new_lens[0]), int(cached_lens[0])
        win = torch.arange(c + 1, c + T + 1, dtype=torch.int64, device=device)
        return torch.full((T, ), int(row_offsets[0]), dtype=torch.int64, device=device), win
    new = torch.tensor(new_lens, dtype=torch.int64)
    T = int(new.sum())
    req = torch.repeat_interleave(torch.arange(len(new)), new)
    first = torch.cumsum(new, 0) - new
    i = torch.arange(T) - first[req]
    lo = torch.tensor(row_offsets, dtype=torch.int64)[req]
    win = torch.tensor(cached_lens, dtype=torch.int64)[req] + i + 1
    return to_device_async(lo, device), to_device_async(win, device)


def restrict_to_windows(indices: torch.Tensor, lo: torch.Tensor, win: torch.Tensor) -> torch.Tensor:
    """indices [T, K] int32 with every entry outside its token's window replaced by -1 (padding).
    Compares in int32 (lo + win <= N < 2**31), so no [T, K] int64 temporary."""
    lo32 = lo.to(torch.int32)[:, None]
    hi32 = (lo + win).to(torch.int32)[:, None]
    return torch.where((indices >= lo32) & (indices < hi32), indices, -1)


def window_row_ids(p: DSAPrefillProblem) -> torch.Tensor:
    """[R] int64 on the cache's device: the cache rows of every request window that has new tokens
    (rows row_offsets[b] .. row_offsets[b] + cached_b + new_b - 1), ascending, each once."""
    dev = p.cache_device
    parts = [torch.arange(o, o + c + n, device=dev) for o, c, n in zip(p.row_offsets, p.step.cached_lens, p.step.new_lens)
             if n > 0]
    return torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.int64, device=dev)


