"""Pick the device backend: ``auto`` uses whatever vendor library this machine has."""

from __future__ import annotations

import ctypes
import ctypes.util

from .base import BackendUnavailable, DeviceBackend


def nvml_available() -> bool:
    """True when libnvidia-ml.so.1 can be loaded (what nvidia-ml-py itself will try)."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


def make_backend(kind: str) -> DeviceBackend:
    if kind == "auto":
        if nvml_available():
            kind = "nvml"
        else:
            from .amd import amdsmi_available

            if amdsmi_available():
                kind = "amdsmi"
            else:
                raise BackendUnavailable(
                    "no GPU library found: libnvidia-ml.so.1 (NVIDIA driver) and libamd_smi.so (ROCm) are both "
                    "missing; "
                    "mount the driver libraries into the container, or run `dra-gpu-exporter demo` for a simulated node"
                )
    if kind == "nvml":
        from .nvml import NvmlBackend

        return NvmlBackend()
    if kind == "amdsmi":
        from .amd import AmdSmiBackend

        return AmdSmiBackend()
    raise BackendUnavailable(f"backend {kind!r} cannot be used here (the simulated backend runs under "
                             "`dra-gpu-exporter demo`)")
