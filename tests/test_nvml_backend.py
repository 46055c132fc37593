"""NvmlBackend through nvidia-ml-py's real ctypes wrappers, against a fake NVML library."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fakes.fake_nvml import (
    DRIVER_NOT_LOADED,
    GPU_IS_LOST,
    NOT_SUPPORTED,
    UNKNOWN,
    FakeGpu,
    FakeMig,
    FakeNvml,
    GiB,
    installed,
)
from kit_helpers import wait_until

from exporter.devices.base import BackendUnavailable
from exporter.devices.deadline import CallHung, DeadlineRunner
from exporter.devices.model import DeviceEvent, DeviceIdentity, EventKind, ReadError, RecoveryAction, Vendor
from exporter.devices.nvml import FIELD_IDS, NvmlBackend, mig_profile_from_name, mig_profile_from_size
from exporter.devices.nvml.abi import decode_batch

GPU0 = "GPU-0a6e4c3b-8a3d-4f34-9d5e-3f0f7d1c2b10"
GPU1 = "GPU-5c9f2d61-1e7b-4b8e-a0a4-6d2c9e8f7a21"
MIG_A = "MIG-7b2c1f0e-3d4a-5b6c-8d9e-0f1a2b3c4d5e"
MIG_B = "MIG-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718"
MIG_C = "MIG-9a8b7c6d-5e4f-3a2b-1c0d-e9f8a7b6c5d4"

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"

XID = pynvml.nvmlEventTypeXidCriticalError
MIG_CHANGE = pynvml.nvmlEventMigConfigChange


def busy_gpu(uuid: str = GPU0, **kw: Any) -> FakeGpu:
    base: dict[str, Any] = dict(
        pci_bus_id="00000000:3B:00.0",
        minor=0,
        serial="1650923000001",
        memory_used=3 * GiB,
        utilization_gpu=37,
        power_mw=245_500,
        energy_mj=12_345_678,
        temperature_c=61,
        sm_clock_mhz=1755,
        mem_clock_mhz=2619,
        clock_event_reasons=0x4,
        fields={3: 7, 4: 1, 29: 2, 30: 1, 31: 1, 142: 3, 143: 1, 144: 1, 145: 0, 94: 12, 230: 1, 82: 70},
        processes={1234: 2 * GiB, 5678: None},
    )
    base.update(kw)
    return FakeGpu(uuid, **base)


def idle_gpu(uuid: str = GPU1, **kw: Any) -> FakeGpu:
    base: dict[str, Any] = dict(pci_bus_id="00000000:AF:00.0", minor=1, serial="1650923000002", utilization_gpu=5, power_mw=71_000)
    base.update(kw)
    return FakeGpu(uuid, **base)


@pytest.fixture
def nvml() -> Iterator[Callable[..., tuple[FakeNvml, NvmlBackend]]]:
    """Factory: install a fake NVML with the given GPUs and open a backend on it."""
    stack = contextlib.ExitStack()
    backends: list[NvmlBackend] = []

    def start(gpus: list[FakeGpu], setup: Callable[[FakeNvml], None] | None = None, **kw: Any) -> tuple[FakeNvml, NvmlBackend]:
        fake = FakeNvml(gpus)
        if setup is not None:
            setup(fake)
        stack.enter_context(installed(fake))
        kw.setdefault("event_wait_ms", 50)
        kw.setdefault("lock_timeout_s", 0.2)
        backend = NvmlBackend(**kw)
        backend.open()
        backends.append(backend)
        return fake, backend

    yield start
    for b in backends:
        b.close()
    stack.close()


def by_uuid(devices: list[DeviceIdentity]) -> dict[str, DeviceIdentity]:
    return {d.uuid: d for d in devices}



# ---- open / enumerate -------------------------------------------------------------------------


def test_missing_library_is_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library(name: str, *args: Any, **kwargs: Any) -> None:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "CDLL", no_library)  # what dlopen does on a node without a driver
    with pytest.raises(BackendUnavailable, match="libnvidia-ml"):
        NvmlBackend().open()


def test_driver_not_loaded_is_backend_unavailable() -> None:
    with installed(FakeNvml([busy_gpu()], init_ret=DRIVER_NOT_LOADED)), pytest.raises(BackendUnavailable, match="driver is not loaded"):
        NvmlBackend().open()


def test_enumerates_two_gpus_with_normalised_bus_ids(nvml) -> None:
    fake, backend = nvml([busy_gpu(), idle_gpu()])
    devices = backend.enumerate()
    assert [d.uuid for d in devices] == [GPU0, GPU1]
    d0, d1 = devices
    assert d0 == DeviceIdentity(
        uuid=GPU0,
        vendor=Vendor.NVIDIA,
        model="NVIDIA H100 80GB HBM3",
        pci_bus_id="0000:3b:00.0",
        index=0,
        minor=0,
        driver_version="550.54.15",
        serial="1650923000001",
        memory_total_bytes=80 * GiB,
    )
    assert (d1.pci_bus_id, d1.index, d1.minor) == ("0000:af:00.0", 1, 1)
    assert backend.driver_version() == "550.54.15"
    # identity is cached: a second enumerate asks NVML nothing
    before = sum(fake.counts.values())
    assert backend.enumerate() == devices
    assert sum(fake.counts.values()) == before


# ---- reading ----------------------------------------------------------------------------------


def test_counters_come_from_one_field_values_call_per_device_in_base_units(nvml) -> None:
    fake, backend = nvml([busy_gpu(), idle_gpu()])
    d0, d1 = backend.enumerate()
    for cycle in range(2):
        readings = [backend.read(d0), backend.read(d1)]
        fake.advance()
        assert fake.calls_on(GPU0, "nvmlDeviceGetFieldValues") == cycle + 1
        assert fake.calls_on(GPU1, "nvmlDeviceGetFieldValues") == cycle + 1
    r0, r1 = readings
    assert sorted(fake.field_requests[GPU0][0]) == sorted(FIELD_IDS)
    assert r0.ok and r0.error is None
    assert r0.utilization_ratio == pytest.approx(0.37)
    assert r0.memory_used_bytes == 3 * GiB and r0.memory_total_bytes == 80 * GiB
    assert r0.power_watts == pytest.approx(245.5)
    assert r0.energy_joules == pytest.approx(12_345.678)
    assert r0.temperature_celsius == 61.0 and r0.memory_temperature_celsius == 70.0
    assert r0.sm_clock_hertz == 1755e6 and r0.memory_clock_hertz == 2619e6
    assert r0.clock_event_reasons == 0x4
    assert (r0.ecc_correctable_total, r0.ecc_uncorrectable_total) == (7, 1)
    assert (r0.retired_pages_total, r0.retired_pages_pending) == (3, True)
    assert (r0.remapped_rows_correctable, r0.remapped_rows_uncorrectable) == (3, 1)
    assert (r0.row_remap_pending, r0.row_remap_failure) == (True, False)
    assert r0.pcie_replay_total == 12
    assert r0.recovery_action is RecoveryAction.GPU_RESET
    assert r0.processes == {1234: 2 * GiB, 5678: None}
    assert r1.power_watts == pytest.approx(71.0) and r1.utilization_ratio == pytest.approx(0.05)
    assert r1.processes == {}
    # quantities that have a field id were not also fetched one by one
    for fn in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows"):
        assert fake.calls_on(GPU0, fn) == 0, fn


def test_slow_fields_are_asked_once_per_period_and_their_last_value_held_between(nvml) -> None:
    """The total-energy and PCIe-replay fields cost the driver milliseconds (measured on an
    H100): they ride in the batch once per period, and reads in between report the last value."""
    from exporter.devices.nvml import SLOW_FIELDS

    now = [1000.0]
    fake, backend = nvml([busy_gpu()], slow_counter_period_s=10.0, clock=lambda: now[0])
    (d0,) = backend.enumerate()
    first = backend.read(d0)
    assert SLOW_FIELDS <= set(fake.field_requests[GPU0][-1])
    fake.set_field(GPU0, 83, 20_000_000)  # the energy counter moves; nobody asks yet
    fake.set_field(GPU0, 94, 40)
    now[0] += 9.9
    held = backend.read(d0)
    assert not SLOW_FIELDS & set(fake.field_requests[GPU0][-1])
    assert 185 in fake.field_requests[GPU0][-1]  # the cheap fields are still read every time
    assert (held.energy_joules, held.pcie_replay_total) == (first.energy_joules, first.pcie_replay_total) == (pytest.approx(12_345.678), 12)
    now[0] += 0.1
    fresh = backend.read(d0)
    assert SLOW_FIELDS <= set(fake.field_requests[GPU0][-1])
    assert (fresh.energy_joules, fresh.pcie_replay_total) == (pytest.approx(20_000.0), 40)
    assert fake.calls_on(GPU0, "nvmlDeviceGetTotalEnergyConsumption") == 0


def test_slow_direct_calls_keep_the_same_period(nvml) -> None:
    """Without the batch, the direct energy and PCIe-replay calls (as slow as their fields on
    an H100) are asked once per period too."""
    now = [1000.0]
    fake, backend = nvml([busy_gpu()], setup=lambda f: f.remove_function("nvmlDeviceGetFieldValues"), slow_counter_period_s=10.0, clock=lambda: now[0])
    (d0,) = backend.enumerate()
    for _ in range(3):
        r = backend.read(d0)
        now[0] += 1.0
    assert r.energy_joules == pytest.approx(12_345.678) and r.pcie_replay_total == 12
    assert fake.calls_on(GPU0, "nvmlDeviceGetTotalEnergyConsumption") == 1
    assert fake.calls_on(GPU0, "nvmlDeviceGetPcieReplayCounter") == 1
    assert fake.calls_on(GPU0, "nvmlDeviceGetPowerUsage") == 3
    now[0] += 10.0
    backend.read(d0)
    assert fake.calls_on(GPU0, "nvmlDeviceGetTotalEnergyConsumption") == 2


THROTTLE_NS = {74: 12_500_000_000, 75: 0, 76: 0, 77: 250_000_000, 78: 3_000_000_000, 79: 0, 80: 15_750_000_000,
               81: 1_000}  # fmt: skip
THROTTLE_S = {"power": 12.5, "thermal": 0.0, "sync_boost": 0.0, "board_limit": 0.25, "low_utilization": 3.0,
              "reliability": 0.0, "total_app_clocks": 15.75, "total_base_clocks": 1e-6}  # fmt: skip


def test_throttle_time_per_reason_comes_from_the_perf_policy_fields_in_seconds_on_the_slow_schedule(nvml) -> None:
    """NVML's violation counters (ns since the driver loaded) ride in the batch with the slow
    fields: read once per period, the last value held in between, never asked one by one."""
    now = [1000.0]
    gpu = busy_gpu(fields={**busy_gpu().fields, **THROTTLE_NS, 76: None})  # no sync boost on this GPU
    fake, backend = nvml([gpu], slow_counter_period_s=10.0, clock=lambda: now[0])
    (d0,) = backend.enumerate()
    first = backend.read(d0)
    assert first.throttle_seconds == {k: v for k, v in THROTTLE_S.items() if k != "sync_boost"}
    assert set(THROTTLE_NS) - {76} <= set(fake.field_requests[GPU0][-1])
    fake.set_field(GPU0, 74, 20_000_000_000)
    now[0] += 5.0
    held = backend.read(d0)
    assert not set(THROTTLE_NS) & set(fake.field_requests[GPU0][-1])
    assert held.throttle_seconds["power"] == 12.5
    now[0] += 5.0
    assert backend.read(d0).throttle_seconds["power"] == 20.0
    assert 76 not in fake.field_requests[GPU0][-1]  # unsupported: not asked again
    # the unsupported field's direct equivalent was tried once (unsupported too), the others never
    assert fake.counts["nvmlDeviceGetViolationStatus"] == 1


def test_throttle_time_falls_back_to_the_deprecated_violation_call_without_the_batch(nvml) -> None:
    now = [1000.0]
    gpu = busy_gpu(fields={**busy_gpu().fields, **THROTTLE_NS})
    no_batch = lambda f: f.remove_function("nvmlDeviceGetFieldValues")  # noqa: E731
    fake, backend = nvml([gpu], setup=no_batch, slow_counter_period_s=10.0, clock=lambda: now[0])
    (d0,) = backend.enumerate()
    for _ in range(3):
        r = backend.read(d0)
        now[0] += 1.0
    assert r.throttle_seconds == THROTTLE_S
    assert fake.counts["nvmlDeviceGetViolationStatus"] == len(THROTTLE_NS)  # once each per period


def test_direct_calls_replace_the_batch_when_field_values_is_missing(nvml) -> None:
    fake, backend = nvml([busy_gpu()], setup=lambda f: f.remove_function("nvmlDeviceGetFieldValues"))
    (d0,) = backend.enumerate()
    r = backend.read(d0)
    assert r.ok
    assert r.power_watts == pytest.approx(245.5) and r.energy_joules == pytest.approx(12_345.678)
    assert (r.ecc_correctable_total, r.ecc_uncorrectable_total) == (7, 1)
    assert (r.retired_pages_total, r.retired_pages_pending) == (3, True)
    assert (r.remapped_rows_correctable, r.remapped_rows_uncorrectable, r.row_remap_pending) == (3, 1, True)
    assert r.pcie_replay_total == 12
    assert r.recovery_action is None and r.memory_temperature_celsius is None  # field-only quantities
    assert fake.calls_on(GPU0, "nvmlDeviceGetFieldValues") == 0


def test_power_and_energy_fall_back_to_direct_calls_when_their_fields_are_unsupported(nvml) -> None:
    gpu = busy_gpu(fields={185: None, 83: None})
    fake, backend = nvml([gpu], setup=lambda f: f.set_result(GPU0, "nvmlDeviceGetPowerUsage", 301_250))
    (d0,) = backend.enumerate()
    r = backend.read(d0)
    assert r.power_watts == pytest.approx(301.25)
    assert r.energy_joules == pytest.approx(12_345.678)
    backend.read(d0)
    assert 185 not in fake.field_requests[GPU0][1] and 83 not in fake.field_requests[GPU0][1]
    assert fake.calls_on(GPU0, "nvmlDeviceGetPowerUsage") == 2


@pytest.mark.parametrize(("code", "error"), [(GPU_IS_LOST, ReadError.LOST), (UNKNOWN, ReadError.UNKNOWN)])
def test_a_failed_gpu_does_not_affect_the_other(nvml, code: int, error: ReadError) -> None:
    fake, backend = nvml([busy_gpu(), idle_gpu()])
    d0, d1 = backend.enumerate()
    fake.fail(GPU0, "*", code)
    r0, r1 = backend.read(d0), backend.read(d1)
    assert not r0.ok and r0.error is error and r0.uuid == GPU0
    assert r0.power_watts is None
    assert r1.ok and r1.power_watts == pytest.approx(71.0)
    # a lost GPU stays enumerated (reported as failed, not vanished) after a rescan
    backend.invalidate()
    assert [d.uuid for d in backend.enumerate()] == [GPU0, GPU1]


def test_lost_gpu_reported_inside_the_field_values_batch(nvml) -> None:
    fake, backend = nvml([busy_gpu(), idle_gpu()])
    d0, d1 = backend.enumerate()
    fake.set_result(GPU0, "nvmlDeviceGetFieldValues", {str(f): {"ret": GPU_IS_LOST, "type": 3, "value": 0} for f in FIELD_IDS})
    assert backend.read(d0).error is ReadError.LOST
    assert backend.read(d1).ok


def test_unsupported_calls_and_fields_are_not_retried(nvml) -> None:
    def setup(f: FakeNvml) -> None:
        f.fail(GPU0, "nvmlDeviceGetUtilizationRates", NOT_SUPPORTED)
        f.set_field(GPU0, 230, None)
        f.remove_function("nvmlDeviceGetTemperatureV")  # an older driver: fall back to the old call

    fake, backend = nvml([busy_gpu(), idle_gpu()], setup=setup)
    d0, d1 = backend.enumerate()
    for _ in range(3):
        r0, r1 = backend.read(d0), backend.read(d1)
        assert r0.ok and r0.utilization_ratio is None and r0.recovery_action is None
        assert r0.temperature_celsius == 61.0 and r0.power_watts == pytest.approx(245.5)
        assert r1.utilization_ratio == pytest.approx(0.05) and r1.recovery_action is RecoveryAction.NONE
    assert fake.calls_on(GPU0, "nvmlDeviceGetUtilizationRates") == 1
    assert fake.calls_on(GPU1, "nvmlDeviceGetUtilizationRates") == 3
    assert [230 in ids for ids in fake.field_requests[GPU0]] == [True, False, False]
    assert all(230 in ids for ids in fake.field_requests[GPU1])
    assert fake.calls_on(GPU0, "nvmlDeviceGetTemperature") == 3
    assert fake.counts["nvmlDeviceGetTemperatureV"] == 0  # the symbol is missing: looked up, never called


def test_field_value_batch_is_decoded_by_value_type_from_pynvml_structures() -> None:
    """The batch is decoded from raw bytes at the offsets of pynvml's own struct: every
    NVML_VALUE_TYPE must come back as the value written through pynvml's union members."""
    members = {0: ("dVal", -2.5), 1: ("uiVal", 4_000_000_000), 2: ("ulVal", 2**63 + 5), 3: ("ullVal", 2**64 - 1), 4: ("sllVal", -(2**62)), 5: ("siVal", -7), 6: ("usVal", 65535)}
    arr = (pynvml.c_nvmlFieldValue_t * (len(members) + 2))()
    for i, (vtype, (member, value)) in enumerate(members.items()):
        arr[i].fieldId, arr[i].valueType, arr[i].nvmlReturn = 100 + i, vtype, 0
        setattr(arr[i].value, member, value)
    arr[7].valueType, arr[7].nvmlReturn = 3, NOT_SUPPORTED  # failed entry: no value
    arr[8].valueType, arr[8].nvmlReturn = 99, 0  # unknown value type: no value
    assert decode_batch(arr, len(arr)) == [(0, v) for _, v in members.values()] + [(NOT_SUPPORTED, None), (0, None)]


