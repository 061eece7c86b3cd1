"""FlashMLA's sparse-prefill test cases (deepseek-ai/FlashMLA ``tests/test_flash_mla_sparse_prefill.py``),
rebuilt with this repository's own generator, and its comparison rule and tolerances.

* ``Case``: one test point (FlashMLA's TestParam fields that matter for the forward).
* ``FLASHMLA_CORRECTNESS`` / ``FLASHMLA_FEATURES`` / ``FLASHMLA_CORNER``: FlashMLA's published lists at
  full size (run on a GPU in bf16); ``CPU_*``: the same categories at interpreter sizes (fp16 on the CPU).
* ``make_inputs``: FlashMLA's input distribution (q, kv ~ N(0, 0.1^2) + a per-case offset, sm_scale
  0.5), invalid entries drawn from its sentinel list at random positions, rows with no valid entry,
  attn_sink with +-inf entries, topk_length, and every tensor padded the way FlashMLA's tests pad them
  (each dim + 1, the last + 128), so token / head / row strides are not the contiguous ones.
* ``assert_allclose_flashmla``: FlashMLA's rule: +inf, -inf and NaN at the same positions, then each
  element within abs_tol or rel_tol, and a cosine-difference bound; ``TOLERANCES`` are FlashMLA's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
# FlashMLA's invalid-index candidates (those below s_kv are dropped per case: they would be valid).
SENTINELS = (INT_MIN, -123456, -1, "s_kv", 114514, 1919810, 2147480000, INT_MAX)

# FlashMLA's tolerances (test_flash_mla_sparse_prefill.py): out abs 8e-4 / rel 3.01/128 / cosine diff 7e-6,
# max_logits and lse abs 1e-6 / rel 2.01/65536.
TOLERANCES = {
    "out": {"abs_tol": 8e-4, "rel_tol": 3.01 / 128, "cos_diff_tol": 7e-6},
    "max_logits": {"abs_tol": 1e-6, "rel_tol": 2.01 / 65536},
    "lse": {"abs_tol": 1e-6, "rel_tol": 2.01 / 65536},
}


@dataclass(frozen=True)
class Case:
    s_q: int
    s_kv: int
    topk: int
    h_q: int = 128
    d_qk: int = 512
    attn_sink: bool = False
    topk_length: bool = False
    all_invalid: bool = False  # some rows get no valid entry (FlashMLA's is_all_indices_invalid)
    seed: int = 0

    @property
    def id(self) -> str:
        flags = "".join(f"-{n}" for n, on in (("sink", self.attn_sink), ("topklen", self.topk_length),
                                               ("allinvalid", self.all_invalid)) if on)
        return f"sq{self.s_q}-skv{self.s_kv}-k{self.topk}-h{self.h_q}-d{self.d_qk}{flags}-s{self.seed}"


def _padded(x: torch.Tensor) -> torch.Tensor:
    """A copy of x inside a larger buffer (each dim + 1, the last + 128), as FlashMLA's tests pass tensors."""
    big = torch.full([n + 1 for n in x.shape[:-1]] + [x.shape[-1] + 128], 0, dtype=x.dtype, device=x.device)
    view = big[tuple(slice(0, n) for n in x.shape)]
    view.copy_(x)
    return view


