"""Warm calls replay the launches of the first: the host path of a repeated call.

A call of ``sparse_mla_fwd`` or ``flash_mla_sparse_fwd`` whose arguments have the same metadata as an earlier call's
(every tensor's shape, strides, dtype, device and 16-byte alignment; every other argument's value; the workspace
object; the current CUDA device; the package's environment switches; the default workspaces' generation) takes the
same decisions and makes the same launches: the package decides from metadata only and never reads device data
unless ``check=True`` (docs/DESIGN.md "Host path"). Only the tensors' addresses differ. So the first call of each
such key runs the full path (validation, selection, planning) under a recorder, and later calls replay what it
recorded: the allocations of its outputs, then each launch with its pointer arguments rebased onto this call's
tensors. A warm call then costs its key, an overlap check of the written tensors against the others, and the
launches (docs/notes/default-call.md, results/host-profile.json).

What a recording holds is checked when it is made; a call that cannot be replayed exactly is never replayed:

* every torch operation the call runs is seen (a ``TorchDispatchMode``): views and ``empty`` allocations are
  replayed, anything else (a copy, a fill, a read of device data) makes the call not replayable;
* every Triton launch of the recording thread is counted (a launch-enter hook, which ``LaunchCache`` does not take
  for a profiler's) and must have been reported by ``LaunchCache``; the CUDA union builder reports its CuPy launches;
* each pointer argument is attributed to one of the call's tensors (an offset into it), to one of its allocations,
  or to a tensor that outlives the call (a workspace buffer or placeholder, in no call tensor's storage; the plan
  keeps a reference); a call whose tensors share memory is not recorded (the key does not say how they alias);
* the result is the call's own tensors or its allocations.

A workspace argument is keyed by a token of its object; when the object is freed, its plans (which hold its
buffers) are dropped. At most ``MAX_PLANS`` keys per function are kept, the oldest dropped first.

A call is recorded again on its next call when a recording fails (a first call that creates lazily allocated state),
and never after ``MAX_ATTEMPTS`` failures. Off (the full path runs every time): ``ENABLED = False``, under
TRITON_INTERPRET=1, while a Triton launch hook is installed (profilers), with debug logging of the ``sparse_mla``
logger on, with ``launch_cache.ENABLED`` false, and for arguments it cannot key (tensor subclasses but
``nn.Parameter``, non-strided tensors, unhashable values). A program that changes a module-level rule at run time
(``sparse_mla.mqa.selection.GROUPING_RULES``, a backend's table) calls ``invalidate()`` after it. ``CHECKED`` (the
GPU tests set it): every replay first re-runs the full path without launching and raises if its launches differ from
the plan's.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import checks, env, launch_cache

ENABLED = True
CHECKED = False
MAX_ATTEMPTS = 2  # failed recordings of one key before it always runs the full path
MAX_PLANS = 1024  # plans per function; the oldest is dropped past it

logger = logging.getLogger("sparse_mla")

_ENV_NAMES = tuple(sorted({s.name for s in env.SWITCHES} | {"TRITON_INTERPRET"}))


@dataclass
class _Failed:
    """A key whose recordings failed ``count`` times, the last for ``reason``."""

    count: int
    reason: str
_GENERATION = [0]  # bumped by ``invalidate``; part of every key


class _Unkeyable(Exception):
    pass


_TOKENS = itertools.count(1)


def _workspace_token(ws) -> int:
    """A key for a workspace object: a number never reused; when the object is freed, every plan keyed by it is
    dropped (the plans hold its buffers, so they would keep its memory alive)."""
    tok = ws.__dict__.get("_replay_token")
    if tok is None:
        tok = ws.__dict__["_replay_token"] = next(_TOKENS)
        weakref.finalize(ws, _drop_token, tok)
    return tok


def _drop_token(tok: int) -> None:
    mark = ("workspace", tok)
    for plans in _ALL_PLANS:
        for key in [k for k in plans if any(p == mark or type(p) is tuple and p[-1:] == (mark, ) for p in k[0])]:
            del plans[key]


def generation() -> int:
    """Bumped by every ``invalidate()``: a cache of a choice that a rule change can alter keys on it too."""
    return _GENERATION[0]


def invalidate() -> None:
    """Forget every plan (a default workspace was replaced or freed: plans hold its buffers)."""
    _GENERATION[0] += 1
    for plans in _ALL_PLANS:
        plans.clear()


_ALL_PLANS: list[dict] = []


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _meta(x):
    if type(x) in _TENSOR_TYPES:
        if x.layout is not torch.strided:
            raise _Unkeyable(f"a {x.layout} tensor")
        return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0)
    if x is None or type(x) in (str, float):
        return x
    if type(x) in (int, bool):
        return (type(x), x)
    if getattr(x, "replay_by_identity", False):  # a SparseMLAWorkspace: its token (plans drop when it is freed)
        return ("workspace", _workspace_token(x))
    if type(x) is torch.device or type(x) is torch.dtype:
        return x
    raise _Unkeyable(type(x).__name__)


_ENV_BYTES = tuple(n.encode() for n in _ENV_NAMES)


def _env_values() -> tuple:
    """The package's environment switches as set now (a plain dict read: this runs on every call)."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict) and os.name == "posix":
        return tuple(map(data.get, _ENV_BYTES))
    return tuple(map(os.environ.get, _ENV_NAMES))


