"""Input validation of ``sparse_mla_fwd`` / ``build_group_union`` / ``sparse_mla_ref``: one test per error.

Every bad input must raise a TypeError (wrong type or dtype) or ValueError (shape, layout, device,
value) whose message names the argument, before any kernel launch: the ``no_launch`` fixture
replaces every kernel launcher that ``sparse_mla.mqa.interface`` calls with one that fails the test.
Device mismatch is tested with a ``meta`` tensor, so it needs no second device. bf16 under the
interpreter (whose bf16 tl.dot is silently wrong) is refused with a TypeError, for ``sparse_mla_fwd``
and the masked-MHA kernel entry.
"""

from __future__ import annotations

import math

import pytest
import torch
from testlib.device import DEVICE, DTYPE, INT_MAX

import sparse_mla.layer.masked_mha as masked_mha
import sparse_mla.mqa.interface as interface
import sparse_mla.union.interface as union_interface
from sparse_mla import SparseMLAWorkspace, build_group_union, sparse_mla_fwd, sparse_mla_ref

T, H, D, N, K = 3, 2, 576, 16, 4
# modules whose functions launch kernels (the planner, the union builders, the probe)
LAUNCHERS = ("sparse_mla.union.planning", "sparse_mla.union.triton_tl", "sparse_mla.union.cuda_smem",
             "sparse_mla.union.backends", "sparse_mla.union.probe")
OTHER_DTYPE = torch.float16 if DTYPE == torch.bfloat16 else torch.bfloat16


@pytest.fixture
def no_launch(monkeypatch):
    """Every kernel launcher imported into the interfaces (``sparse_mla_fwd``'s, ``build_group_union``'s) fails the
    test if called."""
    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched before the input error was raised")

    patched = []
    for mod in (interface, union_interface):
        for name, obj in list(vars(mod).items()):
            module = getattr(obj, "__module__", "") or ""
            if callable(obj) and not isinstance(obj, type) and module.startswith(LAUNCHERS):
                monkeypatch.setattr(mod, name, launched)
                patched.append(f"{mod.__name__}.{name}")
    for name in ("per_token", "grouped"):  # the attention launches go through the backend selection point
        monkeypatch.setattr(interface.mqa_backends, name, launched)
        patched.append(f"mqa_backends.{name}")
    return patched