def make_inputs(case: Case, device, dtype) -> dict:
    """FlashMLA-style inputs for ``flash_mla_sparse_fwd`` (keyword dict), deterministic in case.seed and the
    device (drawn on the device: the 70000-token case has 10 GB of q)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(1000 + case.seed)
    dev = {"generator": g, "device": device}
    off_q, off_kv = ((torch.rand(2, **dev) - 0.5) / 10).tolist()
    q = (torch.randn(case.s_q, case.h_q, case.d_qk, **dev) / 10 + off_q).clamp_(-10, 10).to(dtype)
    kv = (torch.randn(case.s_kv, 1, case.d_qk, **dev) / 10 + off_kv).clamp_(-10, 10).to(dtype)

    # Each row: a random choice of min(topk, s_kv) distinct rows, the rest invalid sentinels, all at random positions.
    take = min(case.topk, case.s_kv)
    rows = torch.rand(case.s_q, case.s_kv, **dev).argsort(dim=1)[:, :take].to(torch.int32)
    sentinels = torch.tensor([case.s_kv if v == "s_kv" else v for v in SENTINELS
                              if v == "s_kv" or v < 0 or v >= case.s_kv], dtype=torch.int32, device=device)
    idx = sentinels[torch.randint(0, sentinels.numel(), (case.s_q, case.topk), **dev)]
    idx[:, :take] = rows
    idx = idx.gather(1, torch.rand(case.s_q, case.topk, **dev).argsort(dim=1))
    if case.all_invalid:
        empty = torch.rand(case.s_q, **dev) < 0.1
        empty[case.s_q // 2] = True
        idx[empty] = sentinels[torch.randint(0, sentinels.numel(), (1,), **dev)]

    sink = None
    if case.attn_sink:
        sink = torch.randn(case.h_q, **dev)
        mask = torch.randn(case.h_q, **dev)
        sink[mask < -0.5] = float("-inf")
        sink[mask > 0.5] = float("inf")
        if case.h_q >= 3:  # small head counts still see both infinities and a finite sink
            sink[:3] = torch.tensor([float("inf"), float("-inf"), 0.3], device=device)
    lengths = None
    if case.topk_length:
        lengths = torch.randint(0, max(case.topk + 1, 64), (case.s_q,), **dev).clamp_max(case.topk).to(torch.int32)

    return {"q": _padded(q), "kv": _padded(kv), "indices": _padded(idx[:, None, :]), "sm_scale": 0.5,
            "attn_sink": sink, "topk_length": lengths}


def assert_allclose_flashmla(name: str, ans: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float,
                             cos_diff_tol: float | None = None) -> None:
    """FlashMLA's comparison: +inf / -inf / NaN at exactly the same positions; every other element within
    abs_tol or within rel_tol (relative to |ref| + 1e-6); and, when given, 1 - cosine similarity (computed
    as 1 - 2 <a, r> / (|a|^2 + |r|^2) in fp64) within cos_diff_tol."""
    assert ans.shape == ref.shape, f"{name}: shape {tuple(ans.shape)} != reference {tuple(ref.shape)}"
    a, r = ans.detach().float().clone(), ref.detach().float().to(ans.device).clone()
    for label, fa, fr in (("+inf", a == float("inf"), r == float("inf")), ("-inf", a == float("-inf"), r == float("-inf")),
                          ("NaN", a.isnan(), r.isnan())):
        if not torch.equal(fa, fr):
            where = (fa != fr).nonzero()[0].tolist()
            raise AssertionError(f"{name}: {label} at {int(fa.sum())} positions, reference at {int(fr.sum())} "
                                 f"(first difference at {where}: {a[tuple(where)].item()} vs {r[tuple(where)].item()})")
        a[fa] = 0.0
        r[fr] = 0.0
    abs_err = (a - r).abs()
    rel_err = abs_err / (r.abs() + 1e-6)
    bad = (abs_err >= abs_tol) & (rel_err >= rel_tol)
    if bad.any():
        flat = torch.where(bad, abs_err, 0.0).flatten().argmax()
        pos = tuple(int(i) for i in torch.unravel_index(flat, a.shape))
        raise AssertionError(f"{name}: {int(bad.sum())} of {a.numel()} elements outside abs {abs_tol:g} / rel {rel_tol:g}; "
                             f"worst at {list(pos)}: {a[pos].item()!r} vs reference {r[pos].item()!r}")
    if cos_diff_tol is not None:
        a64, r64 = a.double(), r.double()
        if (r64 * r64).sum().item() >= 1e-12:
            cos_diff = 1 - 2 * (a64 * r64).sum().item() / (a64 * a64 + r64 * r64).sum().item()
            assert abs(cos_diff) <= cos_diff_tol, f"{name}: cosine difference {cos_diff:.3e} > {cos_diff_tol:g}"


def check_against_reference(case: Case, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``flash_mla_sparse_fwd`` on the case's inputs and compare out / max_logits / lse with
    ``flash_mla_sparse_ref`` under FlashMLA's tolerances; also checks output shapes, dtypes and layouts."""
    from sparse_mla import flash_mla_sparse_fwd, flash_mla_sparse_ref

    x = make_inputs(case, device, dtype)
    out, max_logits, lse = flash_mla_sparse_fwd(**x)
    assert out.shape == (case.s_q, case.h_q, 512) and out.dtype == dtype and out.is_contiguous()
    assert max_logits.shape == lse.shape == (case.s_q, case.h_q)
    assert max_logits.dtype == lse.dtype == torch.float32
    ref_out, ref_max, ref_lse = flash_mla_sparse_ref(**x)
    assert_allclose_flashmla("out", out, ref_out, **TOLERANCES["out"])
    assert_allclose_flashmla("max_logits", max_logits, ref_max, **TOLERANCES["max_logits"])
    assert_allclose_flashmla("lse", lse, ref_lse, **TOLERANCES["lse"])
    return out, max_logits, lse


