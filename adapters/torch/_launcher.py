"""The torch executor's launches: a plan's buffers (empty, zeroed, placeholder,
per-stream scratch) and its launches, on the GPU through the compiled
kernel's C launcher where one is cached (the fast path below), else through
Triton's regular launch; on the CPU under Triton's interpreter."""
from __future__ import annotations

import math
import operator

import torch

from core_kernels._interpret import INTERPRETER_LOCK, interpreted
from core_kernels._plan import Scalar, kernel_signature, row_major_strides

from ._device import TORCH_DTYPES

_PROGRAMS_MAX = 4096


def _getter(index):
    """operator.itemgetter(*index), always returning a tuple (empty for no index)."""
    if len(index) > 1:
        return operator.itemgetter(*index)
    return (lambda s, i=index[0]: (s[i],)) if index else (lambda s: ())


def _run_gpu(prog, tensors: dict, runtime, device) -> dict:
    env = tensors
    if prog.allocs:
        env = dict(tensors)
        capturing = None
        for name, shape, strides, dtype, mode, buf in prog.allocs:
            if mode is _PER_STREAM:
                if capturing is None:
                    capturing = _is_capturing()
                if not capturing:
                    env[name] = _stream_scratch(device, name, buf)
                    continue
                mode = _ZEROS if buf.zero_init else _EMPTY
            if mode is _EMPTY:
                env[name] = _empty_strided(shape, strides, dtype=dtype, device=device)
            elif mode is _ZEROS:
                env[name] = torch.zeros(shape, dtype=dtype, device=device)
            else:
                env[name] = _placeholder(device, buf.dtype)
    index = device.index
    if index is None:
        index = torch.cuda.current_device()
    if index != _current_device():
        with torch.cuda.device(device):
            for launch, recipe in prog.launches:
                _launch(launch, recipe, env, runtime, index)
    else:
        for launch, recipe in prog.launches:
            _launch(launch, recipe, env, runtime, index)
    return env


def _run_interpreted(plan, tensors, runtime, device) -> dict:
    env = dict(tensors)
    for name, buf in plan.buffers.items():
        alloc = torch.zeros if buf.zero_init else torch.empty
        env[name] = alloc(buf.shape, dtype=TORCH_DTYPES[buf.dtype], device=device)
    for launch in plan.launches:
        with INTERPRETER_LOCK:  # the interpreter is not thread-safe (core_kernels._interpret)
            interpreted(launch.kernel)[launch.grid](*_tensor_args(launch, env, runtime),
                                                   **launch.constexprs)
    return env


def _tensor_args(launch, env, runtime) -> list:
    """A launch's arguments as Triton's launch takes them: tensors and scalars, in order."""
    args = [(runtime[a.value] if isinstance(a.value, str) else a.value)
            if isinstance(a, Scalar) else env[a] for a in launch.args]
    return args + [env[o] for o in launch.outputs]


# Placeholder buffers (Buffer.placeholder: no launch reads or writes them) share
# one small tensor per (device, dtype) instead of an allocation per call.
_PLACEHOLDERS = {}


def _placeholder(device, dtype: str) -> torch.Tensor:
    key = (device, dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(16, dtype=TORCH_DTYPES[dtype], device=device)
    return t


# Per-stream scratch (Buffer.per_stream): (device index, raw stream, buffer name,
# dtype, zero_init) -> [flat tensor, {shape: view of it}]. Calls on one stream run
# in order, so each may use the buffer that the previous one has finished with;
# a zero_init buffer is zeroed when allocated and left zero by the launches.
# NOTE: a CUDA graph capture allocates its own instead (it keeps the address:
# two graphs captured on one stream may be replayed on two streams at once).
# Saves an allocation per call (torch.empty took 7 us of host time on the H200
# host, 2026-11-24).
_STREAM_SCRATCH = {}
_VIEWS_MAX = 64


def _stream_scratch(device, name: str, buf) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index), name, buf.dtype, buf.zero_init)
    hit = _STREAM_SCRATCH.get(key)
    if hit is not None:
        view = hit[1].get(buf.shape)
        if view is not None:
            return view
    numel = math.prod(buf.shape)
    if hit is None or hit[0].numel() < numel:
        # growing frees the old one: the caching allocator hands it out again
        # only on this stream, after the work queued here
        alloc = torch.zeros if buf.zero_init else torch.empty
        hit = _STREAM_SCRATCH[key] = [alloc((numel,), dtype=TORCH_DTYPES[buf.dtype], device=device), {}]
    if len(hit[1]) >= _VIEWS_MAX:
        hit[1].clear()
    view = hit[1][buf.shape] = hit[0][:numel].view(buf.shape)
    return view