def _replayable_device(t: torch.Tensor) -> bool:
    """Calls on CUDA tensors are recorded (their launches are compiled kernels; the CPU's are interpreted)."""
    return t.is_cuda


def _extent(t: torch.Tensor) -> int:
    """Bytes from t.data_ptr() to one past its last element (0 for an empty tensor)."""
    _, first, end = checks._byte_span(t)
    return end - first


def _active() -> bool:
    """Whether replay may run now (module docstring's "Off" list, but the interpreter, which keys by the env)."""
    if not ENABLED or not launch_cache.ENABLED or logger.isEnabledFor(logging.DEBUG):
        return False
    rt = _triton_runtime_knobs()
    return not (launch_cache._hooked(rt.launch_enter_hook) or launch_cache._hooked(rt.launch_exit_hook))


@functools.cache
def _triton_runtime_knobs():
    """``triton.knobs.runtime`` (imported once: ``_active`` runs on every call)."""
    from triton import knobs

    return knobs.runtime


# --- recording -----------------------------------------------------------------------------------------------------


class _Recorder:
    """What one call did: launches (with their tensors), allocations, and why it cannot be replayed (or None)."""

    def __init__(self, dry: bool):
        self.thread = threading.get_ident()
        self.dry = dry
        self.launches: list = []
        self.temps: list = []  # (func, args, kwargs, tensor)
        self.reason: str | None = None
        self.triton_reported = 0
        self.triton_seen = 0

    def fail(self, why: str) -> None:
        if self.reason is None:
            self.reason = why

    def triton(self, fn, kernel, grid, args) -> None:
        self.triton_reported += 1
        if not self.dry and (kernel is None or not hasattr(kernel, "run")):
            self.fail(f"{getattr(fn, '__name__', fn)}: no compiled kernel to replay")
        self.launches.append(("triton", fn, kernel, grid, args))

    def cupy(self, replay, kern, device_index, grid, block, smem, args, pointer_tensors) -> None:
        """A CuPy launch; ``replay(kern, device_index, grid, block, smem, args, stream_ptr)`` makes it again."""
        self.launches.append(("cupy", replay, kern, device_index, grid, block, smem, args, pointer_tensors))

    def seen(self, *_):  # Triton launch-enter hook: every launch of this thread, reported or not
        if threading.get_ident() == self.thread:
            self.triton_seen += 1


class _OpWatch(TorchDispatchMode):
    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS:  # replayed as empty_strided of the same metadata (no reference to the args)
            self.rec.temps.append((_EMPTY_STRIDED, (tuple(out.shape), out.stride()),
                                   {"dtype": out.dtype, "device": out.device}, out))
        elif not func.is_view:
            self.rec.fail(f"runs {func}")
        return out


