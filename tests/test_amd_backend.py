"""AmdSmiBackend through amdsmi's real Python layer (amdsmi_interface + amdsmi_wrapper) over a
fake libamd_smi library object (tests/fakes/fake_amdsmi.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from fakes import fake_amdsmi as fake
from fakes.fake_amdsmi import FakeAmdGpu, FakeAmdSmiNode, FakeProcess, Status
from kit_helpers import wait_until

from exporter.devices.amd import (
    AmdSmiBackend,
    GpuProbe,
    amdsmi_available,
    assign_partitions,
    energy_joules,
    percent_to_ratio,
    socket_power_watts,
)
from exporter.devices.base import BackendUnavailable
from exporter.devices.deadline import CallHung, DeadlineRunner
from exporter.devices.model import DeviceEvent, DeviceIdentity, EventKind, ReadError, Vendor

GIB = 1024**3
GPU0 = "11111111-0000-1000-8000-000000000000"
GPU1 = "22222222-0000-1000-8000-000000000000"
CPX = "33333333-0000-1000-8000-"  # + 12 hex digits per partition



@pytest.fixture(scope="session")
def amdsmi_module():
    return fake.import_amdsmi()


@pytest.fixture(autouse=True)
def _detach_fake_node():
    yield
    fake.detach_node()


def make_node(*extra: FakeAmdGpu, cpx_reversed: bool = False) -> FakeAmdSmiNode:
    gpus = [
        FakeAmdGpu(uuid=GPU0, bdf="0000:03:00.0", card=0, render=128, vram_total=192 * GIB),
        FakeAmdGpu(uuid=GPU1, bdf="0000:23:00.0", card=9, render=137, vram_total=192 * GIB, driver_version="6.10.5"),
    ]
    parts = fake.cpx_gpu(CPX, "0000:83:00.0", partitions=4, card=1, render=129)
    if cpx_reversed:
        parts.reverse()
    return FakeAmdSmiNode(gpus + parts + list(extra))


@pytest.fixture
def node(amdsmi_module) -> FakeAmdSmiNode:
    n = make_node()
    fake.FAKE_LIB.node = n
    return n


@pytest.fixture
def backend(node: FakeAmdSmiNode):
    b = AmdSmiBackend(event_poll_ms=20, event_error_backoff_s=0.05)
    b.open()
    yield b
    b.close()


def by_uuid(devs: list[DeviceIdentity]) -> dict[str, DeviceIdentity]:
    return {d.uuid: d for d in devs}


# ---------------------------------------------------------------------------------------------
# enumeration
# ---------------------------------------------------------------------------------------------


def test_enumerates_full_gpus(backend: AmdSmiBackend) -> None:
    devs = by_uuid(backend.enumerate())
    g0 = devs[GPU0]
    assert g0.vendor is Vendor.AMD
    assert g0.model == "AMD Instinct MI300X"
    assert g0.pci_bus_id == "0000:03:00.0"
    assert (g0.card_index, g0.render_index) == (0, 128)
    assert g0.driver_version == "6.10.5"
    assert g0.memory_total_bytes == 192 * GIB
    assert g0.serial == "0xA1B2C3D4E5F60718"
    assert g0.index == 0
    assert not g0.is_partition and g0.mig_profile == ""
    assert devs[GPU1].pci_bus_id == "0000:23:00.0"
    assert (devs[GPU1].card_index, devs[GPU1].render_index) == (9, 137)
    assert backend.driver_version() == "6.10.5"


@pytest.mark.parametrize("cpx_reversed", [False, True])
def test_cpx_partitions_share_parent_and_bus_id(amdsmi_module, cpx_reversed: bool) -> None:
    fake.FAKE_LIB.node = make_node(cpx_reversed=cpx_reversed)
    b = AmdSmiBackend()
    b.open()
    try:
        devs = b.enumerate()
    finally:
        b.close()
    assert len(devs) == 6
    parts = [d for d in devs if d.uuid.startswith(CPX)]
    assert len(parts) == 4
    parent = CPX + "%012x" % 0  # function 0 = partition 0, whatever the handle order
    assert {d.parent_uuid for d in parts} == {parent}
    assert all(d.mig_profile == "CPX" for d in parts)
    # The first partition stands for the physical GPU (health, power); the others are partitions of it.
    assert [d.uuid for d in parts if not d.is_partition] == [parent]
    assert all(d.physical_uuid == parent for d in parts)
    # lspci / DRA show the physical GPU's function 0 for every partition
    assert {d.pci_bus_id for d in parts} == {"0000:83:00.0"}
    by = by_uuid(parts)
    for p in range(4):
        d = by[CPX + "%012x" % p]
        assert (d.card_index, d.render_index) == (1 + p, 129 + p)
        assert d.memory_total_bytes == 192 * GIB // 4
    assert sorted(d.index for d in devs) == list(range(6))


def test_enumeration_is_cached(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    first = backend.enumerate()
    calls = node.call_count("amdsmi_get_gpu_device_uuid", GPU0)
    assert backend.enumerate() == first
    assert node.call_count("amdsmi_get_gpu_device_uuid", GPU0) == calls


def test_non_gpu_processors_are_skipped(amdsmi_module) -> None:
    n = make_node(FakeAmdGpu(uuid="cpu0", bdf="0000:00:18.0", processor_type=2))
    fake.FAKE_LIB.node = n
    b = AmdSmiBackend()
    b.open()
    try:
        assert "cpu0" not in by_uuid(b.enumerate())
    finally:
        b.close()


def test_device_whose_uuid_fails_is_left_out(amdsmi_module) -> None:
    n = make_node()
    n.fail("amdsmi_get_gpu_device_uuid", Status.NOT_SUPPORTED, uuid=GPU1)
    fake.FAKE_LIB.node = n
    b = AmdSmiBackend()
    b.open()
    try:
        uuids = set(by_uuid(b.enumerate()))
    finally:
        b.close()
    assert GPU0 in uuids and GPU1 not in uuids and len(uuids) == 5


def test_assign_partitions_duplicate_uuids_are_made_unique() -> None:
    probes = [
        GpuProbe(index=i, handle_key=100 + i, uuid="same", bdf=f"0000:83:00.{i}", compute_partition="DPX", partition_id=i)
        for i in range(2)
    ]
    ids, handles = assign_partitions(probes)
    assert [d.uuid for d in ids] == ["same", "same-p1"]
    assert all(d.parent_uuid == "same" for d in ids)
    assert handles == {"same": 100, "same-p1": 101}


# ---------------------------------------------------------------------------------------------
# readings
# ---------------------------------------------------------------------------------------------


def test_readings_in_base_units(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    g = node.gpu(GPU0)
    g.gfx_activity, g.umc_activity = 55, 20
    g.vram_used = 8 * GIB
    g.current_socket_power = 310
    g.energy_accumulator, g.energy_resolution = 1_000_000, 15.259
    g.temperatures = {fake.TEMP_EDGE: 60, fake.TEMP_HOTSPOT: 71, fake.TEMP_VRAM: 65}
    g.clocks_mhz = {fake.CLK_GFX: 2100, fake.CLK_MEM: 1300}
    g.ecc_correctable, g.ecc_uncorrectable = 3, 1
    g.pcie_replay = 9
    g.processes = [FakeProcess(4242, vram_bytes=2 * GIB), FakeProcess(4343, vram_bytes=0)]
    dev = by_uuid(backend.enumerate())[GPU0]

    r = backend.read(dev)

    assert r.ok and r.error is None and r.uuid == GPU0
    assert r.utilization_ratio == pytest.approx(0.55)
    assert r.dram_active_ratio == pytest.approx(0.20)
    assert r.memory_used_bytes == 8 * GIB
    assert r.memory_total_bytes == 192 * GIB
    assert r.power_watts == 310.0
    assert r.energy_joules == pytest.approx(15.259, rel=1e-6)  # counts x uJ/count -> J
    assert r.temperature_celsius == 71.0  # hotspot preferred over edge
    assert r.memory_temperature_celsius == 65.0
    assert r.sm_clock_hertz == 2.1e9
    assert r.memory_clock_hertz == 1.3e9
    assert (r.ecc_correctable_total, r.ecc_uncorrectable_total) == (3, 1)
    assert r.pcie_replay_total == 9
    assert r.processes == {4242: 2 * GIB, 4343: 0}


def test_na_values_become_none(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    g = node.gpu(GPU0)
    g.gfx_activity = 0xFFFF  # the library's "not available"
    g.current_socket_power = g.average_socket_power = 0xFFFF
    g.socket_power = 0
    r = backend.read(by_uuid(backend.enumerate())[GPU0])
    assert r.ok
    assert r.utilization_ratio is None
    assert r.power_watts == 0.0  # only socket_power left, and it says 0 W


def test_mi200_average_power_and_edge_temperature_fallback(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    g = node.gpu(GPU1)
    g.current_socket_power, g.average_socket_power = 0xFFFF, 220
    g.temperatures = {fake.TEMP_EDGE: 48}  # no junction sensor on this board
    r = backend.read(by_uuid(backend.enumerate())[GPU1])
    assert r.power_watts == 220.0
    assert r.temperature_celsius == 48.0
    assert r.memory_temperature_celsius is None


def test_unsupported_function_is_none_and_not_retried(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    g = node.gpu(GPU0)
    g.unsupported = {"amdsmi_get_gpu_pci_replay_counter", "amdsmi_get_gpu_process_list"}
    g.metrics_pcie_replay = None  # the metrics-table fallback is unsupported too
    dev = by_uuid(backend.enumerate())[GPU0]

    readings = [backend.read(dev) for _ in range(3)]

    assert all(r.ok and r.pcie_replay_total is None and r.processes == {} for r in readings)
    assert node.call_count("amdsmi_get_gpu_pci_replay_counter", GPU0) == 1
    assert node.call_count("amdsmi_get_gpu_metrics_info", GPU0) == 1
    assert node.call_count("amdsmi_get_gpu_process_list", GPU0) == 1
    assert node.call_count("amdsmi_get_gpu_activity", GPU0) == 3  # supported ones are read every time


def test_pcie_replay_falls_back_to_metrics_table(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    g = node.gpu(GPU0)
    g.unsupported = {"amdsmi_get_gpu_pci_replay_counter"}
    g.metrics_pcie_replay = 17
    dev = by_uuid(backend.enumerate())[GPU0]
    assert backend.read(dev).pcie_replay_total == 17
    assert backend.read(dev).pcie_replay_total == 17
    assert node.call_count("amdsmi_get_gpu_pci_replay_counter", GPU0) == 1


def test_no_permission_counts_as_unsupported(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    node.fail("amdsmi_get_gpu_process_list", 10, uuid=GPU0)  # AMDSMI_STATUS_NO_PERM
    dev = by_uuid(backend.enumerate())[GPU0]
    assert backend.read(dev).ok and backend.read(dev).processes == {}
    assert node.call_count("amdsmi_get_gpu_process_list", GPU0) == 1


def test_transient_error_is_none_this_cycle_and_retried(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    node.gpu(GPU0).current_socket_power = 300
    dev = by_uuid(backend.enumerate())[GPU0]
    node.fail("amdsmi_get_power_info", Status.RETRY, uuid=GPU0)
    r = backend.read(dev)
    assert r.ok and r.power_watts is None
    node.clear_failure("amdsmi_get_power_info", uuid=GPU0)
    assert backend.read(dev).power_watts == 300.0
    assert node.call_count("amdsmi_get_power_info", GPU0) == 2


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (Status.NOT_FOUND, ReadError.LOST),
        (Status.DRIVER_NOT_LOADED, ReadError.LOST),
        (Status.TIMEOUT, ReadError.LATE),  # amdsmi returned: not stuck, no verdict on the GPU
        (Status.UNKNOWN_ERROR, ReadError.UNKNOWN),
    ],
)
def test_one_failing_gpu_does_not_affect_the_other(
    backend: AmdSmiBackend, node: FakeAmdSmiNode, status: int, expected: ReadError
) -> None:
    node.gpu(GPU0).gfx_activity = 40
    devs = by_uuid(backend.enumerate())
    node.fail("amdsmi_get_gpu_activity", status, uuid=GPU1)

    bad = backend.read(devs[GPU1])
    good = backend.read(devs[GPU0])

    assert not bad.ok and bad.error is expected and bad.uuid == GPU1
    assert "activity" in bad.error_detail
    # the failed device was not hammered with the remaining calls
    assert node.call_count("amdsmi_get_power_info", GPU1) == 0
    assert good.ok and good.utilization_ratio == pytest.approx(0.40)

    node.clear_failure("amdsmi_get_gpu_activity", uuid=GPU1)
    assert backend.read(devs[GPU1]).ok  # a device error is not remembered as "unsupported"


def test_device_failure_in_a_later_field(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    dev = by_uuid(backend.enumerate())[GPU0]
    node.fail("amdsmi_get_gpu_total_ecc_count", Status.IO, uuid=GPU0)
    r = backend.read(dev)
    assert not r.ok and r.error is ReadError.LOST


def test_unknown_device_reads_as_gone(backend: AmdSmiBackend) -> None:
    backend.enumerate()
    ghost = DeviceIdentity(uuid="nope", vendor=Vendor.AMD, model="", pci_bus_id="0000:99:00.0", index=99)
    r = backend.read(ghost)
    assert not r.ok and r.error is ReadError.GONE


def test_hung_call_under_deadline_runner(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    devs = by_uuid(backend.enumerate())
    release = node.hang("amdsmi_get_gpu_activity", uuid=GPU1)
    runner = DeadlineRunner()
    try:
        with pytest.raises(CallHung):
            runner.call(GPU1, lambda: backend.read(devs[GPU1]), timeout=0.2)
        # the other GPU has its own lane and reads normally while GPU1 is stuck
        r0 = runner.call(GPU0, lambda: backend.read(devs[GPU0]), timeout=10)
        assert r0.ok
        # the stuck lane fails fast instead of stacking threads
        with pytest.raises(CallHung):
            runner.call(GPU1, lambda: backend.read(devs[GPU1]), timeout=10)
        assert GPU1 in runner.hung_lanes()

        release.set()
        assert wait_until(lambda: GPU1 not in runner.hung_lanes())
        assert runner.call(GPU1, lambda: backend.read(devs[GPU1]), timeout=10).ok
    finally:
        release.set()
        runner.close()


# ---------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------


def test_amdsmi_not_importable_raises_backend_unavailable(
    amdsmi_module, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake.unloadable_amdsmi():
        b = AmdSmiBackend()
        with pytest.raises(BackendUnavailable) as info:
            b.open()
        # amdsmi's import fails with KeyError('libamd_smi.so'), not ImportError
        assert "KeyError" in str(info.value) and "Unable to find libamd_smi.so" in str(info.value)
        assert "amdsmi" not in sys.modules
    # amdsmi's own complaint went into the exception, not onto our stdout
    assert "Unable to find" not in capsys.readouterr().out
    assert sys.modules["amdsmi"] is amdsmi_module


def test_init_failure_raises_backend_unavailable(amdsmi_module) -> None:
    n = make_node()
    n.init_status = Status.DRIVER_NOT_LOADED
    fake.FAKE_LIB.node = n
    with pytest.raises(BackendUnavailable, match="amdsmi_init"):
        AmdSmiBackend().open()


def test_use_before_open_is_reported() -> None:
    with pytest.raises(BackendUnavailable):
        AmdSmiBackend().enumerate()


@pytest.mark.skipif(
    Path("/opt/rocm/lib/libamd_smi.so").exists() or Path("/opt/rocm").exists(),
    reason="this machine has ROCm",
)
def test_amdsmi_available_is_false_on_this_machine() -> None:
    assert amdsmi_available() is False


def test_amdsmi_available_finds_the_library(tmp_path: Path) -> None:
    no_cache = tmp_path / "no-ld.so.cache"
    assert amdsmi_available({}, default_dirs=(), ld_cache=no_cache) is False
    (tmp_path / "rocm" / "lib").mkdir(parents=True)
    (tmp_path / "rocm" / "lib" / "libamd_smi.so").write_bytes(b"")
    assert amdsmi_available({"ROCM_PATH": str(tmp_path / "rocm")}, default_dirs=(), ld_cache=no_cache)
    assert amdsmi_available({}, default_dirs=(str(tmp_path / "rocm" / "lib"),), ld_cache=no_cache)
    cache = tmp_path / "ld.so.cache"
    cache.write_bytes(b"\x00glibc-ld.so.cache1.1\x00libamd_smi.so.25\x00/opt/rocm-7.0.2/lib/libamd_smi.so\x00")
    assert amdsmi_available({}, default_dirs=(), ld_cache=cache)


# ---------------------------------------------------------------------------------------------
# events
# ---------------------------------------------------------------------------------------------


class Sink:
    def __init__(self, fail_first: bool = False) -> None:
        self.events: list[DeviceEvent] = []
        self.cv = threading.Condition()
        self.fail_first = fail_first

    def __call__(self, ev: DeviceEvent) -> None:
        with self.cv:
            self.events.append(ev)
            self.cv.notify_all()
        if self.fail_first and len(self.events) == 1:
            raise RuntimeError("sink bug")

    def wait_for(self, n: int, timeout: float = 5.0) -> list[DeviceEvent]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.events) >= n, timeout), self.events
            return list(self.events)


def test_reset_events_are_delivered(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    sink = Sink()
    backend.start_events(sink)
    # every device registered for exactly PRE_RESET and POST_RESET (bits type-1)
    expected_mask = (1 << (fake.EVT_GPU_PRE_RESET - 1)) | (1 << (fake.EVT_GPU_POST_RESET - 1))
    assert wait_until(lambda: len(node.event_masks) == 6)
    assert set(node.event_masks.values()) == {expected_mask}

    node.post_event(GPU1, fake.EVT_GPU_PRE_RESET, "ring gfx_0.0.0 timeout")
    node.post_event(CPX + "%012x" % 2, fake.EVT_GPU_POST_RESET, "reset done")
    events = sink.wait_for(2)

    assert events[0].uuid == GPU1 and events[0].kind is EventKind.RAS and events[0].code == fake.EVT_GPU_PRE_RESET
    assert "ring gfx_0.0.0 timeout" in events[0].detail
    assert events[1].uuid == CPX + "%012x" % 2 and events[1].kind is EventKind.RESET


def test_post_reset_triggers_rescan(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    backend.enumerate()
    before = node.call_count("amdsmi_get_gpu_device_uuid", GPU0)
    sink = Sink()
    backend.start_events(sink)
    node.gpu(GPU0).market_name = "AMD Instinct MI325X"
    node.post_event(GPU0, fake.EVT_GPU_POST_RESET, "")
    sink.wait_for(1)
    assert by_uuid(backend.enumerate())[GPU0].model == "AMD Instinct MI325X"
    assert node.call_count("amdsmi_get_gpu_device_uuid", GPU0) > before


def test_failing_sink_does_not_stop_the_reader(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    sink = Sink(fail_first=True)
    backend.start_events(sink)
    node.post_event(GPU0, fake.EVT_GPU_PRE_RESET, "first")
    sink.wait_for(1)
    node.post_event(GPU0, fake.EVT_GPU_POST_RESET, "second")
    assert [e.kind for e in sink.wait_for(2)] == [EventKind.RAS, EventKind.RESET]


def test_event_read_errors_are_survived(backend: AmdSmiBackend, node: FakeAmdSmiNode) -> None:
    node.fail("amdsmi_get_gpu_event_notification", Status.IO)
    sink = Sink()
    backend.start_events(sink)
    assert wait_until(lambda: node.call_count("amdsmi_get_gpu_event_notification") >= 2)
    node.clear_failure("amdsmi_get_gpu_event_notification")
    node.post_event(GPU0, fake.EVT_GPU_PRE_RESET, "after errors")
    assert sink.wait_for(1)[0].uuid == GPU0


def test_close_stops_events_and_shuts_down(node: FakeAmdSmiNode) -> None:
    b = AmdSmiBackend(event_poll_ms=20)
    b.open()
    b.start_events(Sink())
    thread = b._events.thread
    assert thread is not None and thread.is_alive()
    b.close()
    assert not thread.is_alive()
    assert node.stopped_events == {d.uuid for d in node.gpus}
    assert node.shut_down_calls == 1 and not node.initialized


# ---------------------------------------------------------------------------------------------
# pure conversions
# ---------------------------------------------------------------------------------------------


def test_conversions() -> None:
    assert percent_to_ratio("N/A") is None
    assert percent_to_ratio(101) is None
    assert percent_to_ratio(100) == 1.0
    assert energy_joules(2_000_000, 15.259) == pytest.approx(30.518)
    assert energy_joules("N/A", 15.259) is None
    assert socket_power_watts({"current_socket_power": "N/A", "average_socket_power": 0, "socket_power": 95}) == 95.0
    assert socket_power_watts({"current_socket_power": "N/A", "average_socket_power": "N/A", "socket_power": "N/A"}) is None