def _args():
    """A valid problem: q [T, H, D], kv [N, D], indices [T, K] with distinct rows, topk_length [T]."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g).to(DTYPE).to(DEVICE)
    kv = torch.randn(N, D, generator=g).to(DTYPE).to(DEVICE)
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).to(torch.int32).to(DEVICE)
    return {"q": q, "kv": kv, "indices": idx, "sm_scale": D**-0.5}


def _call(args, **kwargs):
    a = dict(args)
    return sparse_mla_fwd(a.pop("q"), a.pop("kv"), a.pop("indices"), a.pop("sm_scale"), **a, **kwargs)


def _set(key, make):
    """A case that replaces one argument with make(valid args)."""
    return lambda a: {**a, key: make(a)}


meta = torch.device("meta")

# (mutation of the valid arguments, expected error, regex the message must match)
CASES = [
    # not a tensor
    # a NumPy array (shape and dtype attributes, no tensor); float32 first, since NumPy has no bf16
    pytest.param(_set("q", lambda a: a["q"].float().cpu().numpy()), TypeError, r"\bq\b", id="q-not-a-tensor"),
    pytest.param(_set("kv", lambda a: a["kv"].tolist()), TypeError, r"\bkv\b", id="kv-not-a-tensor"),
    pytest.param(_set("indices", lambda a: a["indices"].tolist()), TypeError, r"\bindices\b", id="indices-not-a-tensor"),
    pytest.param(_set("topk_length", lambda a: [K] * T), TypeError, "topk_length", id="topk_length-not-a-tensor"),
    pytest.param(_set("cu_seqlens_q", lambda a: [0, T]), TypeError, "cu_seqlens_q", id="cu_seqlens_q-not-a-tensor"),
    # dtypes
    pytest.param(_set("q", lambda a: a["q"].float()), TypeError, r"\bq\b.*dtype", id="q-fp32"),
    pytest.param(_set("q", lambda a: a["q"].to(torch.int32)), TypeError, r"\bq\b.*dtype", id="q-int32"),
    pytest.param(_set("kv", lambda a: a["kv"].to(OTHER_DTYPE)), TypeError, r"\bkv\b.*dtype", id="kv-dtype-differs-from-q"),
    pytest.param(_set("indices", lambda a: a["indices"].long()), TypeError, r"\bindices\b.*int32", id="indices-int64"),
    pytest.param(_set("topk_length", lambda a: torch.full((T,), K, dtype=torch.int64, device=DEVICE)), TypeError,
                 "topk_length.*int32", id="topk_length-int64"),
    pytest.param(_set("cu_seqlens_q", lambda a: torch.tensor([0, T], device=DEVICE)), TypeError, "cu_seqlens_q.*int32",
                 id="cu_seqlens_q-int64"),
    # shapes
    pytest.param(_set("q", lambda a: a["q"][0]), ValueError, r"\bq\b.*\[T, H, D_qk\]", id="q-2d"),
    pytest.param(_set("q", lambda a: a["q"][:, :0]), ValueError, r"\bq\b.*head", id="q-zero-heads"),
    pytest.param(lambda a: {**a, "q": a["q"][..., :128].contiguous(), "kv": a["kv"][:, :128].contiguous()}, ValueError,
                 "D_qk", id="D_qk-128-unsupported"),
    pytest.param(_set("kv", lambda a: a["kv"][:, :512].contiguous()), ValueError, r"\bkv\b.*D_qk", id="D_qk-q576-kv512"),
    pytest.param(_set("kv", lambda a: a["kv"][0]), ValueError, r"\bkv\b", id="kv-1d"),
    pytest.param(_set("kv", lambda a: a["kv"].reshape(2, 2, 4, D)), ValueError, r"\bkv\b", id="kv-4d"),
    pytest.param(_set("kv", lambda a: a["kv"].reshape(2, 8, D)[:, :4]), ValueError, r"\bkv\b.*block",
                 id="kv-paged-bad-block-stride"),
    pytest.param(_set("indices", lambda a: torch.cat([a["indices"], a["indices"][:1]])), ValueError, r"\bindices\b.*T = 3",
                 id="indices-T-mismatch"),
    pytest.param(_set("indices", lambda a: a["indices"][:, None].expand(T, 2, K)), ValueError, r"\bindices\b",
                 id="indices-T2K"),
    pytest.param(_set("indices", lambda a: a["indices"][:, :0]), ValueError, r"\bindices\b.*K >= 1", id="indices-K0"),
    pytest.param(_set("indices", lambda a: a["indices"][0]), ValueError, r"\bindices\b", id="indices-1d"),
    pytest.param(_set("topk_length", lambda a: torch.full((T + 1,), K, dtype=torch.int32, device=DEVICE)), ValueError,
                 "topk_length", id="topk_length-T-mismatch"),
    pytest.param(_set("topk_length", lambda a: torch.full((T, 1), K, dtype=torch.int32, device=DEVICE)), ValueError,
                 "topk_length", id="topk_length-2d"),
    pytest.param(_set("cu_seqlens_q", lambda a: torch.tensor([0], dtype=torch.int32, device=DEVICE)), ValueError,
                 "cu_seqlens_q", id="cu_seqlens_q-no-request"),
    pytest.param(_set("cu_seqlens_q", lambda a: torch.tensor([[0, T]], dtype=torch.int32, device=DEVICE)), ValueError,
                 "cu_seqlens_q", id="cu_seqlens_q-2d"),
    pytest.param(_set("d_v", lambda a: 256), ValueError, r"\bd_v\b", id="d_v-256"),
    # layouts (last dim must be contiguous)
    pytest.param(_set("q", lambda a: torch.cat([a["q"], a["q"]], -1)[..., ::2]), ValueError, r"\bq\b.*contiguous",
                 id="q-last-dim-strided"),
    pytest.param(_set("kv", lambda a: torch.cat([a["kv"], a["kv"]], -1)[:, ::2]), ValueError, r"\bkv\b.*contiguous",
                 id="kv-last-dim-strided"),
    pytest.param(_set("indices", lambda a: torch.cat([a["indices"], a["indices"]], -1)[:, ::2]), ValueError,
                 r"\bindices\b.*contiguous", id="indices-last-dim-strided"),
    # devices (a meta tensor stands in for a second device)
    pytest.param(_set("kv", lambda a: a["kv"].to(meta)), ValueError, r"\bkv\b.*meta", id="kv-other-device"),
    pytest.param(_set("indices", lambda a: a["indices"].to(meta)), ValueError, r"\bindices\b.*meta", id="indices-other-device"),
    pytest.param(_set("topk_length", lambda a: torch.full((T,), K, dtype=torch.int32, device=meta)), ValueError,
                 "topk_length.*meta", id="topk_length-other-device"),
    pytest.param(_set("cu_seqlens_q", lambda a: torch.tensor([0, T], dtype=torch.int32).to(meta)), ValueError,
                 "cu_seqlens_q.*meta", id="cu_seqlens_q-other-device"),
    # values
    pytest.param(_set("sm_scale", lambda a: math.nan), ValueError, "sm_scale", id="sm_scale-nan"),
    pytest.param(_set("sm_scale", lambda a: math.inf), ValueError, "sm_scale", id="sm_scale-inf"),
    pytest.param(_set("sm_scale", lambda a: -math.inf), ValueError, "sm_scale", id="sm_scale-minus-inf"),
    pytest.param(_set("method", lambda a: "flash"), ValueError, "method", id="method-unknown"),
    pytest.param(_set("method", lambda a: "reference"), ValueError, "method", id="method-reference-not-a-kernel"),
]


@pytest.mark.parametrize("mutate, error, match", CASES)
def test_bad_argument_raises_before_launch(mutate, error, match, no_launch):
    with pytest.raises(error, match=match):
        _call(mutate(_args()))


# check=True reads the contents: (mutation, regex). Shapes and dtypes are valid.
CHECKED_CASES = [
    pytest.param(lambda a: {**a, "indices": _put(a["indices"], 1, 2, N)}, r"indices\[1, 2\] = 16 is out of range",
                 id="row-equal-N"),
    pytest.param(lambda a: {**a, "indices": _put(a["indices"], 2, 0, INT_MAX)}, r"indices\[2, 0\].*out of range",
                 id="row-INT_MAX"),
    pytest.param(lambda a: {**a, "indices": _put(a["indices"], 0, 3, int(a["indices"][0, 1]))},
                 r"indices\[0\] lists row \d+ more than once", id="duplicate-row"),
    pytest.param(lambda a: {**a, "topk_length": torch.tensor([K, K + 1, 0], dtype=torch.int32, device=DEVICE)},
                 r"topk_length\[1\] = 5", id="topk_length-above-K"),
    pytest.param(lambda a: {**a, "topk_length": torch.tensor([K, 0, -1], dtype=torch.int32, device=DEVICE)},
                 r"topk_length\[2\] = -1", id="topk_length-negative"),
    pytest.param(lambda a: {**a, "cu_seqlens_q": torch.tensor([1, T], dtype=torch.int32, device=DEVICE)}, "cu_seqlens_q",
                 id="cu_seqlens_q-not-from-0"),
    pytest.param(lambda a: {**a, "cu_seqlens_q": torch.tensor([0, T - 1], dtype=torch.int32, device=DEVICE)}, "cu_seqlens_q",
                 id="cu_seqlens_q-not-to-T"),
    pytest.param(lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 2, 1, T], dtype=torch.int32, device=DEVICE)},
                 "cu_seqlens_q", id="cu_seqlens_q-decreasing"),
    pytest.param(lambda a: {**a, "kv": _poison_row(a["kv"], int(a["indices"][1, 2]), math.nan)},
                 r"kv rows \[\d+\] hold NaN or inf values and are selected by some query \(first: indices\[1, 2\]",
                 id="nan-in-a-selected-row"),
    pytest.param(lambda a: {**a, "kv": _poison_row(_poison_row(a["kv"], int(a["indices"][0, 0]), -math.inf),
                                                   int(a["indices"][2, 3]), math.inf)},
                 r"kv rows \[\d+, \d+\] hold NaN or inf.*Non-finite kv rows", id="inf-in-two-selected-rows"),
    pytest.param(lambda a: {**a, "attn_sink": torch.tensor([0.5, math.nan], device=DEVICE)},
                 r"attn_sink\[1\] is NaN .*check=True", id="nan-attn_sink"),
]


def _poison_row(kv: torch.Tensor, row: int, value: float) -> torch.Tensor:
    kv = kv.clone()
    kv[row, 7] = value
    return kv


def _put(t: torch.Tensor, i: int, j: int, v: int) -> torch.Tensor:
    t = t.clone()
    t[i, j] = v
    return t


@pytest.mark.parametrize("method", ["per_token", "grouped"])
@pytest.mark.parametrize("mutate, match", CHECKED_CASES)
def test_checked_mode_raises_before_launch(mutate, match, method, no_launch):
    with pytest.raises(ValueError, match=match):
        _call(mutate(_args()), check=True, method=method)


def test_checked_mode_accepts_padding_and_garbage_past_topk_length(no_launch):
    """check=True must not flag what the definition calls padding: negative rows anywhere, and rows
    >= N or repeats past topk_length (the patched launchers then fail the test, proving no raise)."""
    a = _args()
    idx = a["indices"].clone()
    idx[0, 1] = -1
    idx[1, 0] = -(2**31)
    idx[2, 2:] = torch.tensor([N + 3, int(idx[2, 0])], dtype=torch.int32)  # past topk_length[2] = 2
    a = {**a, "indices": idx, "topk_length": torch.tensor([K, K, 2], dtype=torch.int32, device=DEVICE)}
    with pytest.raises(AssertionError, match="kernel was launched"):
        _call(a, check=True, method="per_token")
    # and the reference agrees that these are valid inputs
    sparse_mla_ref(**a, check=True)


def test_checked_mode_accepts_nonfinite_rows_no_query_selects(no_launch):
    """The contract (docs/DESIGN.md "Non-finite kv rows"): a row no query selects never reaches the result,
    so check=True accepts a NaN / inf there (the patched launchers then fail the test, proving no raise)."""
    a = _args()
    unselected = sorted(set(range(N)) - set(a["indices"].flatten().tolist()))
    assert unselected
    kv = a["kv"].clone()
    kv[unselected[0]] = math.nan
    kv[unselected[-1], :3] = math.inf
    with pytest.raises(AssertionError, match="kernel was launched"):
        _call({**a, "kv": kv}, check=True, method="per_token")


def test_checked_mode_accepts_infinite_sinks_and_reference_refuses_nan(no_launch):
    """-inf (no sink) and +inf (out 0) are defined sink values: check=True passes them to the kernel (the
    patched launchers then fail the test, proving no raise); the reference's check=True refuses a NaN as
    sparse_mla_fwd's does, and without check the reference computes NaN for that head only."""
    a = _args()
    with pytest.raises(AssertionError, match="kernel was launched"):
        _call({**a, "attn_sink": torch.tensor([-math.inf, math.inf], device=DEVICE)}, check=True, method="per_token")
    nan_sink = torch.tensor([0.5, math.nan], device=DEVICE)
    with pytest.raises(ValueError, match=r"attn_sink\[1\] is NaN"):
        sparse_mla_ref(**a, attn_sink=nan_sink, check=True)
    out, _ = sparse_mla_ref(**a, attn_sink=nan_sink)
    assert torch.isfinite(out[:, 0]).all() and out[:, 1].isnan().all()