_EMPTY_STRIDED = torch.empty_strided
_ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default)


def _run_recorded(fn, args, kwargs, dry: bool):
    """(result, recorder) of fn(*args, **kwargs) run under a recorder (``dry``: launches are reported, not made)."""
    from triton import knobs

    rec = _Recorder(dry)
    chain = knobs.runtime.launch_enter_hook
    hooked = hasattr(chain, "add")
    launch_cache.set_recorder(rec)
    if hooked:
        chain.add(rec.seen)
        launch_cache.ignore_hook(rec.seen)
    else:
        rec.fail("this Triton's launch hooks cannot be chained")
    try:
        with _OpWatch(rec):
            result = fn(*args, **kwargs)
    finally:
        launch_cache.set_recorder(None)
        if hooked:
            chain.remove(rec.seen)
            launch_cache.unignore_hook(rec.seen)
    if not dry and rec.triton_seen != rec.triton_reported:
        rec.fail(f"{rec.triton_seen - rec.triton_reported} Triton launches not made through LaunchCache")
    return result, rec


# --- plans ---------------------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    extents: list  # bytes of each of the call's tensors
    written: list  # indices (into the call's tensors) of the ones the call writes
    temps: list  # (func, args, kwargs) allocations, in order
    launches: list  # _TritonLaunch / _CupyLaunch
    result: object  # structure: ("in", i) | ("tmp", i) | ("none", ) | ("tuple", [...])
    signature: list  # what CHECKED compares
    keep: list = field(default_factory=list)  # tensors that must outlive the plan (workspace buffers, ...)

    def overlaps(self, ptrs: list) -> bool:
        for w in self.written:
            pw, ew = ptrs[w], self.extents[w]
            if ew == 0:
                continue
            for i, (p, e) in enumerate(zip(ptrs, self.extents)):
                if i != w and e and pw < p + e and p < pw + ew:
                    return True
        return False


class _TritonLaunch:
    __slots__ = ("kernel", "grid", "template", "slots", "device")

    def __init__(self, kernel, grid, template, slots, device):
        self.kernel, self.grid, self.template, self.slots, self.device = kernel, grid, template, slots, device

    def __call__(self, ptrs, tptrs, drv) -> None:
        a = list(self.template)
        for pos, src, i, off in self.slots:
            a[pos] = (ptrs if src == 0 else tptrs)[i] + off
        k = self.kernel
        g = self.grid
        k.run(g[0], g[1], g[2], drv.get_current_stream(self.device), k.function, k.packed_metadata, None, None, None,
              *a)


class _CupyLaunch:
    __slots__ = ("replay", "kern", "device_index", "grid", "block", "smem", "template", "slots")

    def __init__(self, replay, kern, device_index, grid, block, smem, template, slots):
        self.replay, self.kern, self.device_index, self.grid, self.block = replay, kern, device_index, grid, block
        self.smem, self.template, self.slots = smem, template, slots

    def __call__(self, ptrs, tptrs, drv) -> None:
        a = list(self.template)
        for pos, src, i, off in self.slots:
            a[pos] = np.uint64((ptrs if src == 0 else tptrs)[i] + off)
        self.replay(self.kern, self.device_index, self.grid, self.block, self.smem, tuple(a),
                    drv.get_current_stream(self.device_index))