def test_unknown_device_reads_as_gone(nvml) -> None:
    _, backend = nvml([busy_gpu()])
    backend.enumerate()
    ghost = DeviceIdentity(uuid="GPU-ghost", vendor=Vendor.NVIDIA, model="x", pci_bus_id="", index=9)
    r = backend.read(ghost)
    assert not r.ok and r.error is ReadError.GONE


# ---- hangs ------------------------------------------------------------------------------------


def test_a_hung_call_is_contained_by_the_deadline_runner(nvml) -> None:
    fake, backend = nvml([busy_gpu(), idle_gpu()])
    d0, d1 = backend.enumerate()
    hang = fake.hang("nvmlDeviceGetUtilizationRates", uuid=GPU0)
    runner = DeadlineRunner()
    try:
        with pytest.raises(CallHung):
            runner.call(GPU0, lambda: backend.read(d0), timeout=0.2)
        assert hang.entered.wait(10)
        r1 = runner.call(GPU1, lambda: backend.read(d1), timeout=10)
        assert r1.ok and r1.utilization_ratio == pytest.approx(0.05)
        with pytest.raises(CallHung):  # the stuck lane fails fast instead of piling up threads
            runner.call(GPU0, lambda: backend.read(d0), timeout=10)
    finally:
        hang.release()
    wait_until(lambda: not runner.hung_lanes())
    assert runner.call(GPU0, lambda: backend.read(d0), timeout=10).ok
    runner.close()


