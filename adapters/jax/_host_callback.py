"""Host callbacks of the JAX executor on Triton's interpreter, including inside
a partitioned ``jax.jit`` (``_spmd``): a plain call is ``jax.pure_callback``;
inside a ``custom_partitioning`` lower function the launch goes through the
trampoline that the outer program registered (the NOTE below). Kept apart from
both the executor and ``_spmd`` so that neither imports the other back."""
from __future__ import annotations

import contextlib
import threading

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir


# NOTE: a host callback (jax.pure_callback) inside a custom_partitioning lower
# function is compiled into a separate module whose callback list is dropped:
# its index then points into the outer executable's list (measured: a
# segfault on JAX 0.10.2). So the outer program registers one trampoline per
# partitioned call (``register_p``, an identity on the first operand), and
# the lower function's launch emits its callback with that trampoline's index
# (``_host_p``); the trampoline forwards to the shard's callback, which every
# device runs on its own local shards.
class Slot:
    def __init__(self):
        self.index, self.fn = None, None

    def __call__(self, *args):
        if self.fn is None:
            raise RuntimeError("partitioned host callback: the partitioned launch was never lowered")
        return self.fn(*args)


register_p = Primitive("tandem_spmd_host_slot")
register_p.def_impl(lambda x, *, slot: x)
register_p.def_abstract_eval(lambda x, *, slot: x)


def _register_lowering(ctx, x, *, slot):
    ctx.module_context.add_host_callback(slot)
    slot.index = len(ctx.module_context.host_callbacks) - 1
    return [x]


mlir.register_lowering(register_p, _register_lowering, cacheable=False)

_host_p = Primitive("tandem_spmd_host_call")
_host_p.multiple_results = True
_host_p.def_abstract_eval(lambda *args, host, slot, results: [jax.core.ShapedArray(s.shape, s.dtype)
                                                                for s in results])


def _host_lowering(ctx, *args, host, slot, results):
    from jax._src import callback as cb
    if slot.index is None:
        raise RuntimeError("partitioned host callback: no slot registered in the outer program")
    module = ctx.module_context.replace(host_callbacks=[None] * slot.index)
    sharding = cb._callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
    outs, _, slot.fn = cb.emit_python_callback(
        ctx.replace(module_context=module), lambda *a: tuple(host(*a)), None, list(args),
        ctx.avals_in, ctx.avals_out, has_side_effect=False, returns_token=False, sharding=sharding)
    return outs


mlir.register_lowering(_host_p, _host_lowering, cacheable=False)

_LOCAL = threading.local()


@contextlib.contextmanager
def active(slots):
    """Inside, host callbacks go through ``slots`` (a Slot or a sequence of them:
    one per plan the lower function runs), in order."""
    prev = getattr(_LOCAL, "slots", None)
    _LOCAL.slots = [slots] if isinstance(slots, Slot) else list(slots or ())
    try:
        yield
    finally:
        _LOCAL.slots = prev


def host_call(host, result_structs, args):
    """The executor's host callback: ``jax.pure_callback`` except inside a
    partitioned lower function on the interpreter (see the NOTE above)."""
    slots = getattr(_LOCAL, "slots", None)
    if not slots:
        return jax.pure_callback(host, result_structs, *args, vmap_method="sequential")
    slot = slots.pop(0)                 # one launch per slot
    return tuple(_host_p.bind(*args, host=host, slot=slot, results=tuple(result_structs)))
