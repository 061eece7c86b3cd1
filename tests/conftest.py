"""Test set-up: without a CUDA GPU the kernels run through Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before any kernel module is imported (Triton reads it when a kernel
is decorated), so it is set here, before the tests import sparse_mla's kernels.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