@pytest.mark.parametrize("make, error, match", [
    pytest.param(lambda a: torch.empty(T, H + 1, 512, dtype=DTYPE, device=DEVICE), ValueError,
                 r"out must be \[T, H, d_v\] = \[3, 2, 512\] .*; got shape \[3, 3, 512\]", id="out-wrong-shape"),
    pytest.param(lambda a: torch.empty(T, H, 512, dtype=torch.float32, device=DEVICE), TypeError,
                 "out must be .*; got dtype torch.float32", id="out-fp32"),
    pytest.param(lambda a: torch.empty(T, H, 1024, dtype=DTYPE, device=DEVICE)[..., ::2], ValueError,
                 r"out must be .*last dim contiguous \(stride 1\); got strides \(2048, 1024, 2\)", id="out-last-dim-strided"),
    pytest.param(lambda a: torch.empty(T, H, 512, dtype=DTYPE, device=meta), ValueError, "out must be .*got a tensor on meta",
                 id="out-other-device"),
    pytest.param(lambda a: torch.empty(1, H, 512, dtype=DTYPE, device=DEVICE).expand(T, H, 512), ValueError,
                 "out must be .*its own memory.*expanded", id="out-expanded-over-tokens"),
    pytest.param(lambda a: a["kv"][: T * H].view(T, H, 576)[..., :512], ValueError, "out shares memory with kv",
                 id="out-inside-kv"),
    pytest.param(lambda a: [[0.0]], TypeError, "out must be a torch.Tensor", id="out-not-a-tensor"),
])
def test_bad_out_buffer(make, error, match, no_launch):
    a = _args()
    with pytest.raises(error, match=match):
        _call(a, out=make(a), method="per_token")


