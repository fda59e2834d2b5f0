"""Framework-free Triton kernels, launch plans and numpy references."""
from ._plan import ArrayInfo, Buffer, Launch, Plan, Scalar

__all__ = ["ArrayInfo", "Buffer", "Launch", "Plan", "Scalar"]
