"""What a plan is made for: the device a launch will run on, described by the executor.

Planners never ask the environment or the device themselves: each adapter's
executor builds a :class:`Target` from the real device (or the interpreter)
and passes it as the planner's first argument, so it is part of every plan's
cache key and a plan made for one device is never reused on another.
"""
from __future__ import annotations

import dataclasses

BACKENDS = ("cuda", "interpreter")


@dataclasses.dataclass(frozen=True)
class Target:
    """The device facts a planner may use.

    backend: "cuda" (compiled kernels) or "interpreter" (Triton's interpreter
        on the host: every program runs one after another, products are exact fp32).
    capability: compute capability as major * 10 + minor (90 = sm_90), 0 for
        the interpreter.
    num_sms: streaming multiprocessors (grids are sized in waves of them).
    gluon: whether this executor can launch Gluon kernels (Triton's
        explicit-layout dialect); a planner falls back to a Triton kernel when not.
    """
    backend: str
    capability: int
    num_sms: int
    gluon: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        if self.num_sms < 1:
            raise ValueError(f"num_sms: expected a positive count, got {self.num_sms}")

    @property
    def interpret(self) -> bool:
        return self.backend == "interpreter"

    @property
    def hopper(self) -> bool:
        """sm_90: warpgroup MMA (wgmma), which the Gluon kernels are written for."""
        return self.backend == "cuda" and self.capability == 90

    @staticmethod
    def interpreter(num_sms: int = 132) -> "Target":
        """Triton's interpreter. NOTE: it has no SMs; plans for it assume 132
        (the H200 the tuning tables were measured on) so that CPU tests walk
        the same multi-program paths (chained-scan segments, decode splits) as
        that GPU does. Tests pass other counts to check SM-dependent choices."""
        return Target("interpreter", 0, num_sms, gluon=False)