def test_a_call_hung_inside_the_batch_lock_does_not_block_other_devices(nvml) -> None:
    fake, backend = nvml([busy_gpu(), busy_gpu(GPU1, pci_bus_id="00000000:AF:00.0")])
    d0, d1 = backend.enumerate()
    hang = fake.hang("nvmlDeviceGetFieldValues", uuid=GPU0)
    runner = DeadlineRunner()
    try:
        with pytest.raises(CallHung):
            runner.call(GPU0, lambda: backend.read(d0), timeout=0.2)
        assert hang.entered.wait(10)  # GPU0's lane now holds the field-values lock, stuck
        r1 = runner.call(GPU1, lambda: backend.read(d1), timeout=10)
        assert r1.ok
        # ... so GPU1 got its counters from the direct calls this cycle
        assert fake.calls_on(GPU1, "nvmlDeviceGetFieldValues") == 0
        assert (r1.ecc_correctable_total, r1.ecc_uncorrectable_total, r1.pcie_replay_total) == (7, 1, 12)
        assert r1.power_watts == pytest.approx(245.5)
    finally:
        hang.release()
    wait_until(lambda: not runner.hung_lanes())
    assert fake.calls_on(GPU1, "nvmlDeviceGetFieldValues") == 0
    r1 = runner.call(GPU1, lambda: backend.read(d1), timeout=10)
    assert fake.calls_on(GPU1, "nvmlDeviceGetFieldValues") == 1  # not remembered as unsupported
    assert r1.recovery_action is RecoveryAction.GPU_RESET
    runner.close()