@pytest.mark.parametrize("make, error, match", [
    pytest.param(lambda: torch.empty(T, H, dtype=DTYPE, device=DEVICE), TypeError, "lse must be .*float32.*got dtype",
                 id="lse-not-fp32"),
    pytest.param(lambda: torch.empty(T, H + 1, dtype=torch.float32, device=DEVICE), ValueError,
                 r"lse must be \[T, H\] = \[3, 2\].*got shape \[3, 3\]", id="lse-wrong-shape"),
    pytest.param(lambda: torch.empty(H, T, dtype=torch.float32, device=DEVICE).t(), ValueError,
                 "lse must be .*contiguous; got strides", id="lse-transposed"),
    pytest.param(lambda: torch.empty(T, H, dtype=torch.float32, device=meta), ValueError, "lse must be .*on meta",
                 id="lse-other-device"),
])
def test_bad_lse_buffer(make, error, match, no_launch):
    with pytest.raises(error, match=match):
        _call(_args(), lse=make(), return_lse=True, method="per_token")


def test_out_and_lse_must_not_overlap(no_launch):
    buf = torch.empty(T * H * 512 * 2, dtype=DTYPE, device=DEVICE)
    out = buf[: T * H * 512].view(T, H, 512)
    lse = buf[: T * H * 2].view(torch.float32).view(T, H)  # the first bytes of out
    with pytest.raises(ValueError, match="out shares memory with lse"):
        _call(_args(), out=out, lse=lse, return_lse=True, method="per_token")


