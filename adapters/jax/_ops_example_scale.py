"""example_scale for JAX: the example op of ADDING_AN_OP.md (functional, works
under jax.jit, jax.vmap and SPMD partitioning, all derived from its
description)."""
from __future__ import annotations

from core_kernels.example_scale import EXAMPLE_SCALE, plan_example_scale

from . import _spmd
from ._executor import infos, run_plan, scale_array, target
from ._vmap import vmappable


def example_scale(x, scale):
    """``x * scale``, computed in fp32 and rounded once.

    Args:
        x: [T, H, D] float32/float16/bfloat16.
        scale: a finite float > 0, or a 1-element float32 JAX array (device
            data: a new value never recompiles).
    Returns:
        a new [T, H, D] array of x's dtype.
    """
    (out,) = _spmd.call(EXAMPLE_SCALE, _example_scale, dict(x=x, scale=scale_array("scale", scale)))
    return out


def _example_scale(arrays):
    tgt = target(arrays)
    plan = plan_example_scale(tgt, **infos(arrays, "x", "scale"))
    return run_plan(plan, arrays, tgt)


# the public function with its vmap rule: the generic fold along the description's axes
example_scale = vmappable(example_scale, EXAMPLE_SCALE)