class _Attribution:
    """Maps a pointer argument of a recorded launch to (source, index, offset): source 0 = the call's tensor
    ``index``, 1 = its allocation ``index``, 2 = a tensor outliving the call (offset = the address itself)."""

    def __init__(self, tensors: list, rec: _Recorder):
        self.inputs = [(t, t.data_ptr(), _extent(t)) for t in tensors]
        self.temps = [(t, t.data_ptr(), _extent(t)) for (_, _, _, t) in rec.temps]
        self.keep: list = []
        spans = sorted((base, base + ext) for _, base, ext in self.inputs if ext)
        if any(lo < prev_hi for (_, prev_hi), (lo, _) in zip(spans, spans[1:])):
            # which argument a pointer belongs to would depend on how the arguments alias: not in the key
            raise _Unkeyable("two of the call's tensors share memory")
        self.storages = {u.untyped_storage().data_ptr() for u, _, _ in self.inputs + self.temps}

    def __call__(self, t: torch.Tensor):
        p = t.data_ptr()
        for src, pool in ((1, self.temps), (0, self.inputs)):
            for i, (u, base, _) in enumerate(pool):
                if u is t:
                    return src, i, p - base
        for src, pool in ((1, self.temps), (0, self.inputs)):
            for i, (_, base, ext) in enumerate(pool):
                if base <= p < base + ext:
                    return src, i, p - base
        if t.untyped_storage().data_ptr() in self.storages:
            raise _Unkeyable(f"a pointer ({p:#x}) into a call tensor's storage outside its elements")
        self.keep.append(t)  # a buffer that outlives the call (a workspace's, a placeholder)
        return 2, 0, p


def _plan_from(rec: _Recorder, tensors: list, written: list, result) -> _Plan:
    at = _Attribution(tensors, rec)
    launches, signature = [], []
    for entry in rec.launches:
        if entry[0] == "triton":
            _, fn, kernel, grid, args = entry
            template, slots, sig = list(args), [], []
            for pos, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    src, i, off = at(a)
                    template[pos] = off if src == 2 else 0
                    if src != 2:
                        slots.append((pos, src, i, off))
                    sig.append((src, i, off))
                elif a is None or type(a) in (int, float, bool):
                    sig.append(a)
                else:  # a descriptor or other object may hold an address of this call
                    raise _Unkeyable(f"a launch argument of type {type(a).__name__}")
            dev = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
            launches.append(_TritonLaunch(kernel, grid, tuple(template), tuple(slots), dev))
            signature.append(("triton", id(fn), grid, tuple(sig)))
        else:
            _, replay, kern, idx, grid, block, smem, args, pointer_tensors = entry
            template, slots, sig = list(args), [], []
            for pos, t in enumerate(pointer_tensors):
                if t is None:
                    sig.append(None)
                    continue
                src, i, off = at(t)
                if src != 2:
                    slots.append((pos, src, i, off))
                sig.append((src, i, off))
            sig.extend(args[len(pointer_tensors):])
            launches.append(_CupyLaunch(replay, kern, idx, grid, block, smem, tuple(template), tuple(slots)))
            signature.append(("cupy", id(kern), grid, block, smem, tuple(sig)))
    return _Plan([_extent(t) for t in tensors], written, [(f, a, k) for (f, a, k, _) in rec.temps], launches,
                 _structure(result, tensors, rec), signature, at.keep)


def _structure(result, tensors, rec):
    if result is None:
        return ("none", )
    if isinstance(result, tuple):
        return ("tuple", [_structure(r, tensors, rec) for r in result])
    if isinstance(result, torch.Tensor):
        for i, t in enumerate(tensors):
            if t is result:
                return ("in", i)
        for i, (_, _, _, t) in enumerate(rec.temps):
            if t is result:
                return ("tmp", i)
        for i, (_, _, _, t) in enumerate(rec.temps):  # the allocation itself (the mode's object may be another)
            if _same_view(t, result):
                return ("tmp", i)
    raise _Unkeyable(f"returns {type(result).__name__} that is neither an argument nor an allocation")


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device)


def _rebuild(struct, tensors, temps):
    kind = struct[0]
    if kind == "in":
        return tensors[struct[1]]
    if kind == "tmp":
        return temps[struct[1]]
    if kind == "none":
        return None
    return tuple(_rebuild(s, tensors, temps) for s in struct[1])


def _signature_of(rec: _Recorder, tensors: list) -> list:
    """The signature a dry re-recording gives (CHECKED)."""
    return _plan_from(rec, tensors, [], None).signature


# --- the decorator -------------------------------------------------------------------------------------------------