@pytest.mark.parametrize("kwargs, error, match", [
    pytest.param({"return_lse": 1}, TypeError, r"return_lse must be a bool \(True or False\), got int 1", id="return_lse-int"),
    pytest.param({"return_lse": "no"}, TypeError, "return_lse must be a bool", id="return_lse-str"),
    pytest.param({"check": None}, TypeError, "check must be a bool", id="check-None"),
    pytest.param({"sm_scale": True}, TypeError, "sm_scale must be a finite float .*got bool True", id="sm_scale-bool"),
    pytest.param({"sm_scale": "0.1"}, TypeError, "sm_scale must be a finite float .*got str", id="sm_scale-str"),
    pytest.param({"sm_scale": torch.tensor(0.1)}, TypeError, "sm_scale .*a tensor would need a device sync",
                 id="sm_scale-tensor"),
    pytest.param({"d_v": 512.0}, TypeError, "d_v must be an int, got float", id="d_v-float"),
    pytest.param({"d_v": True}, TypeError, "d_v must be an int, got bool", id="d_v-bool"),
    pytest.param({"group_size": 2.0, "method": "grouped"}, TypeError, "group_size must be an int, got float",
                 id="group_size-float"),
    pytest.param({"group_size": True, "method": "per_token"}, TypeError, "group_size must be an int, got bool",
                 id="group_size-bool-per-token"),
    pytest.param({"overlap_guard": True}, TypeError, "overlap_guard must be a finite float", id="overlap_guard-bool"),
    pytest.param({"overlap_guard": -2.0}, ValueError, "overlap_guard must be >= 0", id="overlap_guard-negative"),
    pytest.param({"overlap_guard": float("nan")}, ValueError, "overlap_guard must be >= 0", id="overlap_guard-nan"),
    pytest.param({"workspace": "ws"}, TypeError, "workspace must be a SparseMLAWorkspace or None, got str", id="workspace-str"),
    pytest.param({"workspace": SparseMLAWorkspace(T, K, 16, N, meta)}, ValueError, "workspace must be on q's device",
                 id="workspace-other-device"),
])
def test_silently_coerced_or_bad_options(kwargs, error, match, no_launch):
    """Flags and numbers of sparse_mla_fwd are checked by type: a bool is not a float or an int, 1 is not
    True, a float group size is not truncated; every one before any launch."""
    a = _args()
    if "sm_scale" in kwargs:
        a["sm_scale"] = kwargs.pop("sm_scale")
    with pytest.raises(error, match=match):
        _call(a, **{"method": "per_token", **kwargs})


