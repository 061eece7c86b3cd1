"""sparse_mla.call_cache on the CPU: recording, attribution of pointers, replay, and every reason not to replay,
with a stand-in kernel (an object with Triton's ``fn[grid](...)`` / ``CompiledKernel.run`` shape). The real
kernels' replays are held to their full paths on the GPU (tests/mqa/test_host_path.py, and CHECKED in every GPU
test: tests/conftest.py)."""

import pytest
import torch
from triton import knobs

from sparse_mla import call_cache, launch_cache
from sparse_mla.launch_cache import LaunchCache


class FakeCompiled:
    """A compiled kernel: ``run`` records its pointer / scalar arguments (ints, as the replay passes them)."""

    def __init__(self, log):
        self.log = log
        self.function = "f"
        self.packed_metadata = "m"

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        self.log.append(("run", (g0, g1, g2), tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)))


class FakeJit:
    """``fn[grid](*args, **constexprs)``: a JIT launch (fires Triton's launch-enter hook, as the JIT does) that
    returns its compiled kernel."""

    arg_names = ("X", "Y", "n", "BLOCK")
    __name__ = "fake_kernel"

    def __init__(self):
        self.log = []
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            knobs.runtime.launch_enter_hook(None)
            vals = list(args) + [kw[n] for n in self.arg_names[len(args):]]
            self.log.append(("jit", tuple(grid) + (1, 1)[:3 - len(grid)],
                             tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in vals)))
            return self.compiled
        return launch


class FakeDriver:
    def get_current_stream(self, device):
        return 0


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(call_cache, "_replayable_device", lambda t: True)
    monkeypatch.setattr(call_cache, "_driver", lambda: FakeDriver())
    monkeypatch.setattr(call_cache.env, "interpreted", lambda: False)
    monkeypatch.setattr(launch_cache, "interpreted", lambda: True)  # unrecorded launches: the JIT (no driver here)
    return FakeJit()


CONSTANT = torch.zeros(8)  # a buffer outliving every call (a workspace's, say)


def make_op(kernel, *, extra_op=False, unreported=False):
    lc = LaunchCache(kernel)

    @call_cache.replayed(written=("out", ))
    def op(x, scale, *, out=None):
        if x.dim() != 2:
            raise ValueError("x must be 2-D")
        if out is None:
            out = torch.empty(x.shape[0], 4)
        if extra_op:
            out.fill_(0)
        if unreported:
            knobs.runtime.launch_enter_hook(None)
        lc(("v", ), (x.shape[0], ), (x[1:], out, x.shape[0] * scale), dict(BLOCK=4))
        lc(("w", ), (1, ), (CONSTANT, out, 3), dict(BLOCK=8))
        return out
    return op


def runs(kernel):
    return [e[0] for e in kernel.log]


def test_second_call_replays_with_this_calls_addresses(fake):
    op = make_op(fake)
    op(torch.randn(6, 4), 2)
    assert runs(fake) == ["jit", "jit"]
    fake.log.clear()
    x = torch.randn(6, 4)
    y = op(x, 2)
    assert runs(fake) == ["run", "run"], "the warm call replays the compiled kernels"
    (_, g0, a0), (_, g1, a1) = fake.log
    assert g0 == (6, 1, 1) and a0 == (x.data_ptr() + 4 * x.stride(0), y.data_ptr(), 12, 4)
    assert g1 == (1, 1, 1) and a1 == (CONSTANT.data_ptr(), y.data_ptr(), 3, 8)
    assert y.shape == (6, 4) and y.dtype == torch.float32
    out = torch.empty(6, 4)
    fake.log.clear()
    op(x, 2, out=out)  # another key (out given): recorded, then replayed with the given out
    op(x, 2, out=out)
    assert runs(fake) == ["jit", "jit", "run", "run"] and fake.log[-1][2][1] == out.data_ptr()
    assert op(x, 2, out=out) is out


def test_other_metadata_or_values_record_again(fake):
    op = make_op(fake)
    op(torch.randn(6, 4), 2)
    for x, s in ((torch.randn(7, 4), 2), (torch.randn(6, 4), 3), (torch.randn(6, 4).to(torch.float64), 2),
                 (torch.randn(4, 6).t(), 2)):
        fake.log.clear()
        op(x, s)
        assert runs(fake) == ["jit", "jit"], (x.shape, x.stride(), s)
    assert len(op.plans) == 5


def test_a_torch_op_in_the_call_is_never_replayed(fake):
    op = make_op(fake, extra_op=True)
    for _ in range(call_cache.MAX_ATTEMPTS + 2):
        op(torch.randn(6, 4), 2)
    assert runs(fake) == ["jit"] * 2 * (call_cache.MAX_ATTEMPTS + 2)
    st = call_cache.status(op)
    assert st["replayed"] == 0 and len(st["not_replayable"]) == 1 and "fill_" in st["not_replayable"][0]


def test_a_launch_outside_launch_cache_is_never_replayed(fake):
    op = make_op(fake, unreported=True)
    for _ in range(3):
        op(torch.randn(6, 4), 2)
    assert runs(fake) == ["jit"] * 6
    assert "not made through LaunchCache" in call_cache.status(op)["not_replayable"][0]


def test_overlapping_output_runs_the_full_path(fake):
    op = make_op(fake)
    buf = torch.randn(12, 4)
    op(buf[:6], 2, out=torch.empty(6, 4))
    fake.log.clear()
    op(buf[:6], 2, out=buf[6:])  # same metadata, disjoint: replayed
    assert runs(fake) == ["run", "run"]
    fake.log.clear()
    op(buf[:6], 2, out=buf[3:9])  # overlaps x: the full path (which would raise the op's own error)
    assert runs(fake) == ["jit", "jit"]


