"""Description of example_scale (core_kernels.op_axes): elementwise, so
independent along every labelled axis."""
from __future__ import annotations

from ..op_axes import OpAxes

# PUBLIC: the public functions this folder backs, in both adapters (every op.py has
# one; tests/test_architecture.py checks that both adapters define them)
PUBLIC = ("example_scale",)

EXAMPLE_SCALE = OpAxes(
    "example_scale",
    inputs={"x": ("tokens", "heads", None), "scale": (None,)},
    outputs={"out": ("tokens", "heads", None)},
    independent=("tokens", "heads"),   # elementwise: every axis is independent
    fold=("tokens", "heads"),
    unbatchable=("scale",),            # one scale per launch
)
