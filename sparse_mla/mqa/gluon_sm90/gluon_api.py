"""The Gluon API these kernels use, or why it does not import (``GLUON_IMPORT_ERROR``).

The names are re-exported for common / split / pair (``__all__`` keeps ``ruff --fix`` from dropping them)."""

from __future__ import annotations

try:  # the import itself may fail on Triton versions without (this) Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    GLUON_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed triton
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["GLUON_IMPORT_ERROR", "async_copy", "fence_async_shared", "gl", "gluon", "mbarrier", "warpgroup_mma",
           "warpgroup_mma_wait"]