# How run_plan makes a buffer (_Program.allocs).
_EMPTY, _ZEROS, _PLACEHOLDER, _PER_STREAM = "empty", "zeros", "placeholder", "per_stream"
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# NOTE: the C function behind torch.cuda.is_current_stream_capturing, without its
# Python wrapper (which also checks that CUDA is initialised: a tensor on the GPU
# is proof enough)
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# NOTE: a contiguous buffer is made by torch.empty_strided with its strides
# worked out in advance: 2.25 us of host time per call against 3.5-3.7 us for
# torch.empty of the same shape (H200 host, 2026-11-25,
# benchmarks/experiments/exp_merge_small.py --only alloc).
_empty_strided = torch.empty_strided


class _Program:
    """A plan's GPU run, worked out once: the buffers to make, as (name, shape,
    contiguous strides, torch dtype, mode, Buffer), and the launches with their
    recipes."""
    __slots__ = ("plan", "allocs", "launches")

    def __init__(self, plan):
        self.plan = plan
        self.allocs = tuple(
            (name, tuple(buf.shape), row_major_strides(buf.shape), TORCH_DTYPES[buf.dtype],
             _PLACEHOLDER if buf.placeholder else _PER_STREAM if buf.per_stream
             else _ZEROS if buf.zero_init else _EMPTY, buf)
            for name, buf in plan.buffers.items())
        self.launches = tuple((launch, _Recipe(launch)) for launch in plan.launches)


class _Recipe:
    """A launch's arguments as the compiled kernel's C launcher takes them, in
    the kernel's parameter order, constexprs included: ``getter`` picks them
    from ``[data pointers of ptr_names] + [runtime values of rt_names] + consts``
    (the plan-time scalars and the constexprs). ``compiled``: the launch's
    compiled kernels by specialisation (_spec)."""
    __slots__ = ("ptr_names", "tensors", "rt_names", "getter", "index", "consts", "compiled")

    def __init__(self, launch):
        order = []  # per parameter: ("p" | "r" | "c", index)
        ptrs, rts, consts = [], [], []
        for name, const, _ in kernel_signature(launch.kernel):
            if const:
                order.append(("c", len(consts)))
                consts.append(launch.constexprs[name])
                continue
            a = launch.params[name]
            if isinstance(a, str):
                order.append(("p", len(ptrs)))
                ptrs.append(a)
            elif isinstance(a.value, str):
                order.append(("r", len(rts)))
                rts.append(a.value)
            else:
                order.append(("c", len(consts)))
                consts.append(a.value)
        base = {"p": 0, "r": len(ptrs), "c": len(ptrs) + len(rts)}
        self.index = index = [base[kind] + i for kind, i in order]
        self.getter = _getter(index)
        self.ptr_names, self.rt_names, self.consts = tuple(ptrs), tuple(rts), consts
        self.tensors = _getter(ptrs)
        self.compiled = {}


# Programs by plan (plans are cached, so few): id -> _Program, which keeps the
# plan so that its id cannot be reused while the entry lives.
_PROGRAMS = {}


def _program(plan) -> _Program:
    prog = _PROGRAMS.get(id(plan))
    if prog is None or prog.plan is not plan:
        if len(_PROGRAMS) >= _PROGRAMS_MAX:
            _PROGRAMS.clear()
        prog = _PROGRAMS[id(plan)] = _Program(plan)
    return prog


# A cached plan's launch goes straight to the compiled kernel's C launcher,
# skipping JITFunction.run's argument binding and cache-key hashing (the bulk of
# a Triton launch's host time), with the pointers passed as integers: the
# launcher then neither calls data_ptr() nor asks the driver about each pointer
# (cuPointerGetAttribute); the devices were checked when the plan was made.
_FAST_PATH = True
_data_ptr = torch.Tensor.data_ptr


