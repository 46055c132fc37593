"""A GPU that is already lost when the agent starts: the node's ResourceSlice (NVIDIA's format,
through the repository's Kubernetes API emulation over HTTP) publishes it, NVML (nvidia-ml-py's
real ctypes path against the fake NVML library) cannot enumerate it. From the first cycle after
the slices are listed it is exported with gpu_up 0, gpu_healthy 0, its gpu_info from the slice's
attributes and a fatal gpu_lost condition, and the claim holding it is unhealthy.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fakes.fake_nvml import FakeGpu, FakeNvml, installed
from k8s_helpers import publish_scenario, running_apiserver, wait_until, write_kubeconfig
from kit_helpers import scrape_samples

from drasim import objects
from drasim.kubelet import FakeKubelet
from drasim.scenario import parse_scenario
from exporter.config import Config, TaintMode
from exporter.devices.model import DeviceIdentity, Vendor
from exporter.devices.nvml import NvmlBackend
from exporter.k8s.model import SliceDevice
from exporter.model.lost import LostDevices
from exporter.wiring import build_agent

SCENARIO = {
    "node": "lost-node",
    "gpus": [
        {"name": "gpu0", "model": "NVIDIA H100 80GB HBM3"},
        {"name": "gpu1", "model": "NVIDIA H100 80GB HBM3"},
        {"name": "gpu2", "model": "NVIDIA H100 80GB HBM3", "mig": [{"profile": "1g.10gb"}, {"profile": "1g.10gb"}]},
    ],
    "claims": [
        {"namespace": "team-a", "name": "ok", "devices": ["gpu0"]},
        {"namespace": "team-a", "name": "train", "devices": ["gpu1"]},
        {"namespace": "team-b", "name": "slice", "devices": ["gpu2:1g.10gb:0"]},
    ],
    "pods": [
        {"namespace": "team-a", "name": "fine", "containers": [{"name": "main", "claims": ["ok"]}]},
        {"namespace": "team-a", "name": "trainer", "containers": [{"name": "main", "claims": ["train"]}]},
        {"namespace": "team-b", "name": "inference", "containers": [{"name": "main", "claims": ["slice"]}]},
    ],
}


def by_uuid(m: dict, name: str) -> dict[str, float]:
    return {lab["uuid"]: v for lab, v in m.get(name, [])}


def test_a_gpu_lost_before_start_is_fatal_with_series_from_the_first_cycle():
    sc = parse_scenario(SCENARIO, "lost")
    g0 = sc.gpu("gpu0")
    lost, mig_parent = sc.gpu("gpu1"), sc.gpu("gpu2")
    # NVML sees gpu0 only: gpu1 and gpu2 (with its MIG instances) fell off the bus before start
    fake = FakeNvml([FakeGpu(g0.uuid, pci_bus_id="00000000:" + g0.pci_bus_id.split(":", 1)[1].upper(), minor=0)])
    tmp = Path(tempfile.mkdtemp(prefix="dra-lost-"))
    kubelet = FakeKubelet(str(tmp / "kubelet.sock"), qps=None)
    kubelet.set_pods(objects.kubelet_pods(sc, list(sc.pods)))
    kubelet.start()
    agent = None
    try:
        with running_apiserver("1.37", bookmark_interval=0.2) as api, installed(fake):
            publish_scenario(api, sc)
            cfg = Config(
                listen_host="127.0.0.1", listen_port=0, node_name=sc.node, kubelet_socket=kubelet.socket_path,
                kubeconfig=str(write_kubeconfig(tmp / "kubeconfig", api.url)), backend="nvml", interval=3600.0,
                call_timeout=1.0, taint_mode=TaintMode.OFF,
            )
            agent = build_agent(cfg, backend=NvmlBackend(event_wait_ms=50, lock_timeout_s=0.2))
            agent.start()
            wait_until(lambda: agent.src.get("slices").watcher.synced, timeout=30, message="ResourceSlices listed")
            agent.run_cycle()  # the first cycle after the slices are listed
            m = scrape_samples(agent.server.url)

            up, healthy = by_uuid(m, "gpu_up"), by_uuid(m, "gpu_healthy")
            instances = [mm.uuid for mm in mig_parent.mig]
            assert up[g0.uuid] == 1 and healthy[g0.uuid] == 1
            for u in [lost.uuid, mig_parent.uuid, *instances]:
                assert up[u] == 0 and healthy[u] == 0, u
            info = {lab["uuid"]: lab for lab, _ in m["gpu_info"]}
            assert info[lost.uuid]["model"] == "NVIDIA H100 80GB HBM3" and info[lost.uuid]["pci_bus_id"] == lost.pci_bus_id
            assert info[instances[0]]["parent_uuid"] == mig_parent.uuid and info[instances[0]]["mig_profile"] == "1g.10gb"
            conds = {(lab["uuid"], lab["tier"], lab["reason"]) for lab, _ in m["gpu_health_condition"]}
            assert (lost.uuid, "fatal", "gpu_lost") in conds and (mig_parent.uuid, "fatal", "gpu_lost") in conds
            assert (instances[0], "fatal", "gpu_lost") in conds  # an instance inherits its GPU's loss
            assert not [c for c in conds if c[0] == g0.uuid]
            claims = {lab["claim"]: v for lab, v in m["dra_claim_healthy"]}
            assert claims == {"ok": 1.0, "train": 0.0, "slice": 0.0}
            assert {lab["uuid"] for lab, _ in m["dra_device_allocation_info"] if lab["claim"] == "train"} == {lost.uuid}
    finally:
        if agent is not None:
            agent.stop()
        kubelet.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_decision_is_remade_when_a_slice_device_or_the_enumeration_changes():
    """LostDevices re-decides only when its inputs change; a republished slice device whose uuid
    changed compares equal (SliceDevice leaves attributes out of ==) and must still be seen."""
    nv = "gpu.nvidia.com"

    def dev(name: str, uuid: str) -> SliceDevice:
        return SliceDevice(driver=nv, pool="node", name=name, attributes={f"{nv}/uuid": uuid})

    def ident(uuid: str) -> DeviceIdentity:
        return DeviceIdentity(uuid=uuid, vendor=Vendor.NVIDIA, model="H100", pci_bus_id="", index=0)

    def uuids(ids: tuple[DeviceIdentity, ...]) -> list[str]:
        return [i.uuid for i in ids]

    lost = LostDevices()
    g0, g1 = dev("gpu-0", "GPU-0"), dev("gpu-1", "GPU-1")
    seen = (ident("GPU-0"),)
    ids, readings = lost.merge(seen, {}, {g0.key: g0, g1.key: g1}, enumerated=True)
    assert uuids(ids) == ["GPU-0", "GPU-1"] and readings["GPU-1"].error is not None
    # the same devices in a fresh mapping, as the slice watch hands them over each cycle
    assert uuids(lost.merge(seen, {}, {g0.key: g0, g1.key: g1}, enumerated=True)[0]) == ["GPU-0", "GPU-1"]
    # gpu-1 republished with another uuid
    g1b = dev("gpu-1", "GPU-9")
    assert g1b == g1
    assert uuids(lost.merge(seen, {}, {g0.key: g0, g1b.key: g1b}, enumerated=True)[0]) == ["GPU-0", "GPU-9"]
    # GPU-9 enumerated after all: not lost any more
    both = (ident("GPU-0"), ident("GPU-9"))
    ids, readings = lost.merge(both, {}, {g0.key: g0, g1b.key: g1b}, enumerated=True)
    assert uuids(ids) == ["GPU-0", "GPU-9"] and "GPU-9" not in readings
    assert uuids(lost.merge(seen, {}, {g0.key: g0, g1b.key: g1b}, enumerated=True)[0]) == ["GPU-0", "GPU-9"]
    # a failed enumeration decides nothing: the last decision (GPU-9 lost) stands
    ids, readings = lost.merge((), {}, {g0.key: g0, g1b.key: g1b}, enumerated=False)
    assert uuids(ids) == ["GPU-9"] and readings["GPU-9"].error is not None
