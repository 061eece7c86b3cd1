"""The attention backend selection point (``sparse_mla.mqa.backends``), as plain Python on tensor metadata."""

from __future__ import annotations

import pytest
import torch

from sparse_mla.mqa import backends, gluon_sm90


def _qkv(H=16, D=576, dtype=torch.bfloat16):
    return torch.zeros(4, H, D, dtype=dtype), torch.zeros(100, D, dtype=dtype)


def test_auto_picks_gluon_on_hopper(hopper):
    q, kv = _qkv(H=64)
    name, why = backends.choose_backend(q, kv)
    assert name == "gluon_sm90" and "sm_90" in why
    assert backends.choose_backend(*_qkv(H=16), pseudo_heads=128)[0] == "gluon_sm90"  # a grouped tile


def test_few_heads_per_tile_stay_on_triton_on_the_split_schedule_only(hopper, monkeypatch):
    """Below 32 pseudo-heads on long steps the split schedule loses to the Triton kernel's small tiles; the pair
    schedule does not (backends.triton_small_tiles_win), and describe_for_device says the same."""
    T = backends.GLUON_FEW_HEADS_MAX_TOKENS + 1
    q, kv = torch.zeros(T, 16, 576, dtype=torch.bfloat16), torch.zeros(100, 576, dtype=torch.bfloat16)
    monkeypatch.setattr(gluon_sm90.config, "SCHEDULE", "split")
    name, why = backends.choose_backend(q, kv)
    assert name == "triton" and "pseudo-heads per tile" in why and "split schedule" in why
    assert backends.choose_backend(q[: T - 1], kv)[0] == "gluon_sm90"  # a short step fills more of the GPU this way
    assert "triton per token" in backends.describe_for_device(q.device, num_heads=16, num_tokens=T)
    monkeypatch.setattr(gluon_sm90.config, "SCHEDULE", "pair")
    assert backends.choose_backend(q, kv)[0] == "gluon_sm90"
    assert "triton per token" not in backends.describe_for_device(q.device, num_heads=16, num_tokens=T)


@pytest.mark.parametrize("cap", [(8, 0), (10, 0), (12, 0)])
def test_other_gpus_get_triton_with_the_reason(hopper, monkeypatch, cap):
    monkeypatch.setattr(backends, "_capability", lambda device: cap)
    name, why = backends.choose_backend(*_qkv())
    assert name == "triton" and f"{cap[0]}.{cap[1]}" in why


def test_unsupported_triton_version_names_it(hopper, monkeypatch):
    monkeypatch.setattr(gluon_sm90, "triton_version_supported", lambda version=None: False)
    name, why = backends.choose_backend(*_qkv())
    assert name == "triton" and "triton" in why and "3.6" in why


def test_interpreter_and_cpu_get_triton(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.choose_backend(*_qkv())[0] == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    name, why = backends.choose_backend(*_qkv())
    assert name == "triton" and "cpu" in why


@pytest.mark.parametrize("bad, expect", [
    ("dtype", "dtype"),
    ("kv_stride", "kv stride"),
    ("q_unaligned", "q is not 16-byte aligned"),
    ("q_last_dim", "last-dim stride"),
])
def test_layouts_the_kernel_cannot_take_fall_back(hopper, bad, expect):
    q, kv = _qkv(H=64)
    if bad == "dtype":
        q, kv = q.float(), kv.float()
    elif bad == "kv_stride":
        kv = torch.zeros(100, 584, dtype=torch.bfloat16)[:, :576]  # row stride 584: not a multiple of 16
    elif bad == "q_unaligned":
        q = torch.zeros(4 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(4, 64, 576)
    elif bad == "q_last_dim":
        q = torch.zeros(4, 64, 576, 2, dtype=torch.bfloat16)[..., 0]
    name, why = backends.choose_backend(q, kv)
    assert name == "triton" and expect in why, why


def test_forcing(hopper, monkeypatch):
    q, kv = _qkv(H=64)
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    assert backends.choose_backend(q, kv) == ("triton", f"forced by {backends.ENV_VAR}=triton")
    monkeypatch.setenv(backends.ENV_VAR, "gluon_sm90")
    assert backends.choose_backend(q, kv)[0] == "gluon_sm90"
    monkeypatch.setattr(backends, "_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match="does not apply: compute capability 8.0"):
        backends.choose_backend(q, kv)
    monkeypatch.setenv(backends.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=backends.ENV_VAR):
        backends.choose_backend(q, kv)


def test_describe_backend_says_which_and_why(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    line = backends.describe_backend(*_qkv())
    assert line.startswith("attention backend: triton (")


def test_gluon_variant_list_covers_modes_layouts_dtypes_schedules():
    v = gluon_sm90.all_variants()
    fp8 = [x for x in v if x[4]]
    # x 2: with and without split-KV (KV_SPLIT), but grouped tiles on an FP8 cache (gluon_sm90.kv_split_missing)
    assert len(v) == len(set(v)) == 2 * (2 * 2 * 2 * len(gluon_sm90.SCHEDULES) + 2 * len(gluon_sm90.FP8_SCHEDULES)) - 1
    assert {x for x in v if x[5]} == {x[:5] + (True, ) for x in v if not x[5] and not (x[0] and x[4])}
    assert {x[3] for x in v} == set(gluon_sm90.SCHEDULES) and gluon_sm90.config.SCHEDULE in gluon_sm90.SCHEDULES
    # the fp8_ds_mla variants: both modes, D_qk 576, bf16 q, on the schedules that have one
    assert sorted((x[0], x[1], x[2], x[3], x[5]) for x in fp8) == sorted(
        (g, True, "bf16", sc, sp) for sc in gluon_sm90.FP8_SCHEDULES for g in (False, True) for sp in (False, True)
        if not (g and sp))


def test_explain_names_the_attention_backend(monkeypatch):
    from sparse_mla.layer import PrefillStep, explain

    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    text = str(explain(PrefillStep(16, 512, 128, 64, 128, 2048, (4096,), (4096,))))
    line = backends.describe_for_device(num_heads=16, num_tokens=4096)  # this machine's answer
    assert line in text
    if not torch.cuda.is_available():  # CPU: the interpreter runs the Triton kernel, and explain says why
        assert "attention backend: triton (gluon_sm90 does not apply:" in text
    else:
        assert line.startswith("attention backend: ")