def _spec(device_index, ptrs, rts):
    """What Triton specialises on that can change between calls of one launch:
    pointer alignment and runtime integers equal to 1 or past int32 (never their
    divisibility: the integer policy of core_kernels._triton_utils.jit). The
    usual case, every pointer 16-byte aligned and no runtime integer, is the
    device index alone."""
    aligned = not (_gcd(*ptrs) & 15)
    if aligned and not rts:
        return device_index
    return (device_index, True if aligned else tuple(p & 15 == 0 for p in ptrs),
            tuple((v == 1, -2 ** 31 <= v < 2 ** 31) if isinstance(v, int) else None for v in rts))


# NOTE: every pointer is 16-byte aligned iff their gcd is a multiple of 16 (gcd(0, p) = p;
# no pointers: 0): one C call, ~0.1 us for eight pointers against ~0.35 us for
# functools.reduce(operator.or_) (the development CPU, 2026-11-25).
_gcd = math.gcd


_KNOBS = None
_HOOK_CHAIN = None


def _hooks_set() -> bool:
    """Whether Triton launch hooks (profilers) are installed. NOTE: Triton 3.6 keeps
    them as HookChain objects that are never None, empty when unused; comparing
    with None had disabled the fast path below on every launch (H200: 67 us of
    host time per decode call instead of ~7 us)."""
    global _KNOBS, _HOOK_CHAIN
    if _KNOBS is None:
        import triton
        _KNOBS = triton.knobs.runtime
        _HOOK_CHAIN = getattr(triton.knobs, "HookChain", None)
    for h in (_KNOBS.launch_enter_hook, _KNOBS.launch_exit_hook):
        if h is not None and (type(h) is not _HOOK_CHAIN or h.calls):
            return True
    return False


class _Compiled:
    """A compiled kernel's launcher: ``raw``, the C launch function itself, where
    the kernel needs no scratch allocation (else the launcher object, which
    allocates it)."""
    __slots__ = ("run", "raw", "function", "meta", "grid", "coop", "pdl")

    def __init__(self, compiled, grid):
        run = compiled.run
        self.run, self.function, self.meta = run, compiled.function, compiled.packed_metadata
        self.grid = grid
        no_scratch = not getattr(run, "global_scratch_size", 1) and not getattr(run, "profile_scratch_size", 1)
        self.raw = getattr(run, "launch", None) if no_scratch else None
        self.coop = getattr(run, "launch_cooperative_grid", False)
        self.pdl = getattr(run, "launch_pdl", False)

    def __call__(self, stream, args):
        g = self.grid
        if self.raw is not None:
            self.raw(g[0], g[1], g[2], stream, self.function, self.coop, self.pdl, None, None, self.meta,
                     None, None, None, *args)
        else:
            self.run(g[0], g[1], g[2], stream, self.function, self.meta, None, None, None, *args)


def _launch(launch, recipe, env, runtime, device_index):
    global _FAST_PATH
    if _FAST_PATH:
        ptrs = list(map(_data_ptr, recipe.tensors(env)))
        if recipe.rt_names:
            rts = [runtime[n] for n in recipe.rt_names]
            key, values = _spec(device_index, ptrs, rts), ptrs + rts + recipe.consts
        else:
            key = device_index if not (_gcd(*ptrs) & 15) else _spec(device_index, ptrs, ())
            values = ptrs + recipe.consts
        entry = recipe.compiled.get(key)
        if entry is not None and not _hooks_set():
            g, raw = entry.grid, entry.raw
            if raw is not None:
                raw(g[0], g[1], g[2], _raw_stream(device_index), entry.function, entry.coop, entry.pdl,
                    None, None, entry.meta, None, None, None, *recipe.getter(values))
            else:
                entry(_raw_stream(device_index), recipe.getter(values))
            return
    compiled = launch.kernel[launch.grid](*_tensor_args(launch, env, runtime), **launch.constexprs,
                                          num_warps=launch.num_warps, num_stages=launch.num_stages)
    if not _FAST_PATH or _hooks_set():
        return  # the regular path calls the hooks
    try:
        if not hasattr(compiled, "packed_metadata") or _raw_stream is None:
            raise AttributeError("unknown launcher")
        grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        recipe.compiled[key] = _Compiled(compiled, grid)
    except (AttributeError, KeyError):
        _FAST_PATH = False  # another Triton version: always take the regular path