@pytest.mark.parametrize("group_size", [
    pytest.param(0, id="0"), pytest.param(17, id="17"), pytest.param(128, id="G-times-H-over-128"),
])
def test_bad_group_size(group_size, no_launch):
    with pytest.raises(ValueError, match="group_size"):
        _call(_args(), method="grouped", group_size=group_size)


@pytest.mark.parametrize("ws_args", [
    pytest.param((T - 1, K, 16), id="too-few-tokens"),
    pytest.param((T, K + 1, 16), id="other-topk"),
    pytest.param((T, K, 8), id="other-group-size"),
])
def test_workspace_that_does_not_fit(ws_args, no_launch):
    ws = SparseMLAWorkspace(ws_args[0], ws_args[1], ws_args[2], N, DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        _call(_args(), method="grouped", workspace=ws)


@pytest.mark.parametrize("kwargs", [
    pytest.param({"max_tokens": 4, "topk": 4, "group_size": 0}, id="group_size-0"),
    pytest.param({"max_tokens": 4, "topk": 4, "group_size": 17}, id="group_size-17"),
    pytest.param({"max_tokens": 0, "topk": 4, "group_size": 8}, id="max_tokens-0"),
    pytest.param({"max_tokens": 4, "topk": 0, "group_size": 8}, id="topk-0"),
])
def test_bad_workspace(kwargs):
    with pytest.raises(ValueError, match="group_size|max_tokens|topk"):
        SparseMLAWorkspace(max_kv_rows=N, device=DEVICE, **kwargs)


def test_cpu_tensors_need_the_interpreter(monkeypatch, no_launch):
    """CPU tensors without TRITON_INTERPRET=1 (on any machine) raise instead of launching."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in _args().items()}
    with pytest.raises(ValueError, match="CUDA|TRITON_INTERPRET"):
        _call(a, method="per_token")
    with pytest.raises(ValueError, match="CUDA|TRITON_INTERPRET"):
        build_group_union(a["indices"], 2)


@pytest.mark.parametrize("method", ["per_token", "grouped"])
def test_bf16_under_the_interpreter_raises_before_launch(method, monkeypatch, no_launch):
    """bf16 CPU tensors (which only the interpreter runs) raise a TypeError naming q: the interpreter's
    bf16 tl.dot is wrong. On any machine: TRITON_INTERPRET=1 is set for the call, no kernel launches."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in _args().items()}
    a["q"], a["kv"] = a["q"].to(torch.bfloat16), a["kv"].to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"\bq is bfloat16 on the CPU.*TRITON_INTERPRET=1.*float16"):
        _call(a, method=method)


def _masked_mha_args(dtype, device="cpu"):
    """A valid masked-MHA call: one request of 3 new tokens after 5 cached, H = 2, qk 32 + 16, v 32."""
    Tn, Hh, L = 3, 2, 8
    g = torch.Generator().manual_seed(1)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    plan = masked_mha.plan_masked_mha([5], [Tn], [0], [0], 16, device)
    words = torch.full((max(plan.total_words, 1),), -1, dtype=torch.int32, device=device)
    out = torch.empty(Tn, Hh, 32, dtype=dtype, device=device)
    return (rnd(Tn, Hh, 32), rnd(Tn, Hh, 16), rnd(L, Hh, 32), rnd(L, 16), rnd(L, Hh, 32), words, plan, 0.1, out)


@pytest.mark.parametrize("which, name", [
    pytest.param(range(5), "q_nope", id="all-bf16"),
    pytest.param([2], "k_nope", id="k_nope-bf16"),
    pytest.param([4], "v", id="v-bf16"),
])
def test_masked_mha_bf16_under_the_interpreter_raises_before_launch(which, name, monkeypatch):
    """The masked-MHA kernel entry refuses bf16 inputs under the interpreter with a TypeError naming the
    first such argument, before its kernel is launched."""
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the masked-MHA kernel was launched before the bf16 input was refused")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(masked_mha, "_masked_mha_fwd_kernel", NoLaunch())
    args = list(_masked_mha_args(torch.float16))
    for i in which:
        args[i] = args[i].to(torch.bfloat16)
    with pytest.raises(TypeError, match=rf"\b{name} is bfloat16 on the CPU.*TRITON_INTERPRET=1"):
        masked_mha.masked_mha_fwd(*args)