# ---- MIG --------------------------------------------------------------------------------------


def mig_gpu(migs: list[FakeMig] | None = None, uuid: str = GPU0, **kw: Any) -> FakeGpu:
    if migs is None:
        migs = [
            FakeMig(MIG_A, gpu_instance_id=1, compute_instance_id=0, profile="1g.10gb", gi_profile_id=19,
                    placement_start=0, memory_total=10 * GiB, memory_used=1 * GiB, processes={4242: 512 * 1024**2}),
            FakeMig(MIG_B, gpu_instance_id=2, compute_instance_id=0, profile="3g.40gb", gi_profile_id=9,
                    slice_count=3, placement_start=4, placement_size=4, memory_total=40 * GiB, slot=2),
        ]  # fmt: skip
    return busy_gpu(uuid, mig_mode=True, migs=migs, **kw)


def test_mig_devices_are_enumerated_next_to_their_parent(nvml) -> None:
    fake, backend = nvml([mig_gpu(), idle_gpu()])
    devices = backend.enumerate()
    assert [d.uuid for d in devices] == [GPU0, MIG_A, MIG_B, GPU1]
    devs = by_uuid(devices)
    a, b = devs[MIG_A], devs[MIG_B]
    assert (a.parent_uuid, a.pci_bus_id, a.model) == (GPU0, "0000:3b:00.0", "NVIDIA H100 80GB HBM3")
    assert (a.mig_profile, a.gpu_instance_id, a.compute_instance_id, a.gi_profile_id, a.placement_start) == ("1g.10gb", 1, 0, 19, 0)
    assert (b.mig_profile, b.gpu_instance_id, b.gi_profile_id, b.placement_start, b.index) == ("3g.40gb", 2, 9, 4, 2)
    assert a.memory_total_bytes == 10 * GiB and a.is_partition and not devs[GPU0].is_partition

    ra, rp = backend.read(a), backend.read(devs[GPU0])
    assert ra.ok and ra.memory_used_bytes == 1 * GiB and ra.memory_total_bytes == 10 * GiB
    assert ra.processes == {4242: 512 * 1024**2}
    # physical quantities belong to the parent, utilization rates do not exist in MIG mode
    assert (ra.power_watts, ra.temperature_celsius, ra.sm_clock_hertz, ra.utilization_ratio) == (None, None, None, None)
    assert rp.ok and rp.power_watts == pytest.approx(245.5) and rp.utilization_ratio is None
    assert fake.calls_on(MIG_A, "nvmlDeviceGetFieldValues") == 0


