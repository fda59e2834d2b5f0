"""torch.library registration shared by every op.

Each public op is a ``torch.library`` custom op (so torch.compile sees one opaque
node with declared mutations), but eager calls skip the dispatcher and run the
implementation directly: the custom-op dispatch costs more host time than the
kernel launch itself for decode-sized inputs. The eager path keeps what the
dispatcher would do for autograd (docs/scalar_policy.md, "Autograd"):
- an op without a backward refuses a call that would need one (grad mode on and
  an input that requires grad) with a RuntimeError naming the op, eagerly and
  under torch.compile, instead of returning outputs cut off from the graph;
- the tensors an op writes in place get their version counters bumped (a tensor
  saved for a backward cannot be overwritten unnoticed), and an inference tensor
  is not written outside inference mode (the RuntimeError of torch's own
  in-place ops), both checked before the launch.
"""
from __future__ import annotations

import inspect

import torch

NAMESPACE = "tandem_attn"

# every registered op by name: the callable that custom_op returns (tests iterate over it)
OPS: dict = {}

# An eager call on tensor subclasses first asks this hook (set by _dtensor.install:
# DTensors computed on their local tensors without DTensor's and torch.library's
# dispatch layers); it returns NotImplemented where the dispatcher must run.
subclass_call = None

INFERENCE_UPDATE = ("Inplace update to inference tensor outside InferenceMode is not allowed. "
                    "You can make a clone to get a normal tensor before doing inplace update.")


def no_backward_error(name: str) -> RuntimeError:
    """The error of a call that needs a backward the op does not have."""
    return RuntimeError(
        f"{NAMESPACE}::{name} has no backward: an input requires grad while grad mode is on, "
        "and its outputs would be cut off from the autograd graph. Call it under "
        "torch.no_grad() or torch.inference_mode(), or detach the inputs.")


def _no_backward_setup(name: str):
    def setup_context(ctx, inputs, output):
        raise no_backward_error(name)
    return setup_context


