"""Per-process GPU memory -> pods through /proc/<pid>/cgroup, against a temporary proc root
holding the cgroup files each kubelet/runtime combination writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.devices.model import DeviceIdentity, DeviceReading, ReadError, Vendor
from exporter.health.model import DeviceHealth
from exporter.model.processes import pid_pod_uid, pod_uid_from_cgroup, process_memory
from exporter.model.snapshot import DeviceView, Snapshot

UID = "7c1a5f3e-2b9d-4e8a-a1b2-0c3d4e5f6a7b"
UID2 = "0f0e0d0c-0b0a-4909-8807-060504030201"

CGROUP_FILES = {
    # cgroup v1, cgroupfs driver: one line per hierarchy
    "v1-cgroupfs": (
        "12:pids:/kubepods/burstable/pod{uid}/3f2a9c0b1d\n"
        "11:memory:/kubepods/burstable/pod{uid}/3f2a9c0b1d\n"
        "1:name=systemd:/kubepods/burstable/pod{uid}/3f2a9c0b1d\n"
    ),
    # cgroup v1, guaranteed QoS (no QoS class directory)
    "v1-guaranteed": "4:cpu,cpuacct:/kubepods/pod{uid}/9d8e7f\n",
    # cgroup v2, cgroupfs driver
    "v2-cgroupfs": "0::/kubepods/besteffort/pod{uid}/0123abcd\n",
    # cgroup v2, systemd driver: dashes of the UID become underscores in the slice name
    "v2-systemd": "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-4f5e6d7c8b9a.scope\n",
    # cgroup v1, systemd driver, CRI-O
    "v1-systemd-crio": "10:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/crio-aa11bb22.scope\n",
    # cgroup v2 with a namespaced view and an upper-case UID (seen with some runtimes)
    "v2-upper": "0::/../../kubepods-pod{UID_}.slice/cri-containerd-1.scope\n",
}

NOT_PODS = {
    "host-service": "0::/system.slice/containerd.service\n",
    "user-session": "0::/user.slice/user-1000.slice/session-3.scope\n",
    "root": "0::/\n",
    "pod-like-word": "0::/system.slice/podman-1234.scope\n",
    "empty": "",
}


def render(template: str, uid: str = UID) -> str:
    return template.format(uid=uid, uid_=uid.replace("-", "_"), UID_=uid.replace("-", "_").upper())


@pytest.mark.parametrize("name", sorted(CGROUP_FILES))
def test_pod_uid_from_cgroup(name):
    assert pod_uid_from_cgroup(render(CGROUP_FILES[name])) == UID


@pytest.mark.parametrize("name", sorted(NOT_PODS))
def test_not_a_pod(name):
    assert pod_uid_from_cgroup(NOT_PODS[name]) is None


def make_proc(root: Path, pids: dict[int, str]) -> str:
    for pid, text in pids.items():
        d = root / str(pid)
        d.mkdir(parents=True)
        (d / "cgroup").write_text(text)
    return str(root)


def test_pid_pod_uid_reads_the_proc_root(tmp_path):
    proc = make_proc(tmp_path, {100: render(CGROUP_FILES["v2-systemd"]), 200: NOT_PODS["host-service"]})
    assert pid_pod_uid(100, proc) == UID
    assert pid_pod_uid(200, proc) is None
    assert pid_pod_uid(999, proc) is None  # the process ended between the NVML call and now


def test_unreadable_cgroup_file_is_not_fatal(tmp_path):
    (tmp_path / "300").mkdir()
    (tmp_path / "300" / "cgroup").mkdir()  # a directory where a file should be: read fails
    assert pid_pod_uid(300, str(tmp_path)) is None


def _dev(uuid: str, processes: dict[int, int | None], ok: bool = True) -> DeviceView:
    ident = DeviceIdentity(uuid=uuid, vendor=Vendor.NVIDIA, model="H100", pci_bus_id="0000:18:00.0", index=0)
    r = DeviceReading(uuid=uuid, processes=processes) if ok else DeviceReading.failed(uuid, ReadError.LOST)
    return DeviceView(identity=ident, reading=r, health=DeviceHealth(uuid))


def test_process_memory_sums_per_pod_and_device(tmp_path):
    proc = make_proc(
        tmp_path,
        {
            10: render(CGROUP_FILES["v2-systemd"]),
            11: render(CGROUP_FILES["v1-cgroupfs"]),  # same pod, other process
            20: render(CGROUP_FILES["v2-cgroupfs"], UID2),
            30: NOT_PODS["host-service"],  # a host process (e.g. a monitoring agent)
            40: render(CGROUP_FILES["v2-cgroupfs"], "11111111-2222-4333-8444-555555555555"),  # a pod not on our list
        },
    )
    snap = Snapshot(
        node="n",
        timestamp=0.0,
        devices=(
            _dev("GPU-a", {10: 100, 11: 50, 20: 7, 30: 1000, 40: 3, 99: 5}),
            _dev("GPU-b", {10: 1, 20: None}),
            _dev("GPU-lost", {10: 12345}, ok=False),
        ),
        pod_uids={UID: ("ml", "trainer"), UID2: ("inf", "server")},
    )
    got = process_memory(snap, proc)
    assert got == {
        ("GPU-a", "ml", "trainer"): 150,
        ("GPU-a", "inf", "server"): 7,
        ("GPU-a", "", ""): 1000 + 3 + 5,  # unmapped PIDs are counted, never guessed
        ("GPU-b", "ml", "trainer"): 1,
        ("GPU-b", "inf", "server"): 0,  # usage unknown (NVML reports N/A): present, as 0
    }


def test_process_memory_without_processes(tmp_path):
    snap = Snapshot(node="n", timestamp=0.0, devices=(_dev("GPU-a", {}),))
    assert process_memory(snap, str(tmp_path)) == {}
