"""The device and dtype the suite runs on (a CUDA GPU in bf16, else the CPU interpreter in fp16)."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float16


def cpu_only(what: str):
    """Marker of a test about the CPU machine itself (the Triton interpreter, gloo ranks on CPU tensors, the CPU
    bench): skipped where a CUDA GPU is present, whose runs compile the kernels (conftest.py leaves
    TRITON_INTERPRET unset there) and have GPU twins of these tests. ``what`` names it in the skip reason."""
    return pytest.mark.skipif(HAS_CUDA, reason=f"CPU machines only: {what}")


INT_MIN = -(2**31)
INT_MAX = 2**31 - 1