def test_mig_reconfiguration_event_triggers_a_rescan(nvml) -> None:
    fake, backend = nvml([mig_gpu(), idle_gpu()])
    assert len(backend.enumerate()) == 4
    events: queue.Queue[DeviceEvent] = queue.Queue()
    backend.start_events(events.put)

    fake.set_migs(GPU0, [FakeMig(MIG_C, gpu_instance_id=0, profile="7g.80gb", gi_profile_id=0, slice_count=7, memory_total=80 * GiB)])
    assert backend.enumerate()[1].uuid == MIG_A  # nothing told us yet: cached layout
    assert fake.queue_event(GPU0, MIG_CHANGE) == 1
    ev = events.get(timeout=10)
    assert (ev.uuid, ev.kind) == (GPU0, EventKind.MIG_CONFIG_CHANGE)

    devices = backend.enumerate()
    assert [d.uuid for d in devices] == [GPU0, MIG_C, GPU1]
    assert devices[1].mig_profile == "7g.80gb" and devices[1].parent_uuid == GPU0
    assert backend.read(devices[1]).ok
    old = DeviceIdentity(uuid=MIG_A, vendor=Vendor.NVIDIA, model="", pci_bus_id="", index=0, parent_uuid=GPU0)
    assert backend.read(old).error is ReadError.GONE


def test_invalidate_and_stale_mig_handles_lead_to_a_rescan(nvml) -> None:
    fake, backend = nvml([mig_gpu()])
    devs = by_uuid(backend.enumerate())
    fake.set_migs(GPU0, [FakeMig(MIG_C, gpu_instance_id=5, profile="2g.20gb")])
    # the old MIG handle is dead: its read fails (not raises), and marks the layout stale
    r = backend.read(devs[MIG_A])
    assert not r.ok and r.error is ReadError.ERROR
    assert [d.uuid for d in backend.enumerate()] == [GPU0, MIG_C]

    fake.set_migs(GPU0, [FakeMig(MIG_A, gpu_instance_id=1), FakeMig(MIG_B, gpu_instance_id=2)])
    assert [d.uuid for d in backend.enumerate()] == [GPU0, MIG_C]  # cached
    backend.invalidate()
    assert [d.uuid for d in backend.enumerate()] == [GPU0, MIG_A, MIG_B]


