"""Recording the launch grids of a problem without running it (CPU checks of grid limits)."""

from __future__ import annotations

# CUDA launch limits per grid dimension (x, y, z).
CUDA_GRID_LIMITS = (2**31 - 1, 65535, 65535)


def record_launch_grids(monkeypatch) -> list[tuple[str, tuple[int, ...]]]:
    """Replace every Triton / Gluon kernel (module globals named ``*_kernel``) of sparse_mla.mqa (both
    backends), sparse_mla.union.planning and sparse_mla.union.triton_tl with a stub that records ``(name, grid)``
    and runs nothing; returns the record list. Lets a CPU test check the grids a huge problem would launch
    without executing it."""
    import importlib

    grids: list[tuple[str, tuple[int, ...]]] = []

    class _Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            grids.append((self.name, tuple(grid)))
            return lambda *args, **kwargs: None

    for mod_name in ("sparse_mla.mqa.triton_tl", "sparse_mla.mqa.gluon_sm90.launcher", "sparse_mla.union.planning",
                     "sparse_mla.union.triton_tl", "sparse_mla.union.probe", "sparse_mla.kv_staging"):
        mod = importlib.import_module(mod_name)
        for name in [n for n in vars(mod) if n.endswith("_kernel") and not n.startswith("__")]:
            monkeypatch.setattr(mod, name, _Stub(name))
    # the CUDA union builder (CuPy): recorded too, never launched on the stubs' unwritten buffers
    cuda_smem = importlib.import_module("sparse_mla.union.cuda_smem")

    def _union(indices, topk_length, num_kv_rows, group_size, group_start, *args, **kwargs):
        grids.append(("sparse_mla_union_smem", (group_start.shape[0], )))

    monkeypatch.setattr(cuda_smem, "build_union", _union)
    # stubs are no kernels: warm calls must run the full path (sparse_mla.call_cache), so that every grid is seen
    from sparse_mla import call_cache

    monkeypatch.setattr(call_cache, "ENABLED", False)
    return grids


def assert_grids_within_cuda_limits(grids) -> None:
    assert grids, "no kernel was launched"
    for name, grid in grids:
        for dim, (n, limit) in enumerate(zip(grid, CUDA_GRID_LIMITS)):
            assert 1 <= n <= limit, f"{name}: grid dim {dim} = {n} outside [1, {limit}] (CUDA launch fails)"