def test_masked_mha_cpu_tensors_need_the_interpreter(monkeypatch):
    """Without TRITON_INTERPRET=1 CPU tensors raise a ValueError (fp16 too) instead of launching."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"\bq_nope is on cpu.*TRITON_INTERPRET"):
        masked_mha.masked_mha_fwd(*_masked_mha_args(torch.float16))


def _masked_set(i, make):
    """A masked-MHA call with argument i replaced by make(args)."""
    def mutate(args):
        args = list(args)
        args[i] = make(args)
        return args
    return mutate


# masked_mha_fwd argument positions: q_nope 0, q_pe 1, k_nope 2, k_pe 3, v 4, words 5, plan 6, sm_scale 7, out 8
MASKED_CASES = [
    pytest.param(_masked_set(0, lambda a: a[0][:, :, :16]), ValueError, r"k_nope must be \[L, H, qk_nope\] = \[L, 2, 16\]",
                 id="q_nope-k_nope-dims-differ"),
    pytest.param(_masked_set(1, lambda a: None), ValueError, "q_pe and k_pe must both", id="q_pe-without-k_pe"),
    pytest.param(_masked_set(2, lambda a: a[2].float()), TypeError, r"k_nope must be .*float16.*got dtype torch.float32",
                 id="k_nope-fp32"),
    pytest.param(_masked_set(4, lambda a: torch.cat([a[4], a[4]], -1)[..., ::2]), ValueError, r"v must be .*last dim contiguous",
                 id="v-last-dim-strided"),
    pytest.param(_masked_set(4, lambda a: a[4][:-1]), ValueError, r"v must be \[L, H, v_head_dim\] = \[8, 2", id="v-rows"),
    pytest.param(_masked_set(3, lambda a: a[3][:, :8]), ValueError, r"k_pe must be \[N, qk_rope\] = \[N, 16\]",
                 id="k_pe-width"),
    pytest.param(_masked_set(5, lambda a: a[5].long()), TypeError, "words must be .*int32", id="words-int64"),
    pytest.param(_masked_set(5, lambda a: a[5][:0]), ValueError, "words must be 1-D with at least", id="words-short"),
    pytest.param(_masked_set(6, lambda a: "plan"), TypeError, "plan must be a MaskedMHAPlan", id="plan-not-a-plan"),
    pytest.param(_masked_set(6, lambda a: masked_mha.plan_masked_mha([5], [2], [0], [0], 16, "cpu")), ValueError,
                 "plan must be for the T = 3 tokens", id="plan-other-T"),
    pytest.param(_masked_set(7, lambda a: True), TypeError, "sm_scale must be a finite float, got bool", id="sm_scale-bool"),
    pytest.param(_masked_set(8, lambda a: a[8][:, :1]), ValueError, r"out must be \[T, H, v_head_dim\] = \[3, 2, 32\]",
                 id="out-shape"),
    pytest.param(_masked_set(8, lambda a: a[8][:1].expand(3, 2, 32)), ValueError, "its own memory", id="out-expanded"),
    pytest.param(_masked_set(8, lambda a: a[4][:3]), ValueError, "out shares memory with v", id="out-aliases-v"),
]


@pytest.mark.parametrize("mutate, error, match", MASKED_CASES)
def test_masked_mha_bad_arguments_raise_before_launch(mutate, error, match, monkeypatch):
    """masked_mha_fwd checks every argument (shape, dtype, device, layout, overlap) before its launch."""
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the masked-MHA kernel was launched before the input error was raised")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(masked_mha, "_masked_mha_fwd_kernel", NoLaunch())
    with pytest.raises(error, match=match):
        masked_mha.masked_mha_fwd(*mutate(_masked_mha_args(torch.float16)))


def test_key_bitmask_honours_strides_and_checks_arguments():
    """build_key_bitmask reads indices / topk_length through their strides (a transposed indices, a strided
    topk_length give the masks of the contiguous copies) and names a bad argument."""
    plan = masked_mha.plan_masked_mha([5, 0], [3, 4], [0, 8], [0, 8], 16, DEVICE)
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(-2, 14, (7, 6), generator=g, dtype=torch.int32).to(DEVICE)
    tl_ = torch.tensor([6, 2, 0, 6, 3, 6, 1], dtype=torch.int32, device=DEVICE)
    want = masked_mha.build_key_bitmask(idx, tl_, plan)
    idx_t = idx.t().contiguous().t()
    tl_strided = torch.stack([tl_, tl_ + 100], 1)[:, 0]
    got = masked_mha.build_key_bitmask(idx_t, tl_strided, plan)
    assert idx_t.stride(1) != 1 and tl_strided.stride(0) == 2
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"indices must be \[T, K\] with T = 7"):
        masked_mha.build_key_bitmask(idx[:3], None, plan)
    with pytest.raises(TypeError, match="topk_length must be .*int32"):
        masked_mha.build_key_bitmask(idx, tl_.long(), plan)
    with pytest.raises(ValueError, match="out must be .*contiguous"):
        masked_mha.build_key_bitmask(idx, None, plan, out=torch.zeros(2 * plan.total_words, dtype=torch.int32,
                                                                      device=DEVICE)[::2])


@pytest.mark.parametrize("call, error, match", [
    pytest.param(lambda i: build_group_union(i.long(), 2), TypeError, "indices", id="indices-int64"),
    pytest.param(lambda i: build_group_union(i.tolist(), 2), TypeError, "indices", id="indices-not-a-tensor"),
    pytest.param(lambda i: build_group_union(i[0], 2), ValueError, "indices", id="indices-1d"),
    pytest.param(lambda i: build_group_union(i[:, None].expand(T, 2, K), 2), ValueError, "indices", id="indices-T2K"),
    pytest.param(lambda i: build_group_union(i, 0), ValueError, "group_size", id="group_size-0"),
    pytest.param(lambda i: build_group_union(i, 17), ValueError, "group_size", id="group_size-17"),
    pytest.param(lambda i: build_group_union(i, 2.0), TypeError, "group_size must be an int, got float", id="group_size-float"),
    pytest.param(lambda i: build_group_union(i, True), TypeError, "group_size must be an int, got bool", id="group_size-bool"),
    pytest.param(lambda i: build_group_union(i, 2, topk_length=[2] * T), TypeError, "topk_length must be a torch.Tensor",
                 id="topk_length-list"),
    pytest.param(lambda i: build_group_union(i, 2, topk_length=torch.full((T,), 2, dtype=torch.int32, device=meta)),
                 ValueError, "topk_length must be .*got a tensor on meta", id="topk_length-other-device"),
    pytest.param(lambda i: build_group_union(i, 2, num_kv_rows=16.0), TypeError, "num_kv_rows must be an int",
                 id="num_kv_rows-float"),
    pytest.param(lambda i: build_group_union(i, 2, num_kv_rows=0), ValueError, "num_kv_rows must be an int in",
                 id="num_kv_rows-0"),
    pytest.param(lambda i: build_group_union(i, 2, topk_length=torch.full((T,), 2, device=i.device)), TypeError,
                 "topk_length", id="topk_length-int64"),
    pytest.param(lambda i: build_group_union(i, 2, topk_length=torch.full((T + 1,), 2, dtype=torch.int32, device=i.device)),
                 ValueError, "topk_length", id="topk_length-wrong-shape"),
])
def test_build_group_union_bad_arguments(call, error, match, no_launch):
    with pytest.raises(error, match=match):
        call(_args()["indices"])


def test_reference_shares_the_checks():
    """sparse_mla_ref validates like sparse_mla_fwd (it also accepts fp32 q / kv)."""
    a = _args()
    with pytest.raises(TypeError, match="indices"):
        sparse_mla_ref(a["q"], a["kv"], a["indices"].long(), a["sm_scale"])
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_ref(a["q"], a["kv"], _put(a["indices"], 0, 0, N), a["sm_scale"], check=True)
    out, lse = sparse_mla_ref(a["q"].float(), a["kv"].float(), a["indices"], a["sm_scale"])
    assert out.dtype == lse.dtype == torch.float32 and out.shape == (T, H, 512)