def test_mig_profile_derivation() -> None:
    assert mig_profile_from_name("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb"
    assert mig_profile_from_name("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb") == "1c.3g.20gb"
    assert mig_profile_from_name("MIG 1g.10gb+me") == "1g.10gb+me"
    assert mig_profile_from_name("NVIDIA H100 80GB HBM3") == ""
    assert mig_profile_from_size(1, 4864) == "1g.5gb"
    assert mig_profile_from_size(3, 19968) == "3g.20gb"
    assert mig_profile_from_size(0, 100) == ""


# ---- GPM --------------------------------------------------------------------------------------

GPM_VALUES = {2: 55.0, 3: 20.0, 5: 12.5, 10: 30.0}


def test_gpm_ratios_appear_from_the_second_read(nvml) -> None:
    fake, backend = nvml([busy_gpu(gpm_supported=True, gpm=GPM_VALUES), idle_gpu()])
    d0, d1 = backend.enumerate()
    first = backend.read(d0)
    assert (first.sm_active_ratio, first.sm_occupancy_ratio, first.tensor_active_ratio, first.dram_active_ratio) == (None,) * 4
    fake.advance()
    second = backend.read(d0)
    assert second.sm_active_ratio == pytest.approx(0.55)
    assert second.sm_occupancy_ratio == pytest.approx(0.20)
    assert second.tensor_active_ratio == pytest.approx(0.125)
    assert second.dram_active_ratio == pytest.approx(0.30)
    fake.set_result(GPU0, "nvmlGpmMetricsGet:2", 80.0)
    assert backend.read(d0).sm_active_ratio == pytest.approx(0.80)
    assert fake.counts["nvmlGpmMetricsGet"] == 2
    assert fake.counts["nvmlGpmSampleAlloc"] == 2  # two rotating samples, allocated once
    r1 = backend.read(d1)
    assert r1.sm_active_ratio is None and fake.calls_on(GPU1, "nvmlGpmSampleGet") == 0


def test_gpm_on_mig_devices_samples_the_gpu_instance(nvml) -> None:
    migs = [FakeMig(MIG_A, gpu_instance_id=3, gpm={2: 40.0, 10: 15.0})]
    fake, backend = nvml([mig_gpu(migs, gpm_supported=True, gpm=GPM_VALUES)])
    devs = by_uuid(backend.enumerate())
    assert backend.read(devs[MIG_A]).sm_active_ratio is None
    r = backend.read(devs[MIG_A])
    assert r.sm_active_ratio == pytest.approx(0.40) and r.dram_active_ratio == pytest.approx(0.15)
    assert r.tensor_active_ratio is None  # metric not reported for this instance
    assert fake.calls_on(MIG_A, "nvmlGpmMigSampleGet") == 2
    backend.read(devs[GPU0])
    assert backend.read(devs[GPU0]).sm_active_ratio == pytest.approx(0.55)


# ---- events -----------------------------------------------------------------------------------


def test_xid_event_reaches_the_sink(nvml) -> None:
    # GPU1 supports no recovery-action events: the registration mask is intersected, not refused
    fake, backend = nvml([mig_gpu(), idle_gpu(supported_events=XID | pynvml.nvmlEventTypeDoubleBitEccError)])
    events: queue.Queue[DeviceEvent] = queue.Queue()
    backend.start_events(events.put)
    assert fake.queue_event(GPU1, XID, data=79) == 1
    ev = events.get(timeout=10)
    assert (ev.uuid, ev.kind, ev.code) == (GPU1, EventKind.XID, 79)

    fake.queue_event(MIG_B, XID, data=43)  # delivered on the parent with the instance ids
    ev = events.get(timeout=10)
    assert (ev.uuid, ev.kind, ev.code) == (MIG_B, EventKind.XID, 43)

    fake.queue_event(GPU0, pynvml.nvmlEventTypeGpuRecoveryAction, data=int(RecoveryAction.NODE_REBOOT))
    ev = events.get(timeout=10)
    assert (ev.uuid, ev.kind, ev.code) == (GPU0, EventKind.RECOVERY_ACTION, 2)

    fake.queue_event(GPU1, pynvml.nvmlEventTypeDoubleBitEccError)
    assert events.get(timeout=10).kind is EventKind.ECC_DBE


def test_event_wait_gpu_lost_probes_devices(nvml) -> None:
    fake, backend = nvml([busy_gpu(), idle_gpu()])
    events: queue.Queue[DeviceEvent] = queue.Queue()
    backend.start_events(events.put)
    fake.fail(GPU0, "*", GPU_IS_LOST)
    fake.queue_wait_error(GPU_IS_LOST)
    ev = events.get(timeout=10)
    assert (ev.uuid, ev.kind) == (GPU0, EventKind.GPU_LOST)
    fake.queue_event(GPU1, XID, data=31)
    ev = events.get(timeout=10)  # the next event: GPU1 was not reported lost
    assert (ev.uuid, ev.kind, ev.code) == (GPU1, EventKind.XID, 31)


def test_close_stops_the_event_thread_and_shuts_nvml_down(nvml) -> None:
    fake, backend = nvml([busy_gpu()])
    backend.start_events(lambda ev: None)
    thread = backend._events.thread
    assert thread is not None and thread.is_alive()
    backend.close()
    assert not thread.is_alive()
    assert fake.initialized == 0 and fake.event_sets() == []


# ---- recorded fixtures ------------------------------------------------------------------------

_UNSUPPORTED_RETS = {3, 4, 13, 25}


def _fixture_files() -> list[Path]:
    return sorted(FIXTURES.glob("*.json"))


class _Expect:
    """Independent statement of what a reading must say about raw NVML values (units!)."""

    def __init__(self, calls: dict[str, list[dict]]) -> None:
        self.calls = calls
        self.gone: set[str] = set()  # keys answered "unsupported" once: never asked again

    def raw(self, key: str, cycle: int, sticky: bool = True) -> Any:
        if key in self.gone:
            return None
        seq = self.calls.get(key)
        r = seq[min(cycle, len(seq) - 1)] if seq else {"ret": 3, "value": None}
        if sticky and r["ret"] in _UNSUPPORTED_RETS:
            self.gone.add(key)
        return r["value"] if r["ret"] == 0 else None

    def first(self, keys: list[str], cycle: int) -> Any:
        """Newest API first; the next one only once the newer is known unsupported."""
        for key in keys:
            if key in self.gone:
                continue
            value = self.raw(key, cycle)
            if key not in self.gone:
                return value
        return None

    def field(self, fid: int, cycle: int) -> Any:
        table = self.raw("nvmlDeviceGetFieldValues", cycle) or {}
        key = f"field:{fid}"
        entry = None if key in self.gone else table.get(str(fid))
        if entry is not None and entry["ret"] in _UNSUPPORTED_RETS | {2}:
            self.gone.add(key)
        return entry["value"] if entry is not None and entry["ret"] == 0 else None


def _expected(e: _Expect, cycle: int, is_mig: bool, gpm: bool) -> dict[str, Any]:
    exp: dict[str, Any] = {}
    mem = e.first(["nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo"], cycle)
    exp["memory_used_bytes"] = mem and mem["used"]
    exp["memory_total_bytes"] = mem and mem["total"]
    if not is_mig:
        util = e.raw("nvmlDeviceGetUtilizationRates", cycle)
        exp["utilization_ratio"] = None if util is None else util["gpu"] / 100
        exp["temperature_celsius"] = e.first(["nvmlDeviceGetTemperatureV:0", "nvmlDeviceGetTemperature:0"], cycle)
        sm, mc = e.raw("nvmlDeviceGetClockInfo:1", cycle), e.raw("nvmlDeviceGetClockInfo:2", cycle)
        exp["sm_clock_hertz"] = None if sm is None else sm * 1_000_000
        exp["memory_clock_hertz"] = None if mc is None else mc * 1_000_000
        exp["clock_event_reasons"] = e.first(
            ["nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"], cycle
        )
        energy = e.field(83, cycle)
        if energy is None and "field:83" in e.gone:
            energy = e.raw("nvmlDeviceGetTotalEnergyConsumption", cycle)
        exp["energy_joules"] = None if energy is None else energy / 1000
        power = e.field(185, cycle)
        if power is None and "field:185" in e.gone:
            power = e.raw("nvmlDeviceGetPowerUsage", cycle)
        exp["power_watts"] = None if power is None else power / 1000
        exp["memory_temperature_celsius"] = e.field(82, cycle)
        sbe, dbe = e.field(3, cycle), e.field(4, cycle)
        sbe_agg, dbe_agg = e.field(5, cycle), e.field(6, cycle)
        exp["ecc_correctable_total"] = sbe if sbe is not None else sbe_agg
        exp["ecc_uncorrectable_total"] = dbe if dbe is not None else dbe_agg
        retired = [v for v in (e.field(29, cycle), e.field(30, cycle)) if v is not None]
        exp["retired_pages_total"] = sum(retired) if retired else None
        pend = e.field(31, cycle)
        exp["retired_pages_pending"] = None if pend is None else bool(pend)
        exp["remapped_rows_correctable"] = e.field(142, cycle)
        exp["remapped_rows_uncorrectable"] = e.field(143, cycle)
        rp, rf = e.field(144, cycle), e.field(145, cycle)
        exp["row_remap_pending"] = None if rp is None else bool(rp)
        exp["row_remap_failure"] = None if rf is None else bool(rf)
        exp["pcie_replay_total"] = e.field(94, cycle)
        ra = e.field(230, cycle)
        exp["recovery_action"] = None if ra is None else RecoveryAction(ra)
    if gpm:
        for mid, attr in ((2, "sm_active_ratio"), (3, "sm_occupancy_ratio"), (5, "tensor_active_ratio"), (10, "dram_active_ratio")):
            v = e.raw(f"nvmlGpmMetricsGet:{mid}", cycle, sticky=False) if cycle > 0 else None
            exp[attr] = None if v is None else v / 100
    procs = e.raw("nvmlDeviceGetComputeRunningProcesses_v3", cycle) or []
    exp["processes"] = {p["pid"]: p["usedGpuMemory"] for p in procs}
    return exp


def test_fixture_directory_has_a_fixture() -> None:
    files = _fixture_files()
    assert files, f"no NVML fixtures in {FIXTURES}"
    sources = [json.loads(f.read_text())["source"] for f in files]
    assert all(isinstance(s, str) and s for s in sources)


@pytest.mark.parametrize("path", _fixture_files(), ids=lambda p: p.name)
def test_fixture_replays_into_readings_in_base_units(path: Path) -> None:
    fixture = json.loads(path.read_text())
    assert fixture["format"] == "dra-gpu-exporter/nvml-fixture/v1"
    replay(fixture)


def test_recorder_output_replays(tmp_path: Path) -> None:
    """bench/record_nvml_fixture.py, run against the fake library, writes a fixture that the
    replay reproduces: the recorder and the replay agree on the format."""
    spec = importlib.util.spec_from_file_location("record_nvml_fixture", Path(__file__).parents[1] / "bench" / "record_nvml_fixture.py")
    assert spec is not None and spec.loader is not None
    recorder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorder)
    fake = FakeNvml([busy_gpu(gpm_supported=True, gpm=GPM_VALUES), mig_gpu(uuid=GPU1, pci_bus_id="00000000:AF:00.0", gpm_supported=True)])
    out = tmp_path / "recorded.json"
    with installed(fake):
        assert recorder.main(["--out", str(out), "--cycles", "2", "--interval", "0", "--latency-calls", "3"]) == 0
    fixture = json.loads(out.read_text())
    assert fixture["source"].startswith("recorded on hardware") and fixture["cycles"] == 2
    gpu0 = fixture["devices"][0]
    assert gpu0["calls"]["nvmlDeviceGetSerial"][0]["value"] == "redacted-0"
    assert set(gpu0["latency_us"]["nvmlDeviceGetPowerUsage"]) == {"n", "min", "median", "p99"}
    assert "backend.read" in gpu0["latency_us"]
    assert len(fixture["devices"][1]["mig_devices"]) == 2
    replay(fixture)