def _any_requires_grad_py(*args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


# NOTE: the C helper torch's own custom-op autograd kernel uses: ~0.4 us for ten
# arguments against ~1.3 us for the Python loop (CPU, torch 2.13); it is only
# reached with grad mode on (never under torch.inference_mode / no_grad).
_any_requires_grad = getattr(torch._C, "_any_requires_grad", _any_requires_grad_py)
# NOTE: the C function behind torch.autograd.graph.increment_version (which takes a
# tensor or a sequence of them): ~0.3 us for two tensors, half the public wrapper's time
# on this per-call path. It leaves inference tensors alone (they have no version).
_increment_version = getattr(torch._C, "_increment_version", torch.autograd.graph.increment_version)


def custom_op(name: str, impl, mutates_args=(), fake=None, autograd=None, differentiable=None, *,
              axes=None, renamed=None):
    """Register ``impl`` as ``torch.ops.tandem_attn.<name>`` and return a callable
    that dispatches through the op while compiling and calls ``impl`` eagerly.

    Ops that only mutate their arguments need no fake implementation beyond
    returning None; ops that return tensors pass ``fake``.

    ``autograd``: None, the op has no backward: a call with grad mode on and an
    input that requires grad raises :func:`no_backward_error` before any launch
    (eagerly, under torch.compile, and for functional ops also when called as
    ``torch.ops.tandem_attn.<name>``). To give an op a backward, pass
    ``(backward, setup_context)`` as for ``torch.library.register_autograd``
    (functional ops only, a torch.library rule); such calls then go through the
    dispatcher, which records the backward.

    ``differentiable``: for an in-place op (which torch.library gives no autograd
    formula), a function of the same arguments that computes the call through
    functional ops with a backward and copies the results into the written
    arguments; a call that needs a backward runs it instead of the op (eagerly
    and under torch.compile). Calls that need no backward are unchanged.
    A functional op may pass one too, when its backward needs more than the op
    computes (block-sparse attention: the LSE): ``differentiable`` then returns
    the op's results through another functional op that has the backward; the
    registered op itself keeps refusing gradients (a dispatcher call cannot be
    rerouted).

    ``axes``: the op's description (``core_kernels.<op>.op``), from which the
    DTensor strategies are derived (``_dtensor``); None: DTensor refuses the op.
    ``renamed``: torch argument name -> the description's name, where the torch
    signature spells one differently (vLLM's ``o`` for ``output``).
    """
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)(impl)
    op.register_fake(fake if fake is not None else (lambda *args, **kwargs: None))
    has_backward = autograd is not None
    if differentiable is not None and has_backward:
        raise ValueError(f"{name}: differentiable= is for ops without autograd=")
    eager_autograd = None
    if has_backward:
        op.register_autograd(autograd[0], setup_context=autograd[1])
        eager_autograd = _eager_autograd(name, impl, *autograd).apply
    elif not mutates_args:  # torch.library accepts autograd formulas for functional ops only
        op.register_autograd(lambda ctx, *grads: None, setup_context=_no_backward_setup(name))
    params = list(inspect.signature(impl).parameters)
    mutated = tuple(params.index(n) for n in mutates_args)
    is_compiling = torch.compiler.is_compiling
    grad_enabled = torch.is_grad_enabled
    inference_mode = torch.is_inference_mode_enabled
    Tensor = torch.Tensor

    def call(*args):
        a0 = args[0] if args else None
        # a tensor subclass (DTensor, ...) dispatches through the op: its
        # __torch_dispatch__ runs the op on plain (local) tensors, which the
        # kernels need. Every op's first argument is a tensor.
        if is_compiling() or (type(a0) is not Tensor and isinstance(a0, Tensor)):
            if (subclass_call is not None and not is_compiling()
                    and not (grad_enabled() and _any_requires_grad(*args))):
                result = subclass_call(name, impl, args)
                if result is not NotImplemented:
                    return result
            if not has_backward and grad_enabled() and _any_requires_grad_py(*args):
                if differentiable is not None:
                    return differentiable(*args)
                raise no_backward_error(name)
            return op(*args)  # the dispatcher bumps versions (and records a backward)
        if grad_enabled() and _any_requires_grad(*args):
            if has_backward:
                return eager_autograd(*args)
            if differentiable is not None:
                return differentiable(*args)
            raise no_backward_error(name)
        if not mutated:
            return impl(*args)
        written = [args[i] for i in mutated if isinstance(args[i], Tensor)]
        if not inference_mode():
            for i, arg in zip(mutated, mutates_args):
                if isinstance(args[i], Tensor) and args[i].is_inference():
                    raise RuntimeError(f"{arg}: {INFERENCE_UPDATE} ({NAMESPACE}::{name} writes it "
                                       "in place)")
        result = impl(*args)
        _increment_version(written)
        return result

    call.op = op
    call.mutates_args = tuple(mutates_args)
    call.has_backward = has_backward or differentiable is not None
    call.axes, call.renamed = axes, dict(renamed or {})
    OPS[name] = call
    return call


def _eager_autograd(name, impl, backward, setup_context):
    """An eager call's autograd: a torch.autograd.Function over ``impl`` with the
    op's own backward and setup_context, as torch.library's registration makes
    for a dispatcher call (the same functions, default grad materialisation:
    unused outputs get zero gradients), without the dispatcher's Python layers.
    NOTE: the dispatcher path (op(*args) under grad) cost ~100 us more host time
    per forward call than this (torch 2.13, measured on the CPU with the kernels
    stubbed out), which a training step's fwd+bwd pays on the GPU when it is
    host-bound (lightning B1 H64 N4096: 877 us wall for 600 us of GPU time on an
    H100, 2026-11-24). torch.compile and opcheck still go through the op."""
    def forward(ctx, *args):
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    return type(f"{name}_eager_autograd", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})
