"""Host -> device copies that do not stall the host on the GPU.

A plain ``cpu_tensor.to("cuda")`` from pageable memory blocks the host until the copy ran, that
is until every kernel queued before it finished: a layer call that builds a few small index
tensors on the host would then wait for the previous call's attention, and the GPU would idle
while the host prepares the next launch. Staging through pinned memory makes the copy
asynchronous (PyTorch's pinned-memory allocator keeps the staging buffer alive until the copy
has run on its stream).
"""

from __future__ import annotations

import torch


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device`` without blocking the host when ``device`` is CUDA; a
    plain ``.to(device)`` otherwise (CPU, or the interpreter).

    Raises:
        RuntimeError: called while a CUDA graph is being captured. The copy would be captured with
            the address of a pinned staging buffer that the allocator reuses after the call, so a
            replay would read stale host data. Code that builds host-side index tensors per step
            (the layer-level ``dsa_prefill``) cannot be captured; capture ``sparse_mla_fwd`` with a
            ``SparseMLAWorkspace`` and device-side metadata instead (README, engine snippet).
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a host->device copy of per-step metadata was requested during CUDA graph capture: the layer-level "
            "dsa_prefill builds its index tensors on the host and cannot be captured; capture sparse_mla_fwd with a "
            "SparseMLAWorkspace and device-side cu_seqlens_q / indices instead"
        )
    return t.pin_memory().to(device, non_blocking=True)


__all__ = ["to_device_async"]
