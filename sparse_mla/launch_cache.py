"""Kernel launches with less host work: Triton's JIT once per variant, its compiled launcher after that.

A Triton / Gluon launch through ``kernel[grid](*args)`` binds and specializes every argument, hashes a cache key
and checks the kernel's globals before it calls the compiled launcher; for the 33-argument Gluon kernel that is most
of a short call's host time (docs/notes/default-call.md). ``LaunchCache`` keeps the ``CompiledKernel`` of each variant
the first launch produced (through the JIT, so compilation, specialization and errors are Triton's own) under a key
the caller computes, and later launches of the same key call ``CompiledKernel.run`` directly.

The key is the caller's contract: it must determine Triton's specialization of the arguments (argument dtypes,
constexprs, launch options, and whatever alignment / value properties of the non-``do_not_specialize`` arguments
can vary between the caller's launches); ``CHECKED`` (tests) re-derives Triton's own cache key on every launch and
raises on a mismatch. The direct path is skipped (the JIT runs) under TRITON_INTERPRET=1, when a Triton launch hook
is installed (profilers), and when ``ENABLED`` is false.
"""

from __future__ import annotations

import threading

from .env import interpreted

ENABLED = True  # False: every launch goes through the JIT (A/B of the host path)
CHECKED = False  # tests: verify on every launch that the key names the variant Triton would launch

_STATE = threading.local()


def recorder():
    """The launch recorder of the call being recorded on this thread (``sparse_mla.call_cache``), or None.
    ``LaunchCache`` and the CUDA union builder report their launches to it; with ``recorder().dry`` they report
    without launching."""
    return getattr(_STATE, "recorder", None)


def set_recorder(rec) -> None:
    _STATE.recorder = rec


_IGNORED_HOOKS: list = []  # the launch counters of calls being recorded (sparse_mla.call_cache): not profilers


def ignore_hook(fn) -> None:
    _IGNORED_HOOKS.append(fn)


def unignore_hook(fn) -> None:
    _IGNORED_HOOKS.remove(fn)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is installed: None or a ``HookChain`` (Triton 3.6) holding nothing but recorders'
    launch counters means none."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    if calls is None:
        return True
    return any(c not in _IGNORED_HOOKS for c in calls)


class LaunchCache:
    """Launches of one ``@triton.jit`` / ``@gluon.jit`` kernel, cached by a caller-supplied variant key."""

    def __init__(self, fn=None, align: tuple[int, ...] = (), *, wide: tuple[int, ...] = (), namespace: dict | None = None,
                 name: str = ""):
        """The kernel ``fn``, or the module global ``namespace[name]`` looked up at every launch (so that a test that
        replaces the global is obeyed). ``align``: positions of pointer arguments whose 16-byte alignment Triton
        specializes on and the caller's key does not fix; their alignment joins the key on every launch. ``wide``:
        positions of integer arguments that may pass 2**31 - 1 (Triton types them int64 then); whether they do
        joins the key."""
        self._fn = fn
        self._namespace = namespace
        self._name = name
        self.align = align
        self.wide = wide
        self._kernels: dict = {}
        self._trailing = None  # names of the parameters after the positional ones, in order (set on first use)

    @property
    def fn(self):
        return self._namespace[self._name] if self._namespace is not None else self._fn

    def __call__(self, key, grid: tuple[int, ...], args: tuple, constexprs: dict, options: dict | None = None) -> None:
        """Launch ``fn[grid](*args, **constexprs, **options)``.

        Args:
            key: hashable; equal keys must mean the same compiled variant (module docstring). The current CUDA
                device is added to it here.
            grid: 1 to 3 ints.
            args: the leading parameters in order (run-time values; constexprs may be among them only if
                ``key`` covers them).
            constexprs: the remaining parameters by name (every one of them, but those that are also launch options,
                like a Gluon kernel's ``num_warps``: the direct path passes them positionally in the kernel's order).
            options: launch options (num_warps, num_stages, ...); part of the variant, so ``key`` must cover them.
        """
        options = options or {}
        fn = self.fn
        rec = recorder()
        if rec is not None:
            if not hasattr(fn, "arg_names"):  # a stand-in for a kernel (tests): launched, but never replayed
                rec.fail(f"{getattr(fn, '__name__', fn)} is not a Triton kernel")
                fn[grid](*args, **constexprs, **options)
                return
            kernel = None if rec.dry else fn[grid](*args, **constexprs, **options)
            rec.triton(fn, kernel, (tuple(grid) + (1, 1))[:3], tuple(args) + self._rest(fn, args, constexprs, options))
            return
        from triton import knobs

        hooks = _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)
        if not ENABLED or hooks or interpreted():
            fn[grid](*args, **constexprs, **options)
            return
        from triton.runtime import driver

        drv = driver.active
        dev = drv.get_current_device()
        full = (dev, id(fn), key, *(args[i].data_ptr() % 16 == 0 for i in self.align),
                *(args[i] > 2**31 - 1 for i in self.wide))
        k = self._kernels.get(full)
        if k is None or CHECKED:
            kernel = fn[grid](*args, **constexprs, **options)
            if k is not None and kernel is not k:
                raise RuntimeError(f"LaunchCache key {key!r} of {getattr(fn, '__name__', fn)} names two compiled variants")
            if kernel is not None and hasattr(kernel, "run"):
                self._kernels[full] = kernel
            return
        rest = self._rest(fn, args, constexprs, options)
        g = tuple(grid) + (1, 1)
        stream = drv.get_current_stream(dev)
        k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, None, None, None, *args, *rest)

    def _rest(self, fn, args: tuple, constexprs: dict, options: dict) -> tuple:
        """The values of the parameters after ``args``, in the kernel's order (constexprs and option parameters)."""
        if self._trailing is None:
            self._trailing = tuple(fn.arg_names[len(args):])
        return tuple(constexprs[n] if n in constexprs else options[n] for n in self._trailing)

    def clear(self) -> None:
        """Forget the compiled variants (the JIT's own cache keeps them compiled)."""
        self._kernels.clear()
        self._trailing = None


__all__ = ["LaunchCache", "ENABLED", "CHECKED"]