def test_errors_are_raised_by_the_full_path_and_leave_no_plan(fake):
    op = make_op(fake)
    with pytest.raises(ValueError, match="x must be 2-D"):
        op(torch.randn(6), 2)
    with pytest.raises(ValueError, match="x must be 2-D"):
        op(torch.randn(6), 2)
    assert op.plans == {}


def test_unkeyable_arguments_and_inactive_states_run_the_full_path(fake, monkeypatch):
    op = make_op(fake)
    x = torch.randn(6, 4)
    op(x, [2])  # a list: not keyed
    with pytest.raises(NotImplementedError):
        op(x.to_sparse(), 2)  # a sparse tensor: not keyed (the full path raises its own error)
    assert op.plans == {}
    op(x, 2)
    fake.log.clear()
    for flag in (call_cache, launch_cache):
        monkeypatch.setattr(flag, "ENABLED", False)
        op(x, 2)
        monkeypatch.setattr(flag, "ENABLED", True)
    knobs.runtime.launch_enter_hook.add(print)  # a profiler's hook
    try:
        op(x, 2)
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    assert runs(fake) == ["jit"] * 6
    fake.log.clear()
    op(x, 2)
    assert runs(fake) == ["run", "run"]


def test_environment_switches_and_invalidate_change_the_key(fake, monkeypatch):
    op = make_op(fake)
    x = torch.randn(6, 4)
    op(x, 2)
    monkeypatch.setenv("SPARSE_MLA_MQA_BACKEND", "triton")
    fake.log.clear()
    op(x, 2)
    assert runs(fake) == ["jit", "jit"]
    call_cache.invalidate()
    assert op.plans == {}


def test_checked_mode_raises_when_the_full_path_would_launch_otherwise(fake, monkeypatch):
    state = {"n": 3}
    lc = LaunchCache(fake)

    @call_cache.replayed()
    def op(x):
        out = torch.empty(2)
        lc(("v", ), (1, ), (x, out, state["n"]), dict(BLOCK=4))
        return out

    x = torch.randn(4)
    op(x)
    monkeypatch.setattr(call_cache, "CHECKED", True)
    fake.log.clear()
    op(x)
    assert runs(fake) == ["run"], "a dry re-run launches nothing"
    state["n"] = 5
    with pytest.raises(RuntimeError, match="differs from its full path"):
        op(x)


def test_nested_replayed_calls_record_into_the_outer_one(fake):
    inner = make_op(fake)

    @call_cache.replayed()
    def outer(x):
        return inner(x, 2)

    outer(torch.randn(6, 4))
    assert inner.plans == {} and len(outer.plans) == 1
    fake.log.clear()
    outer(torch.randn(6, 4))
    assert runs(fake) == ["run", "run"]


def test_parameters_are_keyed_like_tensors(fake):
    op = make_op(fake)
    op(torch.randn(6, 4), 2)
    fake.log.clear()
    op(torch.nn.Parameter(torch.randn(6, 4)), 2)
    assert runs(fake) == ["run", "run"]


def test_a_written_argument_passed_by_position_is_checked_for_overlap(fake):
    lc = LaunchCache(fake)

    @call_cache.replayed(written=("out", ))
    def op(x, out):
        lc(("v", ), (1, ), (x, out, 1), dict(BLOCK=4))
        return out

    buf = torch.randn(12, 4)
    op(buf[:6], torch.empty(6, 4))
    fake.log.clear()
    op(buf[:6], buf[6:])
    assert runs(fake) == ["run"]
    fake.log.clear()
    op(buf[:6], buf[3:9])  # out overlaps x: the full path
    assert runs(fake) == ["jit"]


def test_arguments_sharing_memory_are_not_recorded(fake):
    lc = LaunchCache(fake)

    @call_cache.replayed()
    def op(a, b):
        out = torch.empty(2)
        lc(("v", ), (1, ), (a, b, 1), dict(BLOCK=4))
        return out

    x = torch.randn(8)
    for _ in range(3):
        op(x, x)  # which argument a pointer belongs to would depend on the aliasing
    assert runs(fake) == ["jit"] * 3
    assert "share memory" in call_cache.status(op)["not_replayable"][0]


class Workspace:
    replay_by_identity = True

    def __init__(self):
        self.buf = torch.zeros(16)


def test_plans_of_a_freed_workspace_are_dropped(fake):
    import gc

    lc = LaunchCache(fake)

    @call_cache.replayed()
    def op(x, workspace):
        out = torch.empty(2)
        lc(("v", ), (1, ), (x, workspace.buf, out, 1), dict(BLOCK=4))
        return out

    ws = Workspace()
    x = torch.randn(8)
    op(x, ws)
    fake.log.clear()
    op(x, ws)
    assert runs(fake) == ["run"] and fake.log[0][2][1] == ws.buf.data_ptr()
    other = Workspace()
    fake.log.clear()
    op(x, other)  # another workspace object: another key, its own buffer
    op(x, other)
    assert runs(fake) == ["jit", "run"] and fake.log[1][2][1] == other.buf.data_ptr()
    assert len(op.plans) == 2
    del ws
    gc.collect()
    assert len(op.plans) == 1, "the freed workspace's plan (holding its buffers) is gone"