def replay(fixture: dict) -> None:
    fake = FakeNvml.from_fixture(fixture)
    with installed(fake):
        # every cycle's recorded answer is checked, so the slow fields are asked on every read
        backend = NvmlBackend(event_wait_ms=50, slow_counter_period_s=0.0)
        backend.open()
        try:
            devices = by_uuid(backend.enumerate())
            expected_devices: list[tuple[dict, bool, bool]] = []
            for gpu in fixture["devices"]:
                gpm = bool(gpu["calls"].get("nvmlGpmQueryDeviceSupport", [{"value": 0}])[0]["value"])
                expected_devices.append((gpu, False, gpm))
                expected_devices += [(m, True, gpm) for m in gpu.get("mig_devices", [])]
            assert len(devices) == len(expected_devices)
            for dev, is_mig, _ in expected_devices:
                uuid = dev["calls"]["nvmlDeviceGetUUID"][0]["value"]
                ident = devices[uuid]
                assert ident.vendor is Vendor.NVIDIA and bool(ident.parent_uuid) == is_mig
                if not is_mig:
                    bus = dev["calls"]["nvmlDeviceGetPciInfo_v3"][0]["value"]["busId"]
                    assert ident.pci_bus_id == bus[-12:].lower()
                    assert ident.model == dev["calls"]["nvmlDeviceGetName"][0]["value"]
            expectations = {id(d): _Expect(d["calls"]) for d, _, _ in expected_devices}
            for cycle in range(int(fixture.get("cycles", 1))):
                fake.cycle = cycle
                for dev, is_mig, gpm in expected_devices:
                    uuid = dev["calls"]["nvmlDeviceGetUUID"][0]["value"]
                    reading = backend.read(devices[uuid])
                    assert reading.ok, (uuid, cycle, reading.error_detail)
                    for attr, want in _expected(expectations[id(dev)], cycle, is_mig, gpm).items():
                        got = getattr(reading, attr)
                        if isinstance(want, float):
                            assert got == pytest.approx(want), (uuid, cycle, attr)
                        else:
                            assert got == want, (uuid, cycle, attr)
        finally:
            backend.close()


