"""``sparse_mla.launch_cache.LaunchCache`` as plain Python (a stand-in kernel records what it is given): the first
launch of a key goes through the kernel's ``[grid]`` call, later ones call the kept compiled kernel's launcher with
every parameter in order (options that are also parameters included), the key covers the caller's alignment
arguments and the kernel object, and the JIT path runs when disabled or hooked. GPU equality with Triton's own
launches: tests/mqa/test_host_path.py."""

from __future__ import annotations

import types

import pytest

from sparse_mla import launch_cache


class _Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    @property
    def run(self):
        return lambda *a: self.log.append(("direct", a))


class _Kernel:
    arg_names = ["x", "n", "BLOCK", "num_warps"]

    def __init__(self, log):
        self.log, self.compiled = log, _Compiled(log)

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return self.compiled
        return call


class _Ptr:
    def __init__(self, p):
        self.p = p

    def data_ptr(self):
        return self.p


@pytest.fixture
def direct(monkeypatch):
    """Pretend the launch is on a CUDA device outside the interpreter."""
    drv = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda dev: 123)
    import triton.runtime

    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=drv))
    monkeypatch.setattr(launch_cache, "interpreted", lambda: False)


def test_first_launch_jit_then_direct(direct):
    log = []
    k = _Kernel(log)
    lc = launch_cache.LaunchCache(k, align=(0, ))
    x = _Ptr(256)
    for _ in range(2):
        lc(("v", 4), (3, ), (x, 7), {"BLOCK": 64}, {"num_warps": 4})
    assert log[0] == ("jit", (3, ), (x, 7), {"BLOCK": 64, "num_warps": 4})
    assert log[1] == ("direct", (3, 1, 1, 123, "fn", "meta", None, None, None, x, 7, 64, 4))
    lc(("v", 4), (3, ), (_Ptr(8), 7), {"BLOCK": 64}, {"num_warps": 4})  # misaligned pointer: another variant
    assert log[2][0] == "jit"


def test_disabled_hooked_or_checked_go_through_the_jit(direct, monkeypatch):
    log = []
    lc = launch_cache.LaunchCache(_Kernel(log))
    monkeypatch.setattr(launch_cache, "ENABLED", False)
    lc(("v", ), (1, ), (_Ptr(0), 1), {"BLOCK": 1}, {"num_warps": 1})
    lc(("v", ), (1, ), (_Ptr(0), 1), {"BLOCK": 1}, {"num_warps": 1})
    assert [e[0] for e in log] == ["jit", "jit"]
    monkeypatch.setattr(launch_cache, "ENABLED", True)
    monkeypatch.setattr(launch_cache, "CHECKED", True)
    for _ in range(2):
        lc(("v", ), (1, ), (_Ptr(0), 1), {"BLOCK": 1}, {"num_warps": 1})
    assert [e[0] for e in log] == ["jit"] * 4
    assert not launch_cache._hooked(None) and not launch_cache._hooked(types.SimpleNamespace(calls=[]))
    assert launch_cache._hooked(types.SimpleNamespace(calls=[print])) and launch_cache._hooked(print)


def test_checked_mode_catches_a_key_that_names_two_variants(direct, monkeypatch):
    log = []
    k = _Kernel(log)
    lc = launch_cache.LaunchCache(k)
    lc(("v", ), (1, ), (_Ptr(0), 1), {"BLOCK": 1}, {"num_warps": 1})
    k.compiled = _Compiled(log)  # the JIT now returns another compiled kernel for the same key
    monkeypatch.setattr(launch_cache, "CHECKED", True)
    with pytest.raises(RuntimeError, match="names two compiled variants"):
        lc(("v", ), (1, ), (_Ptr(0), 1), {"BLOCK": 2}, {"num_warps": 1})


def test_module_global_is_looked_up_at_each_launch(direct):
    log_a, log_b = [], []
    ns = {"k": _Kernel(log_a)}
    lc = launch_cache.LaunchCache(namespace=ns, name="k")
    lc(("v", ), (1, ), (_Ptr(0), 1), {"BLOCK": 1}, {"num_warps": 1})
    ns["k"] = _Kernel(log_b)  # a test's stand-in replaces the global: its own first launch goes through it
    lc(("v", ), (1, ), (_Ptr(0), 1), {"BLOCK": 1}, {"num_warps": 1})
    assert [e[0] for e in log_a] == ["jit"] and [e[0] for e in log_b] == ["jit"]


def test_wide_integers_join_the_key(direct):
    """An integer that passes int32 (Triton types it int64) is another variant: the JIT runs again for it."""
    log = []
    lc = launch_cache.LaunchCache(_Kernel(log), wide=(1, ))
    for n in (7, 7, 2**31, 2**31):
        lc(("v", ), (1, ), (_Ptr(0), n), {"BLOCK": 1}, {"num_warps": 1})
    assert [e[0] for e in log] == ["jit", "direct", "jit", "direct"]
