"""A fake ``libamd_smi.so`` so that the real ``amdsmi`` Python package runs without ROCm.

``amdsmi.amdsmi_wrapper`` loads the C library with ``ctypes.CDLL`` at import time and binds
~184 symbols eagerly (``lib.amdsmi_x`` plus ``restype``/``argtypes`` assignments). This module
hands it a pure-Python stand-in instead: attribute access yields a :class:`_CFunction` for any
symbol name, and calling it dispatches to a ``_c_<symbol>`` method of the *current*
:class:`FakeAmdSmiNode`. Everything above the C boundary - ``amdsmi_interface``'s struct
handling, ``_check_res``, the exception classes, ``AmdSmiEventReader`` - is amdsmi's own code.

The C side is emulated faithfully where it matters: out-parameters arrive as ``ctypes.byref``
objects (written through ``._obj``), arrays and string buffers arrive as themselves, the BDF is
written as the packed uint64 bitfield the C library produces, and every status is a plain
``amdsmi_status_t`` integer. Symbols the node does not implement return
``AMDSMI_STATUS_NOT_SUPPORTED`` (2), as a real library does for a feature an ASIC lacks.

Because the wrapper keeps references to the ``_CFunction`` objects forever, the library object
is a process-wide singleton (:data:`FAKE_LIB`) and tests swap its ``node`` to change the
devices, inject failures and hangs, without re-importing amdsmi.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FAKE_LIB",
    "FakeAmdGpu",
    "FakeAmdSmiLibrary",
    "FakeAmdSmiNode",
    "FakeMemoryPool",
    "FakeProcess",
    "Status",
    "cpx_gpu",
    "detach_node",
    "import_amdsmi",
    "mi300x_cpx_amdsmi_7_0",
    "unloadable_amdsmi",
]

LIB_NAME = "libamd_smi.so"
_AMDSMI_MODULES = ("amdsmi", "amdsmi.")


class Status:
    """``amdsmi_status_t`` values, as in amdsmi_wrapper.py 7.0.2 (kept here so the fake does not
    need amdsmi imported to be constructed)."""

    SUCCESS = 0
    INVAL = 1
    NOT_SUPPORTED = 2
    TIMEOUT = 8
    RETRY = 9
    NO_PERM = 10
    IO = 12
    OUT_OF_RESOURCES = 15
    NOT_FOUND = 31
    NOT_INIT = 32
    INSUFFICIENT_SIZE = 41
    NO_DATA = 40
    DRIVER_NOT_LOADED = 34
    UNKNOWN_ERROR = 0xFFFFFFFF


# amdsmi_wrapper enum values used below
PROCESSOR_TYPE_AMD_GPU = 1
MEM_TYPE_VRAM = 0
TEMP_EDGE, TEMP_HOTSPOT, TEMP_VRAM = 0, 1, 2
TEMP_CURRENT = 0
CLK_GFX, CLK_MEM = 0, 4
EVT_GPU_PRE_RESET, EVT_GPU_POST_RESET = 3, 4
NA16 = 0xFFFF


@dataclass
class FakeProcess:
    pid: int
    name: str = "python3"
    vram_bytes: int = 0


@dataclass
class FakeMemoryPool:
    """VRAM that several processor handles report as theirs: amdsmi 7.0.x reports an MI300X's
    whole NPS1 pool, total and in use, on every one of its compute partitions."""

    total: int
    used: int = 0


@dataclass
class FakeAmdGpu:
    """One processor handle: a full GPU, or one compute partition of a GPU.

    The fake's controls (``fail``, ``hang``, ``call_count``, ``post_event``) address a handle by
    its ``key``: its uuid, or its ``label`` where amdsmi gives several handles one uuid."""

    uuid: str
    bdf: str = "0000:03:00.0"  # dddd:bb:dd.f
    market_name: str = "AMD Instinct MI300X"
    card: int | None = 0
    render: int | None = 128
    driver_version: str = "6.10.5"
    asic_serial: str = "A1B2C3D4E5F60718"  # hex, as the C library reports it
    vram_total: int = 192 * 1024**3  # bytes
    vram_used: int = 0  # bytes
    gfx_activity: int = 0  # %  (0xFFFF = N/A)
    umc_activity: int = 0  # %
    mm_activity: int = 0  # %
    socket_power: int = 0  # W
    current_socket_power: int = NA16  # W, MI300+
    average_socket_power: int = NA16  # W, MI200 and earlier
    energy_accumulator: int = 0  # counts
    energy_resolution: float = 15.259  # microjoules per count
    temperatures: dict[int, int] = field(default_factory=lambda: {TEMP_EDGE: 40, TEMP_HOTSPOT: 50, TEMP_VRAM: 45})
    clocks_mhz: dict[int, int] = field(default_factory=lambda: {CLK_GFX: 2100, CLK_MEM: 1300})
    ecc_correctable: int = 0
    ecc_uncorrectable: int = 0
    ecc_deferred: int = 0
    pcie_replay: int = 0
    metrics_pcie_replay: int | None = None  # gpu_metrics pcie_replay_count_acc; None = no metrics table
    compute_partition: str = "SPX"
    memory_partition: str = "NPS1"
    #: what amdsmi_get_gpu_compute_partition / _memory_partition return on this handle: amdsmi
    #: 7.0.x answers them on a GPU's first partition only (ROCm/rocm-systems#8491)
    partition_query_status: int = Status.SUCCESS
    partition_id: int = 0
    pool: FakeMemoryPool | None = None  # shared VRAM reported instead of vram_total/vram_used
    label: str = ""
    processes: list[FakeProcess] = field(default_factory=list)
    #: C symbols that answer NOT_SUPPORTED on this device
    unsupported: set[str] = field(default_factory=set)
    processor_type: int = PROCESSOR_TYPE_AMD_GPU

    @property
    def key(self) -> str:
        return self.label or self.uuid

    def bdf_parts(self) -> tuple[int, int, int, int]:
        dom, bus, rest = self.bdf.split(":")
        dev, fn = rest.split(".")
        return int(dom, 16), int(bus, 16), int(dev, 16), int(fn, 16)


def cpx_gpu(uuid_prefix: str, bdf: str, partitions: int = 4, **kw: Any) -> list[FakeAmdGpu]:
    """A physical GPU in CPX mode: ``partitions`` handles sharing domain:bus:device, the partition
    id in the function bits (how amdsmi reports MI300 partitions), one DRM node each."""
    base = bdf.rsplit(".", 1)[0]
    card0 = kw.pop("card", 1)
    render0 = kw.pop("render", 129)
    vram_total = kw.pop("vram_total", 192 * 1024**3 // partitions)
    return [
        FakeAmdGpu(
            uuid=f"{uuid_prefix}{p:012x}",
            bdf=f"{base}.{p}",
            card=card0 + p,
            render=render0 + p,
            compute_partition="CPX",
            partition_id=p,
            vram_total=vram_total,
            **kw,
        )
        for p in range(partitions)
    ]


def mi300x_cpx_amdsmi_7_0(
    uuid: str, bdf: str, *, partitions: int = 8, card: int = 1, render: int = 128, pool_bytes: int = 192 * 1024**3, **kw: Any
) -> list[FakeAmdGpu]:
    """An MI300X in CPX + NPS1 as amdsmi 7.0.x reports it (the handles of one GPU, partition 0
    first): every partition has the same uuid (amdsmi_get_gpu_device_uuid is made from the
    GPU's serial and device id, without the partition: the partition id joins it upstream only
    for ROCm 7.12, ROCm/rocm-systems#3977); the compute- and memory-partition queries answer
    only on partition 0, the others return NOT_SUPPORTED (ROCm/rocm-systems#8491); and every
    partition reports the whole shared memory pool as its VRAM, total and in use. The
    partition id sits in the BDF's function bits; each partition has its own DRM nodes."""
    base = bdf.rsplit(".", 1)[0]
    pool = FakeMemoryPool(total=pool_bytes)
    return [
        FakeAmdGpu(
            uuid=uuid,
            label=f"{base}.{p}",
            bdf=f"{base}.{p}",
            card=card + p,
            render=render + p,
            compute_partition="CPX",
            memory_partition="NPS1",
            partition_query_status=Status.SUCCESS if p == 0 else Status.NOT_SUPPORTED,
            partition_id=p,
            pool=pool,
            **kw,
        )
        for p in range(partitions)
    ]


def _obj(ref: Any) -> Any:
    """The ctypes object behind a ``byref()`` argument (or the object itself)."""
    return getattr(ref, "_obj", ref)


def _handle_value(arg: Any) -> int | None:
    if isinstance(arg, ctypes.c_void_p):
        return arg.value
    return None


class FakeAmdSmiNode:
    """The devices and behaviour behind the fake library. Swap ``FAKE_LIB.node`` per test."""

    def __init__(self, gpus: list[FakeAmdGpu] | None = None) -> None:
        self.gpus: list[FakeAmdGpu] = list(gpus or [])
        self.lock = threading.Lock()
        self.calls: Counter[tuple[str, str | None]] = Counter()
        self._failures: dict[tuple[str, str | None], int] = {}
        self._hangs: dict[tuple[str, str | None], threading.Event] = {}
        self.init_status = Status.SUCCESS
        self.initialized = False
        self.shut_down_calls = 0
        self.event_masks: dict[str, int] = {}
        self.stopped_events: set[str] = set()
        self._events: list[tuple[str, int, str]] = []
        self._events_cv = threading.Condition(self.lock)
        self._assign_handles()

    # -- handles --------------------------------------------------------------------------------
    def _assign_handles(self) -> None:
        """Handles are opaque non-NULL pointers. One socket per physical GPU (domain:bus:device),
        holding all of its partitions, as amdsmi groups them."""
        self._by_handle: dict[int, FakeAmdGpu] = {}
        self._handle_of: dict[str, int] = {}
        self._sockets: dict[int, list[int]] = {}
        socket_of_key: dict[tuple[int, int, int], int] = {}
        for i, gpu in enumerate(self.gpus):
            h = 0x1000 + 0x10 * i
            self._by_handle[h] = gpu
            self._handle_of[gpu.key] = h
            key = gpu.bdf_parts()[:3]
            if key not in socket_of_key:
                socket_of_key[key] = 0x9000 + 0x10 * len(socket_of_key)
            self._sockets.setdefault(socket_of_key[key], []).append(h)

    def gpu(self, key: str) -> FakeAmdGpu:
        for g in self.gpus:
            if g.key == key:
                return g
        raise KeyError(key)

    def handle_of(self, key: str) -> int:
        return self._handle_of[key]

    # -- test controls --------------------------------------------------------------------------
    def fail(self, symbol: str, status: int, uuid: str | None = None) -> None:
        """Make ``symbol`` return ``status`` (for one device, or for every call when uuid is None).
        ``uuid`` here and below is the device's ``key``: its uuid unless it has a label."""
        self._failures[(symbol, uuid)] = status

    def clear_failure(self, symbol: str, uuid: str | None = None) -> None:
        self._failures.pop((symbol, uuid), None)

    def hang(self, symbol: str, uuid: str | None = None) -> threading.Event:
        """Make ``symbol`` block until the returned event is set (a wedged driver call)."""
        ev = threading.Event()
        self._hangs[(symbol, uuid)] = ev
        return ev

    def release_all(self) -> None:
        for ev in self._hangs.values():
            ev.set()
        self._hangs.clear()

    def call_count(self, symbol: str, uuid: str | None = None) -> int:
        with self.lock:
            return self.calls[(symbol, uuid)]

    def post_event(self, uuid: str, event_type: int, message: str = "") -> None:
        """Queue a KFD event notification, as the driver would after a reset."""
        with self._events_cv:
            self._events.append((uuid, event_type, message))
            self._events_cv.notify_all()

    # -- dispatch -------------------------------------------------------------------------------
    def dispatch(self, symbol: str, args: tuple) -> int:
        h = _handle_value(args[0]) if args else None
        gpu = self._by_handle.get(h) if h is not None else None
        uuid = gpu.key if gpu is not None else None
        with self.lock:
            self.calls[(symbol, uuid)] += 1
        ev = self._hangs.get((symbol, uuid)) or self._hangs.get((symbol, None))
        if ev is not None:
            # Bounded so a test that forgets to release cannot wedge the interpreter at exit.
            ev.wait(60)
        status = self._failures.get((symbol, uuid), self._failures.get((symbol, None)))
        if status is not None:
            return status
        if gpu is not None and symbol in gpu.unsupported:
            return Status.NOT_SUPPORTED
        impl = getattr(self, "_c_" + symbol, None)
        if impl is None:
            return Status.NOT_SUPPORTED
        if h is not None and gpu is None and symbol not in ("amdsmi_get_processor_handles",):
            return Status.INVAL  # a handle the library never handed out
        return impl(gpu, *args)

    # -- C functions ----------------------------------------------------------------------------
    # Each takes the resolved gpu (or None) followed by the raw C arguments.

    def _c_amdsmi_init(self, _gpu: None, _flags: Any) -> int:
        if self.init_status == Status.SUCCESS:
            self.initialized = True
        return self.init_status

    def _c_amdsmi_shut_down(self, _gpu: None) -> int:
        self.initialized = False
        self.shut_down_calls += 1
        return Status.SUCCESS

    def _fill_handles(self, count_ref: Any, out: Any, handles: list[int]) -> int:
        count = _obj(count_ref)
        if isinstance(out, ctypes.Array):
            if count.value < len(handles):
                count.value = len(handles)
                return Status.INSUFFICIENT_SIZE
            for i, h in enumerate(handles):
                out[i] = h
        count.value = len(handles)
        return Status.SUCCESS

    def _c_amdsmi_get_socket_handles(self, _gpu: None, count_ref: Any, out: Any) -> int:
        if not self.initialized:
            return Status.NOT_INIT
        return self._fill_handles(count_ref, out, list(self._sockets))

    def _c_amdsmi_get_processor_handles(self, _gpu: None, socket: Any, count_ref: Any, out: Any) -> int:
        handles = self._sockets.get(socket.value)
        if handles is None:
            return Status.INVAL
        return self._fill_handles(count_ref, out, handles)

    def _c_amdsmi_get_processor_type(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        _obj(out).value = gpu.processor_type
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_device_bdf(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        dom, bus, dev, fn = gpu.bdf_parts()
        # amdsmi_bdf_t: function:3 | device:5 | bus:8 | domain:48, packed little-endian in a uint64
        _obj(out).as_uint = (fn & 0x7) | ((dev & 0x1F) << 3) | ((bus & 0xFF) << 8) | (dom << 16)
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_device_uuid(self, gpu: FakeAmdGpu, _h: Any, len_ref: Any, buf: Any) -> int:
        raw = gpu.uuid.encode()
        length = _obj(len_ref)
        if len(raw) + 1 > length.value:
            length.value = len(raw) + 1
            return Status.INSUFFICIENT_SIZE
        buf.value = raw
        length.value = len(raw)
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_enumeration_info(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        info = _obj(out)
        info.drm_card = 0xFFFFFFFF if gpu.card is None else gpu.card
        info.drm_render = 0xFFFFFFFF if gpu.render is None else gpu.render
        info.hsa_id = self.gpus.index(gpu) + 1
        info.hip_id = self.gpus.index(gpu)
        info.hip_uuid = ("GPU-" + gpu.uuid[-16:]).encode()
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_asic_info(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        info = _obj(out)
        info.market_name = gpu.market_name.encode()
        info.vendor_id = 0x1002
        info.vendor_name = b"Advanced Micro Devices Inc. [AMD/ATI]"
        info.subvendor_id = 0x1002
        info.device_id = 0x74A1
        info.rev_id = 0
        info.asic_serial = gpu.asic_serial.encode()
        info.oam_id = self.gpus.index(gpu)
        info.num_of_compute_units = 304
        info.target_graphics_version = 0x942
        info.subsystem_id = 0x74A1
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_driver_info(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        info = _obj(out)
        info.driver_name = b"amdgpu"
        info.driver_version = gpu.driver_version.encode()
        info.driver_date = b"2015/01/01 00:00"
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_kfd_info(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        info = _obj(out)
        info.kfd_id = 0x1000 + self.gpus.index(gpu)
        info.node_id = self.gpus.index(gpu) + 1
        info.current_partition_id = gpu.partition_id
        return Status.SUCCESS

    @staticmethod
    def _string_out(value: str, buf: Any, length: Any) -> int:
        raw = value.encode()
        if len(raw) + 1 > int(getattr(length, "value", length)):
            return Status.INSUFFICIENT_SIZE
        buf.value = raw
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_compute_partition(self, gpu: FakeAmdGpu, _h: Any, buf: Any, length: Any) -> int:
        if gpu.partition_query_status != Status.SUCCESS:
            return gpu.partition_query_status
        return self._string_out(gpu.compute_partition, buf, length)

    def _c_amdsmi_get_gpu_memory_partition(self, gpu: FakeAmdGpu, _h: Any, buf: Any, length: Any) -> int:
        if gpu.partition_query_status != Status.SUCCESS:
            return gpu.partition_query_status
        return self._string_out(gpu.memory_partition, buf, length)

    def _c_amdsmi_get_gpu_memory_total(self, gpu: FakeAmdGpu, _h: Any, mem_type: Any, out: Any) -> int:
        if int(mem_type) != MEM_TYPE_VRAM:
            return Status.NOT_SUPPORTED
        _obj(out).value = gpu.pool.total if gpu.pool is not None else gpu.vram_total
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_memory_usage(self, gpu: FakeAmdGpu, _h: Any, mem_type: Any, out: Any) -> int:
        if int(mem_type) != MEM_TYPE_VRAM:
            return Status.NOT_SUPPORTED
        _obj(out).value = gpu.pool.used if gpu.pool is not None else gpu.vram_used
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_activity(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        u = _obj(out)
        u.gfx_activity, u.umc_activity, u.mm_activity = gpu.gfx_activity, gpu.umc_activity, gpu.mm_activity
        return Status.SUCCESS

    def _c_amdsmi_get_power_info(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        p = _obj(out)
        p.socket_power = gpu.socket_power
        p.current_socket_power = gpu.current_socket_power
        p.average_socket_power = gpu.average_socket_power
        p.gfx_voltage = p.soc_voltage = p.mem_voltage = NA16
        p.power_limit = 750
        return Status.SUCCESS

    def _c_amdsmi_get_energy_count(self, gpu: FakeAmdGpu, _h: Any, acc: Any, res: Any, ts: Any) -> int:
        _obj(acc).value = gpu.energy_accumulator
        _obj(res).value = gpu.energy_resolution
        _obj(ts).value = 123456789
        return Status.SUCCESS

    def _c_amdsmi_get_temp_metric(self, gpu: FakeAmdGpu, _h: Any, sensor: Any, metric: Any, out: Any) -> int:
        if int(metric) != TEMP_CURRENT or int(sensor) not in gpu.temperatures:
            return Status.NOT_SUPPORTED
        _obj(out).value = gpu.temperatures[int(sensor)]
        return Status.SUCCESS

    def _c_amdsmi_get_clock_info(self, gpu: FakeAmdGpu, _h: Any, clk_type: Any, out: Any) -> int:
        mhz = gpu.clocks_mhz.get(int(clk_type))
        if mhz is None:
            return Status.NOT_SUPPORTED
        c = _obj(out)
        c.clk, c.min_clk, c.max_clk, c.clk_locked, c.clk_deep_sleep = mhz, 100, 2100, 0, 0
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_total_ecc_count(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        e = _obj(out)
        e.correctable_count, e.uncorrectable_count, e.deferred_count = (
            gpu.ecc_correctable,
            gpu.ecc_uncorrectable,
            gpu.ecc_deferred,
        )
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_pci_replay_counter(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        _obj(out).value = gpu.pcie_replay
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_metrics_info(self, gpu: FakeAmdGpu, _h: Any, out: Any) -> int:
        if gpu.metrics_pcie_replay is None:
            return Status.NOT_SUPPORTED
        # Only the field the backend uses is filled; the rest of the table stays zeroed.
        _obj(out).pcie_replay_count_acc = gpu.metrics_pcie_replay
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_process_list(self, gpu: FakeAmdGpu, _h: Any, max_ref: Any, out: Any) -> int:
        count = _obj(max_ref)
        procs = gpu.processes
        if len(procs) > count.value:
            count.value = len(procs)
            return Status.OUT_OF_RESOURCES
        for i, p in enumerate(procs):
            out[i].name = p.name.encode()
            out[i].pid = p.pid
            out[i].mem = p.vram_bytes
            out[i].memory_usage.vram_mem = p.vram_bytes
            out[i].cu_occupancy = 0xFFFFFFFF
        count.value = len(procs)
        return Status.SUCCESS

    # -- events ---------------------------------------------------------------------------------
    def _c_amdsmi_init_gpu_event_notification(self, gpu: FakeAmdGpu, _h: Any) -> int:
        with self.lock:
            self.event_masks.setdefault(gpu.key, 0)
            self.stopped_events.discard(gpu.key)
        return Status.SUCCESS

    def _c_amdsmi_set_gpu_event_notification_mask(self, gpu: FakeAmdGpu, _h: Any, mask: Any) -> int:
        with self.lock:
            if gpu.key not in self.event_masks:
                return Status.NOT_INIT  # init_gpu_event_notification first
            self.event_masks[gpu.key] = int(getattr(mask, "value", mask))
        return Status.SUCCESS

    def _c_amdsmi_stop_gpu_event_notification(self, gpu: FakeAmdGpu, _h: Any) -> int:
        with self.lock:
            self.event_masks.pop(gpu.key, None)
            self.stopped_events.add(gpu.key)
            self._events_cv.notify_all()
        return Status.SUCCESS

    def _c_amdsmi_get_gpu_event_notification(self, _gpu: None, timeout_ms: Any, count_ref: Any, out: Any) -> int:
        """Global poll over every registered device: wait up to timeout_ms for a queued event
        whose type is in that device's mask; NO_DATA when none arrives (rocm_smi behaviour)."""
        timeout = int(getattr(timeout_ms, "value", timeout_ms)) / 1000.0
        count = _obj(count_ref)
        with self._events_cv:

            def deliverable() -> list[tuple[str, int, str]]:
                return [
                    e for e in self._events if self.event_masks.get(e[0], 0) & (1 << (e[1] - 1))
                ]

            self._events_cv.wait_for(lambda: bool(deliverable()) or not self.event_masks, timeout)
            ready = deliverable()[: count.value]
            for e in ready:
                self._events.remove(e)
        if not ready:
            count.value = 0
            return Status.NO_DATA
        for i, (key, etype, msg) in enumerate(ready):
            out[i].processor_handle = self._handle_of[key]
            out[i].event = etype
            out[i].message = msg.encode()[:255]
        count.value = len(ready)
        return Status.SUCCESS


class _CFunction:
    """What ``CDLL.__getattr__`` would return: callable, with settable restype/argtypes."""

    def __init__(self, lib: FakeAmdSmiLibrary, name: str) -> None:
        self._lib = lib
        self.__name__ = name
        self.restype: Any = ctypes.c_int
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        node = self._lib.node
        if node is None:
            return Status.NOT_SUPPORTED if self.restype is not None else None
        status = node.dispatch(self.__name__, args)
        return status if self.restype is not None else None


class FakeAmdSmiLibrary:
    """Stands in for ``ctypes.CDLL('libamd_smi.so')``."""

    def __init__(self, node: FakeAmdSmiNode | None = None) -> None:
        self._name = LIB_NAME
        self.node: FakeAmdSmiNode | None = node
        self._functions: dict[str, _CFunction] = {}

    def __getattr__(self, name: str) -> _CFunction:
        if name.startswith("_"):
            raise AttributeError(name)
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = _CFunction(self, name)
        return fn


#: The one library object amdsmi is bound to in this process (see module docstring).
FAKE_LIB = FakeAmdSmiLibrary()


def detach_node(lib: FakeAmdSmiLibrary = FAKE_LIB) -> None:
    """End a test's node: wake every call it holds hung, so no backend thread stays blocked in
    one, and take the node off the library (the next test attaches its own)."""
    node = lib.node
    if node is not None:
        node.release_all()
    lib.node = None


def _is_amdsmi_lib_path(name: Any) -> bool:
    return name is not None and os.path.basename(os.fspath(name)) == LIB_NAME


def _amdsmi_modules() -> dict[str, Any]:
    return {k: v for k, v in sys.modules.items() if k == "amdsmi" or k.startswith("amdsmi.")}


def _bound_to(lib: FakeAmdSmiLibrary) -> bool:
    wrapper = sys.modules.get("amdsmi.amdsmi_wrapper")
    return wrapper is not None and getattr(wrapper, "_libraries", {}).get(LIB_NAME) is lib


@contextlib.contextmanager
def _patched_cdll(replacement: Any) -> Iterator[None]:
    """Route ``ctypes.CDLL(<...>/libamd_smi.so)`` to ``replacement`` (an object, or an exception
    to raise); every other library loads normally."""
    real_cdll = ctypes.CDLL

    def cdll(name: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_amdsmi_lib_path(name):
            if isinstance(replacement, BaseException):
                raise replacement
            return replacement
        return real_cdll(name, *args, **kwargs)

    ctypes.CDLL = cdll  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        ctypes.CDLL = real_cdll  # type: ignore[misc]


def import_amdsmi(lib: FakeAmdSmiLibrary = FAKE_LIB) -> Any:
    """Import the real ``amdsmi`` package bound to ``lib`` and return it.

    Idempotent: once amdsmi is in ``sys.modules`` bound to ``lib`` it is reused, so the import
    (and the wrapper's 184 bindings) happens once per test session. An amdsmi imported against
    anything else is dropped and re-imported.
    """
    if _bound_to(lib):
        return sys.modules["amdsmi"]
    for name in _amdsmi_modules():
        del sys.modules[name]
    with _patched_cdll(lib):
        import amdsmi  # the point of this function
    return amdsmi


@contextlib.contextmanager
def unloadable_amdsmi() -> Iterator[None]:
    """Inside the block, ``import amdsmi`` behaves as on a machine without ROCm: the library
    cannot be loaded, amdsmi prints its complaint and raises KeyError. Previously imported
    amdsmi modules are put back afterwards."""
    saved = _amdsmi_modules()
    for name in saved:
        del sys.modules[name]
    try:
        with _patched_cdll(OSError(f"{LIB_NAME}: cannot open shared object file: No such file or directory")):
            yield
    finally:
        for name in _amdsmi_modules():
            del sys.modules[name]
        sys.modules.update(saved)