def test_event_instance_ids_map_to_the_mig_device_or_stay_on_the_gpu(nvml) -> None:
    """(parent, GI, CI) -> that MIG device; a valid GI without a valid CI -> the GI's only MIG
    device, or the GPU when the GI has several compute instances; unknown ids -> the GPU."""
    migs = [
        FakeMig(MIG_A, gpu_instance_id=1, compute_instance_id=0, profile="1g.10gb", gi_profile_id=19, placement_start=0),
        FakeMig(MIG_B, gpu_instance_id=2, compute_instance_id=0, profile="2c.3g.40gb", gi_profile_id=9, slice_count=3, placement_start=4, placement_size=4, slot=2),
        FakeMig(MIG_C, gpu_instance_id=2, compute_instance_id=1, profile="1c.3g.40gb", gi_profile_id=9, slice_count=3, placement_start=4, placement_size=4, slot=3),
    ]  # fmt: skip
    fake, backend = nvml([mig_gpu(migs), idle_gpu()])
    backend.enumerate()
    events: queue.Queue[DeviceEvent] = queue.Queue()
    backend.start_events(events.put)
    none = 0xFFFFFFFF
    for gi, ci, want in [(2, 1, MIG_C), (2, 0, MIG_B), (1, none, MIG_A), (2, none, GPU0), (7, 0, GPU0), (none, none, GPU0)]:
        fake.queue_event(GPU0, XID, data=13, gpu_instance_id=gi, compute_instance_id=ci)
        ev = events.get(timeout=10)
        assert (ev.uuid, ev.code) == (want, 13), (gi, ci)


def test_field_value_decode_matches_pynvml_struct_access():
    """The batch decode reads c_nvmlFieldValue_t memory with precompiled structs (the speed of
    NvmlBackend.read); pynvml's own ctypes field access is the oracle, for every value type,
    non-success returns and unknown types (value None)."""
    import ctypes

    import pynvml

    from exporter.devices.nvml.abi import SUCCESS, decode_batch

    members = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    cases = [(0, 0, 3.25), (1, 0, 2**32 - 1), (2, 0, 2**63 + 5), (3, 0, 2**64 - 1), (4, 0, -(2**62)), (5, 0, -7), (6, 0, 65535), (1, 3, 9), (9, 0, 1)]
    arr = (pynvml.c_nvmlFieldValue_t * len(cases))()
    for entry, (vtype, ret, value) in zip(arr, cases, strict=True):
        entry.valueType, entry.nvmlReturn = vtype, ret
        ctypes.memset(ctypes.addressof(entry.value), 0xAB, ctypes.sizeof(entry.value))  # garbage in unused bytes
        if vtype in members:
            setattr(entry.value, members[vtype], value)
    want = []
    for entry, (vtype, ret, _) in zip(arr, cases, strict=True):
        raw = pynvml.c_nvmlFieldValue_t.from_buffer_copy(entry)
        want.append((ret, getattr(raw.value, members[vtype]) if ret == SUCCESS and vtype in members else None))
    assert decode_batch(arr, len(cases)) == want
    assert decode_batch(arr, 3) == want[:3]