def replayed(written: tuple[str, ...] = ()):
    """Decorate a public function so that its warm calls replay (module docstring). ``written``: the keyword
    arguments the function writes (out=, lse=, ...); a replay whose written tensors overlap another argument runs
    the full path (which raises the function's own error)."""

    def deco(fn):
        plans: dict = {}
        _ALL_PLANS.append(plans)
        names = frozenset(written)
        params = list(inspect.signature(fn).parameters.values())
        written_pos = frozenset(i for i, prm in enumerate(params) if prm.name in names
                                and prm.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if launch_cache.recorder() is not None or not _active():
                return fn(*args, **kwargs)
            tensors: list = []
            written_idx: list = []
            try:
                parts = []
                for i, a in enumerate(args):
                    parts.append(_meta(a))
                    if type(a) in _TENSOR_TYPES:
                        if i in written_pos:
                            written_idx.append(len(tensors))
                        tensors.append(a)
                for k, v in kwargs.items():
                    parts.append((k, _meta(v)))
                    if type(v) in _TENSOR_TYPES:
                        if k in names:
                            written_idx.append(len(tensors))
                        tensors.append(v)
                key = (tuple(parts), _env_values(), _GENERATION[0],
                       torch._C._cuda_getDevice() if torch.cuda.is_initialized() else -1)
            except _Unkeyable:
                return fn(*args, **kwargs)
            plan = plans.get(key)
            if type(plan) is _Failed and plan.count >= MAX_ATTEMPTS:
                return fn(*args, **kwargs)
            if isinstance(plan, _Plan):
                ptrs = [t.data_ptr() for t in tensors]
                if plan.overlaps(ptrs):
                    return fn(*args, **kwargs)
                if CHECKED:
                    _check(plan, fn, args, kwargs, tensors)
                return _replay(plan, tensors, ptrs)
            if env.interpreted() or not tensors or not _replayable_device(tensors[0]):
                return fn(*args, **kwargs)
            result, rec = _run_recorded(fn, args, kwargs, dry=False)
            try:
                if rec.reason is not None:
                    raise _Unkeyable(rec.reason)
                new = _plan_from(rec, tensors, written_idx, result)
            except _Unkeyable as exc:
                new = _Failed((plan.count if plan is not None else 0) + 1, str(exc))
            if len(plans) >= MAX_PLANS and key not in plans:
                plans.pop(next(iter(plans)))
            plans[key] = new
            return result

        wrapper.plans = plans
        return wrapper

    return deco


def _driver():
    """Triton's active driver (its current-stream query is the launches' stream)."""
    from triton.runtime import driver

    return driver.active


def _replay(plan: _Plan, tensors: list, ptrs: list):
    temps = [f(*a, **k) for f, a, k in plan.temps]
    tptrs = [t.data_ptr() for t in temps]
    drv = _driver()
    for launch in plan.launches:
        launch(ptrs, tptrs, drv)
    return _rebuild(plan.result, tensors, temps)


def _check(plan: _Plan, fn, args, kwargs, tensors) -> None:
    _, rec = _run_recorded(fn, args, kwargs, dry=True)
    sig = _signature_of(rec, tensors)
    if rec.reason is not None or sig != plan.signature:
        raise RuntimeError(f"call_cache: {fn.__name__}'s replay differs from its full path "
                           f"({rec.reason or 'launches differ'}):\nplan {plan.signature}\nfull {sig}")


def status(fn) -> dict:
    """What ``fn`` (a ``replayed`` function) holds: {"replayed": keys with a plan, "not_replayable": the reasons of
    the keys whose recordings failed ``MAX_ATTEMPTS`` times (the full path runs for them), "retrying": the reasons of
    those that failed fewer times (a first call that allocated lasting state records again on its next call)}."""
    plans = fn.plans.values()
    failed = [p for p in plans if isinstance(p, _Failed)]
    return {"replayed": sum(isinstance(p, _Plan) for p in plans),
            "not_replayable": [p.reason for p in failed if p.count >= MAX_ATTEMPTS],
            "retrying": [p.reason for p in failed if p.count < MAX_ATTEMPTS]}


__all__ = ["ENABLED", "CHECKED", "MAX_ATTEMPTS", "replayed", "invalidate", "generation", "status"]