# ------------------------------------------------------------------------------------------- case lists
# FlashMLA's lists, full size (GPU, bf16). Its "have_sink_lse" loop does not change the inputs of the
# forward (it repeats each feature case with a new seed), so it becomes the seed here.
_REGULAR = [(128, 128), (256, 256), (512, 512)]
_IRREGULAR = [(592, 128), (1840, 256), (1592, 384), (1521, 512)]
_OOB = [(95, 128), (153, 256), (114, 384)]  # topk > s_kv: invalid entries in every row

FLASHMLA_CORRECTNESS = [
    Case(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk)
    for d_qk in (512, 576) for h_q in (128, 64) for s_kv, topk in _REGULAR + _IRREGULAR + _OOB for s_q in (1, 62, 213)
]
FLASHMLA_FEATURES = [
    Case(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, attn_sink=sink, topk_length=tl_, seed=rep)
    for d_qk in (512, 576) for h_q in (128, 64) for s_kv, topk in _IRREGULAR + _OOB for s_q in (62, 213)
    for rep in (0, 1) for sink in (False, True) for tl_ in (False, True)
]
FLASHMLA_CORNER = [
    Case(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, all_invalid=True, attn_sink=True, topk_length=True)
    for d_qk in (512, 576) for h_q in (128, 64)
    for s_q, s_kv, topk in ((1, 128, 128), (1, 256, 256), (1234, 4321, 4096), (4096, 2048, 2048))
] + [
    # topk far above s_kv: whole kv tiles with no valid entry
    Case(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, attn_sink=True, topk_length=True)
    for d_qk in (512, 576) for h_q in (128, 64) for s_kv, topk in ((32, 2048), (64, 8192)) for s_q in (1, 1024)
]
# (FlashMLA's s_q = 70000 case, no correctness check there, is its own test: grid limits + sampled rows.)

# Head counts FlashMLA does not take: every h_q in 1..128 on one feature-complete shape.
HEAD_SWEEP = [Case(62, 592, 128, h_q=h, d_qk=576, attn_sink=True, topk_length=True, all_invalid=True) for h in range(1, 129)]

# The same categories at interpreter sizes (CPU, fp16): regular (s_kv = topk), irregular (s_kv not a
# multiple of the 64-row tile, topk < s_kv), out-of-bounds top-k (topk > s_kv); s_q 1 and a few tokens.
_CPU_REGULAR = [(64, 64)]
_CPU_IRREGULAR = [(150, 64), (95, 128)]
_CPU_OOB = [(40, 64)]
CPU_CORRECTNESS = [
    Case(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk)
    for d_qk in (512, 576) for h_q in (128, 64) for s_kv, topk in _CPU_REGULAR + _CPU_IRREGULAR + _CPU_OOB
    for s_q in (1, 3)
]
CPU_FEATURES = [
    Case(3, s_kv, topk, h_q=64, d_qk=d_qk, attn_sink=sink, topk_length=tl_)
    for d_qk in (512, 576) for s_kv, topk in ((150, 64), (40, 64)) for sink in (False, True) for tl_ in (False, True)
]
CPU_CORNER = [
    Case(s_q, s_kv, topk, h_q=64, d_qk=d_qk, all_invalid=True, attn_sink=True, topk_length=True)
    for d_qk in (512, 576) for s_q, s_kv, topk in ((1, 64, 64), (5, 200, 128))
] + [
    Case(s_q, 32, 256, h_q=64, d_qk=576, attn_sink=True, topk_length=True) for s_q in (1, 4)
]
CPU_HEADS = [Case(3, 150, 64, h_q=h, d_qk=576, attn_sink=True, topk_length=True, all_invalid=True)
             for h in (1, 2, 3, 5, 16, 24, 33, 100)]
