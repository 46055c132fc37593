"""Names and numbers that several parts of the product use: each is written once, here.
Imports nothing, so every layer may use it."""

from __future__ import annotations

# Where the kubelet serves the PodResources API (the --kubelet-socket default).
KUBELET_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"

# The DRA drivers whose devices are GPUs (ResourceSlice spec.driver, DeviceClass names).
NVIDIA_DRIVER = "gpu.nvidia.com"
AMD_DRIVER = "gpu.amd.com"

# (connect, read) seconds for one Kubernetes API request that is not a watch (rule, budget and
# event writes, version and node reads).
API_TIMEOUT = (3.0, 5.0)
