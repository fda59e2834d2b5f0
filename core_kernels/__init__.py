"""Framework-free Triton kernels, launch plans and numpy references."""
import os as _os

# With no GPU driver on the machine, run every kernel under Triton's interpreter
# without the user setting anything. This must happen before triton.language is
# imported: Triton decides at decoration time whether a @triton.jit function
# (its own library helpers included) is compiled or interpreted.
if not any(_os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")):
    _os.environ.setdefault("TRITON_INTERPRET", "1")
if _os.environ.get("TRITON_INTERPRET") == "1":
    from ._interpreter_bf16 import install as _install_bf16
    _install_bf16()  # bf16 dots and roundings as on the GPU (see the module)
from ._plan import ArrayInfo, Buffer, Launch, Plan, Scalar

__all__ = ["ArrayInfo", "Buffer", "Launch", "Plan", "Scalar"]
