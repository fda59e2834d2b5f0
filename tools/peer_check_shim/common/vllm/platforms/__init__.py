"""Shim of vllm.platforms: `current_platform` reports facts of this machine."""
from __future__ import annotations

import random
from typing import NamedTuple

import torch


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        return self.major * 10 + self.minor


def _has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


class _Platform:
    """The subset of vllm.platforms.interface.Platform the fetched files use."""

    @property
    def device_type(self) -> str:
        return "cuda" if _has_gpu() else "cpu"

    @property
    def device_name(self) -> str:
        return self.device_type

    def is_cuda(self) -> bool:
        return _has_gpu() and torch.version.hip is None

    def is_rocm(self) -> bool:
        return _has_gpu() and torch.version.hip is not None

    def is_cuda_alike(self) -> bool:
        return self.is_cuda() or self.is_rocm()

    def is_cpu(self) -> bool:
        return not _has_gpu()

    def is_xpu(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0):
        if not _has_gpu():
            return None
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major, minor)

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        cur = self.get_device_capability(device_id)
        if cur is None:
            return False
        if isinstance(capability, tuple):
            return tuple(cur) >= tuple(capability)
        return cur.to_int() >= int(capability)

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        cur = self.get_device_capability(device_id)
        if cur is None:
            return False
        if isinstance(capability, tuple):
            return tuple(cur) == tuple(capability)
        return cur.to_int() == int(capability)

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if _has_gpu() else "cpu"

    def is_fp8_fnuz(self) -> bool:
        if not self.is_rocm():
            return False
        arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")
        return "gfx94" in arch

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fnuz if self.is_fp8_fnuz() else torch.float8_e4m3fn

    def seed_everything(self, seed: int | None = None) -> None:
        if seed is not None:
            import numpy as np
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


current_platform = _Platform()
