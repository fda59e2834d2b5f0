"""The straight-line replay of a CallMemo entry on the GPU: ``_run_gpu`` of one
plan written out as generated Python (``_straight_source``) and compiled once
per plan structure."""
from __future__ import annotations

import torch

from . import _launcher
from ._launcher import (_PER_STREAM, _PLACEHOLDER, _VIEWS_MAX, _ZEROS, _current_device, _data_ptr,  # noqa: F401
                        _empty_strided, _gcd, _hooks_set, _is_capturing, _placeholder, _raw_stream, _spec,
                        _stream_scratch)

_increment_version = getattr(torch._C, "_increment_version", torch.autograd.graph.increment_version)

# NOTE: a replay makes its outputs by new_empty_strided on a kept 0-element tensor of
# the dtype and device (positional arguments only): 0.72 against 0.84 us for
# torch.empty_strided(..., dtype=, device=) on the development CPU, 2026-11-25.
_new_empty_strided = torch.Tensor.new_empty_strided

# NOTE: compiling a replay's source takes ~190 us on the development CPU (2026-11-25);
# the source depends on the plan's structure, not on its shapes or values (those are
# make's arguments), so the code is kept by source and a new entry of a known
# structure pays the source's making and an exec.
_STRAIGHT_CODE = {}
_STRAIGHT_MAX = 256


def _straight(prog, names, device, runtime, written=()):
    """A memo entry's GPU run (what ``_run_gpu`` does for ``prog``) as one
    generated straight-line function of the call's tensors, in the op's order
    ``names`` (``_straight_source``); None where it cannot be (a launch not
    compiled for 16-byte aligned pointers, an unknown launcher). The function
    returns the buffers it made by name, or None where the call needs
    ``_run_gpu`` (another device current, launch hooks, a CUDA graph capture of
    a plan with per-stream scratch, a pointer not 16-byte aligned); it bumps the
    version counters of the tensors at positions ``written``."""
    if not _launcher._FAST_PATH:  # read at each call: _launch turns it off for unknown launchers
        return None
    made = _straight_source(prog, names, device, runtime, tuple(written))
    if made is None:
        return None
    source, values = made
    code = _STRAIGHT_CODE.get(source)
    if code is None:
        if len(_STRAIGHT_CODE) >= _STRAIGHT_MAX:
            _STRAIGHT_CODE.clear()
        code = _STRAIGHT_CODE[source] = compile(source, "<call memo replay>", "exec")
    scope = {}
    exec(code, globals(), scope)  # noqa: S102  (our own generated source)
    return scope["make"](*values)


def _scratch_views(views, device, bufs, stream):
    """The per-stream buffers ``bufs`` ((name, Buffer)) on ``stream`` (_stream_scratch),
    kept in ``views`` by stream: a straight-line replay looks them up once per stream."""
    if len(views) >= _VIEWS_MAX:
        views.clear()
    found = views[stream] = [_stream_scratch(device, name, buf) for name, buf in bufs]
    return found


def _straight_source(prog, names, device, runtime, written):
    """The source of ``make(*values)``, which returns ``run(tensors)``: ``prog``
    run on the tensors ``names`` written out, with every fixed value (shapes,
    templates, placeholder pointers, launch arguments, compiled launchers) a
    closure variable; None where a launch has no compiled kernel for aligned
    pointers. Module functions (``_data_ptr``, ``_raw_stream``, ...) are looked
    up at each call, so a monkeypatch of the module reaches them.

    NOTE: on the development CPU with CUDA stubbed (2026-11-25), the replay of a
    block-sparse decode call took 2.4-2.5 us written out against 3.8-3.9 us by
    tables of positions and itemgetters (the decode launch has 31 arguments)."""
    values, value_names = [], {}

    def value(v):
        key = id(v)
        if key not in value_names:
            value_names[key] = f"v{len(values)}"
            values.append(v)
        return value_names[key]
    index = device.index if device.index is not None else torch.cuda.current_device()
    where = {name: f"tensors[{i}]" for i, name in enumerate(names)}  # each object's expression
    fixed = {}  # placeholders: name -> data pointer
    made, stream_bufs, allocs = [], [], []
    for name, shape, strides, dtype, mode, buf in prog.allocs:
        if name in where:
            raise ValueError(f"{name}: a buffer named as an argument")
        if mode is _PER_STREAM:
            where[name] = f"scratch[{len(stream_bufs)}]"
            stream_bufs.append((name, buf))
        elif mode is _PLACEHOLDER:
            fixed[name] = _placeholder(device, buf.dtype).data_ptr()
        else:
            where[name] = var = f"m{len(made)}"
            made.append((name, var))
            allocs.append(f"{var} = torch.zeros({value(shape)}, dtype={value(dtype)}, device={value(device)})"
                          if mode is _ZEROS else
                          f"{var} = _new_empty_strided({value(_empty_strided((0,), (1,), dtype=dtype, device=device))}, "
                          f"{value(shape)}, {value(strides)})")
    body = [f"if _current_device() != {value(index)} or _hooks_set():", "    return None",
            f"stream = _raw_stream({value(index)})"]
    if stream_bufs:
        views = value({})
        body += ["if _is_capturing():", "    return None", f"scratch = {views}.get(stream)", "if scratch is None:",
                 f"    scratch = _scratch_views({views}, {value(device)}, {value(tuple(stream_bufs))}, stream)"]
    body += allocs
    pointers, launches = {}, []  # pointers: name -> the variable holding its data pointer
    for _, recipe in prog.launches:
        rts = [runtime[n] for n in recipe.rt_names]
        fixed_ptrs = [fixed[n] for n in recipe.ptr_names if n in fixed]
        entry = None if _gcd(*fixed_ptrs) & 15 else recipe.compiled.get(_spec(index, fixed_ptrs, rts))
        if entry is None:
            return None
        ptrs = []
        for n in recipe.ptr_names:
            if n in fixed:
                ptrs.append(value(fixed[n]))
                continue
            if n not in pointers:
                pointers[n] = f"p{len(pointers)}"
                body.append(f"{pointers[n]} = _data_ptr({where[n]})")
            ptrs.append(pointers[n])
        rest = [*ptrs, *map(value, rts), *map(value, recipe.consts)]
        args = [rest[i] for i in recipe.index]  # the kernel's parameters in order
        g = entry.grid
        if entry.raw is not None:
            head = [*map(value, (g[0], g[1], g[2])), "stream", value(entry.function), value(entry.coop),
                    value(entry.pdl), "None", "None", value(entry.meta), "None", "None", "None"]
            launches.append(f"{value(entry.raw)}({', '.join(head + args)})")
        else:
            launches.append(f"{value(entry)}(stream, ({', '.join(args)},))")
    if pointers:
        body += [f"if _gcd({', '.join(pointers.values())}) & 15:", "    return None"]
    body += launches
    if written:
        body.append(f"_increment_version([{', '.join(f'tensors[{j}]' for j in written)}])")
    body.append("return {" + ", ".join(f"{name!r}: {var}" for name, var in made) + "}")
    source = (f"def make({', '.join(f'v{i}' for i in range(len(values)))}):\n"
              "    def run(tensors):\n" + "".join(f"        {line}\n" for line in body) + "    return run\n")
    return source, values
