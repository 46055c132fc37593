"""Billing counters: energy and allocated device-time per claim and per pod, exact across cycles.

Fed each cycle's :class:`~exporter.model.snapshot.Snapshot` (and the per-process memory when
``--per-process`` is on), :class:`UsageAccountant` keeps running totals and hands back an
immutable :class:`Usage`. The join stays pure; this is the model layer's one piece of state
about the past, and it is small: a few floats per claim and pod, kept a while after they go.

**Time** is the cycle's monotonic instant (``Snapshot.monotonic``): a wall-clock step moves no
bill and no retention.

**What is counted.** Energy comes from the GPUs' own energy counters
(``DeviceReading.energy_joules``, ``gpu_energy_joules_total``), never from sampled power: every
increase of a physical GPU's counter is split between the holders of its devices, and the
holders' counters add up to exactly the increase. A counter that went *down* (driver reload, GPU
reset) restarted from 0, so its new value is the increase; a GPU that could not be read keeps
its last good value, and the increase over the gap is split when it reads again; the first
reading only sets the mark. Device-time is allocation: every second a device is held counts,
busy or not.

**Who gets an interval.** The holders of the devices at the *start* of the interval: what a
cycle observed stays in effect until the next cycle observes otherwise. So a claim seen by a
single cycle still gets the interval that follows it, even if it is gone before the next scrape,
and every new claim's counters start at 0.

**Which interval an energy increase belongs to.** The driver updates some counters only every
few seconds (the NVML backend re-reads energy every ``slow_counter_period_s``, 10 s), so one
increase can cover many cycles with different holders. It is split over the intervals since the
counter last moved, each by its length times the GPU's power measured at its end (NVML's power
is an average over the second before the reading), and each interval's part between that
interval's holders. A cycle without a power reading counts the last one; with no power at all
the split is by time. An unchanged counter is one not re-read yet: the intervals wait for the
increase. Intervals older than the retention are given up with their mark (the next reading
starts a new one), so nothing waits longer than that.

**Weights: a device's part of its physical GPU.** A full GPU is 1. A MIG instance is its compute
slices over the GPU's (``3g.40gb`` on an H100: 3/7; a ``1c.3g.40gb`` compute instance: 1/7; 7 slices
on every MIG-capable GPU but the A30, which has 4), from NVIDIA's MIG user guide ("Supported MIG
Profiles": the fraction of SMs of each profile,
https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html). Compute, not
memory: a GPU's power is mostly its SMs', a ``4g.40gb`` holds 4/7 of them where a ``3g.40gb`` holds
3/7 with the same memory, and the compute slices of a full layout add up to the whole GPU while the
memory slices of seven ``1g.10gb`` add up to 7/8. A profile that does not parse falls back to the
instance's share of the GPU's memory. An AMD partition is 1/N of its GPU (N partitions: CPX and
DPX modes split the compute dies evenly, and in NPS1 every partition reports the whole memory, so
memory tells nothing). When the held devices of one GPU add up to more than 1 (a GPU held whole
and in parts at once), each gets its weight's proportion of the GPU.

**Shares: between the holders of one device.** With per-process figures (``--per-process``), a
device's usage, memory and energy are split by the memory its holder pods' processes use on it;
a pod holding the device through several claims splits its part equally between them. Without
them, or while no holder's process uses memory on the device, by allocation: on a device several
claims share by consumable capacity (KEP-5075), by what each claim's allocation says it consumed
(``consumedCapacity``, its memory for NVIDIA's ``ConsumableShares``) when every claim states it
(rule ``capacity``); otherwise equally between the claims (a device-plugin pod is one holder of
its own); then equally between each claim's pods on that device. Device-time is always split by
allocation: it is what was allocated, not what was used. The parts of every
held device add up to 1; what no holder takes (an idle device, unpartitioned slices of a MIG GPU)
is counted as unattributed.

**How long a gone holder is kept.** ``retention`` (10 minutes of monotonic time) after the last
cycle that saw it, then its series go; and at most ``max_series`` (10,000) retained series
counting every kind together (2 per claim, 2 per pod): past that the ones that left first go
first. A claim that comes back while kept continues its counters; later, it starts again at 0,
which Prometheus reads as a new counter (``rate``/``increase`` are made for that).

**Cost.** A cycle's work follows the live holders (held now, or gone with energy still to come)
and what changed, never what is kept: once every energy increase covering its time has come, a
gone holder's totals are final and go into an immutable block, which costs nothing per cycle
until it expires (blocks leave oldest first, from a deque).
"""

from __future__ import annotations

import math
import operator
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from ..devices.model import DeviceIdentity, Vendor
from .snapshot import Snapshot

EQUAL = "equal"
PER_PROCESS = "per_process"
CAPACITY = "capacity"

ClaimKey = tuple[str, str]  # (namespace, claim)
PodKey = tuple[str, str]  # (namespace, pod)
# One holder's part of one device: (its claim, or None for a device-plugin pod; the pod; the share)
Part = tuple[ClaimKey | None, PodKey, float]
ProcessMemory = Mapping[tuple[str, str, str], int]  # (uuid, namespace, pod) -> bytes
Key = tuple[str, str]
Cols = tuple[tuple[Key, ...], tuple[float, ...], tuple[float, ...]]  # keys, joules, device-seconds

# Compute slices of a MIG-capable GPU: 7, except the A30's 4 (NVIDIA MIG user guide).
MIG_SLICES = 7
MIG_SLICES_BY_MODEL = (("A30", 4),)
_MIG_PROFILE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.")


@dataclass(frozen=True)
class DeviceSplit:
    """Who holds one device and how its figures are split, as of one cycle."""

    uuid: str
    gpu: str  # the physical GPU whose energy counter the device draws on
    weight: float  # the device's part of its GPU (see the module doc)
    fraction: float  # the part its holders get: the weight, scaled down if the GPU is over-held
    rule: str  # EQUAL, CAPACITY or PER_PROCESS: how ``usage`` was split
    usage: tuple[Part, ...]  # split of usage, memory and energy; shares add up to 1
    time: tuple[Part, ...]  # split of allocated time (by consumed capacity or equal); shares add up to 1


class Totals:
    """Running totals of one kind of holder (claims or pods) as of one cycle, in columns the
    renderer pairs with its cached label tuples: the gone holders' final totals first (oldest
    first), then the live ones' in key order.

    A *lazy* view: the live values are worked out from the plan as of the last change plus what
    each GPU and the clock added since, the first time anyone asks, and kept. A cycle that nobody
    renders costs them nothing. Immutable: a second thread asking at the same time computes the
    same tuples.
    """

    __slots__ = ("_amounts", "_elapsed", "_layout", "_values")

    def __init__(self, layout: _Layout | None = None, amounts: tuple[float, ...] = (0.0,),
                 elapsed: float = 0.0) -> None:
        self._layout = layout if layout is not None else _Layout((), _Plan((), {}, {}, ((), ()), (), 0))
        self._amounts, self._elapsed = amounts, elapsed
        self._values: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    @property
    def keys(self) -> tuple[Key, ...]:
        return self._layout.cols()[0]

    def _get(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        v = self._values
        if v is None:
            _, joules, seconds = self._layout.cols()
            live_j, live_s = self._layout.plan.values(self._amounts, self._elapsed)
            v = self._values = (joules + live_j, seconds + live_s)
        return v

    @property
    def joules(self) -> tuple[float, ...]:
        return self._get()[0]

    @property
    def seconds(self) -> tuple[float, ...]:
        return self._get()[1]

    def get(self, key: Key) -> tuple[float, float] | None:
        """(joules, device-seconds) of one claim or pod; None if it has no series."""
        try:
            i = self.keys.index(key)
        except ValueError:
            return None
        joules, seconds = self._get()
        return joules[i], seconds[i]

    def as_dict(self) -> dict[Key, tuple[float, float]]:
        joules, seconds = self._get()
        return {k: (j, s) for k, j, s in zip(self.keys, joules, seconds, strict=True)}


@dataclass(frozen=True)
class Usage:
    """Totals as of one cycle. Immutable: the renderer reads it while the next is made."""

    timestamp: float
    claims: Totals = field(default_factory=Totals)
    pods: Totals = field(default_factory=Totals)
    splits: tuple[DeviceSplit, ...] = ()  # the held devices now, by uuid
    integrated_joules: float = 0.0  # every GPU energy increase integrated since the start
    unattributed_joules: float = 0.0  # the part of it no holder took


def mig_weight(profile: str, model: str) -> float | None:
    """A MIG device's compute slices over its GPU's, from the profile name; None if it does not parse."""
    m = _MIG_PROFILE.match(profile or "")
    if not m:
        return None
    slices = int(m.group(1) or m.group(2))
    total = next((n for key, n in MIG_SLICES_BY_MODEL if key in (model or "")), MIG_SLICES)
    return min(1.0, slices / total) if slices > 0 else None


def device_weights(identities: Iterable[DeviceIdentity]) -> dict[str, tuple[str, float]]:
    """uuid -> (physical GPU, the device's part of it) for every device (see the module doc)."""
    idents = list(identities)
    members: dict[str, list[DeviceIdentity]] = {}
    for i in idents:
        members.setdefault(i.physical_uuid, []).append(i)
    by_uuid = {i.uuid: i for i in idents}
    out: dict[str, tuple[str, float]] = {}
    for i in idents:
        gpu = i.physical_uuid
        if not i.parent_uuid:
            out[i.uuid] = (gpu, 1.0)  # a full GPU (or a MIG GPU held whole)
            continue
        group = members[gpu]
        if i.vendor == Vendor.AMD:
            out[i.uuid] = (gpu, 1.0 / len(group))  # partition 0 included: it stands for the GPU
            continue
        parent = by_uuid.get(gpu)
        w = mig_weight(i.mig_profile, i.model or (parent.model if parent else ""))
        if w is None and i.memory_total_bytes and parent is not None and parent.memory_total_bytes:
            w = min(1.0, i.memory_total_bytes / parent.memory_total_bytes)
        if w is None:
            w = 1.0 / max(1, sum(1 for m in group if m.parent_uuid))
        out[i.uuid] = (gpu, w)
    return out


def split_devices(snap: Snapshot, process_memory: ProcessMemory | None = None) -> tuple[DeviceSplit, ...]:
    """Every held device of the snapshot, who holds it and how its figures are split. Pure."""
    return _split(_holders(snap), process_memory)


# One held device as the allocations and the devices alone make it: (uuid, its GPU, weight,
# fraction, holder -> its pods, the allocation split, its rule). What --per-process memory cannot move.
Held = tuple[str, str, float, float, dict[tuple[str, str, str], set[str]], tuple[Part, ...], str]


def _holders(snap: Snapshot) -> tuple[Held, ...]:
    weights = device_weights(d.identity for d in snap.devices)
    # device -> holder -> its pods; a holder is a claim (namespace, claim, "") or a device-plugin
    # pod (namespace, "", pod)
    held: dict[str, dict[tuple[str, str, str], set[str]]] = {}
    for a in snap.allocations:
        if not a.uuid or a.uuid not in weights:
            continue
        unit = (a.namespace, a.claim, "") if a.claim else (a.namespace, "", a.pod)
        held.setdefault(a.uuid, {}).setdefault(unit, set()).add(a.pod)
    # a physical GPU's held weight: more than 1 when it is held whole and in parts at once
    per_gpu: dict[str, float] = {}
    for uuid in held:
        gpu, w = weights[uuid]
        per_gpu[gpu] = per_gpu.get(gpu, 0.0) + w
    out = []
    for uuid in sorted(held):
        gpu, w = weights[uuid]
        total = per_gpu[gpu]
        units = held[uuid]
        by_capacity = _by_capacity(uuid, units, snap.consumed) if snap.consumed else None
        split, rule = (by_capacity, CAPACITY) if by_capacity is not None else (_equal(units), EQUAL)
        out.append((uuid, gpu, w, w / total if total > 1.0 else w, units, split, rule))
    return tuple(out)


def _split(holders: tuple[Held, ...], process_memory: ProcessMemory | None) -> tuple[DeviceSplit, ...]:
    out = []
    for uuid, gpu, w, fraction, units, time, allocated_by in holders:
        usage, rule = time, allocated_by
        if process_memory is not None:
            by_process = _per_process(uuid, units, process_memory)
            if by_process is not None:
                usage, rule = by_process, PER_PROCESS
        out.append(DeviceSplit(uuid=uuid, gpu=gpu, weight=w, fraction=fraction, rule=rule, usage=usage, time=time))
    return tuple(out)


def _claim(unit: tuple[str, str, str]) -> ClaimKey | None:
    return (unit[0], unit[1]) if unit[1] else None


def _equal(units: Mapping[tuple[str, str, str], set[str]]) -> tuple[Part, ...]:
    """Equally between the holders, then equally between a holder's pods."""
    n = len(units)
    return tuple(
        (_claim(unit), (unit[0], pod), 1.0 / n / len(pods))
        for unit, pods in sorted(units.items())
        for pod in sorted(pods)
    )


def _by_capacity(uuid: str, units: Mapping[tuple[str, str, str], set[str]],
                 consumed: Mapping[tuple[str, str, str], float]) -> tuple[Part, ...] | None:
    """By what each claim consumed of the device (KEP-5075), then equally between a claim's pods;
    None unless every holder is a claim whose allocation states an amount."""
    amounts = [consumed.get((uuid, unit[0], unit[1]), 0.0) if unit[1] else 0.0 for unit in units]
    total = sum(amounts)
    if not all(a > 0.0 for a in amounts) or total <= 0.0:
        return None
    return tuple(
        (_claim(unit), (unit[0], pod), a / total / len(pods))
        for (unit, pods), a in sorted(zip(units.items(), amounts, strict=True))
        for pod in sorted(pods)
    )


def _per_process(uuid: str, units: Mapping[tuple[str, str, str], set[str]],
                 memory: ProcessMemory) -> tuple[Part, ...] | None:
    """By the memory each holder pod's processes use on the device; None when none uses any."""
    pod_units: dict[PodKey, list[tuple[str, str, str]]] = {}
    for unit, pods in units.items():
        for pod in pods:
            pod_units.setdefault((unit[0], pod), []).append(unit)
    used = {pod: max(0, memory.get((uuid, pod[0], pod[1]), 0) or 0) for pod in pod_units}
    total = sum(used.values())
    if total <= 0:
        return None
    return tuple(
        (_claim(unit), pod, used[pod] / total / len(pod_units[pod]))
        for pod in sorted(pod_units)
        for unit in sorted(pod_units[pod])
    )


# How much of a quantity (a GPU's energy increase, a second) goes to each holder: its keys and
# their coefficients, summed over the parts of a set of splits. Made once per distinct set of
# splits, so a cycle adds one product per claim and pod instead of walking every part.
Column = tuple[tuple[tuple[str, str], ...], tuple[float, ...]]
Coefficients = tuple[Column, Column, float]  # claims, pods, the part attributed at all


def _column(coef: Coefficients, kind: int) -> Column:
    """The claims' (kind 0) or the pods' (1) column of ``coef``."""
    return coef[1] if kind else coef[0]


def _coefficients(splits: Iterable[DeviceSplit], time: bool) -> Coefficients:
    claims: dict[ClaimKey, float] = {}
    pods: dict[PodKey, float] = {}
    attributed = 0.0
    for s in splits:
        for claim, pod, share in s.time if time else s.usage:
            part = s.fraction * share
            attributed += part
            if claim is not None:
                claims[claim] = claims.get(claim, 0.0) + part
            pods[pod] = pods.get(pod, 0.0) + part
    return (tuple(claims), tuple(claims.values())), (tuple(pods), tuple(pods.values())), attributed


class _Plan:
    """How one kind's totals (claims or pods) are worked out while nothing but the amounts moves.

    A holder's total is its total as of the last change (``base_*``) plus its coefficient times
    what each source added since: the clock's elapsed time for device-seconds (one coefficient
    per holder), each physical GPU's energy increases for joules (a holder on several GPUs has a
    term per GPU). Made when the holders or any source's coefficients change, never per cycle; the
    terms are kept in one order, so the same amounts always give the same floats, and larger
    amounts never smaller ones (a counter cannot go down by a rounding).
    """

    __slots__ = ("base_joules", "base_seconds", "coef", "extra", "keys", "src", "time")

    def __init__(self, keys: tuple[tuple[str, str], ...], joules: Mapping[tuple[str, str], float],
                 seconds: Mapping[tuple[str, str], float],
                 time: Column, gpus: Iterable[Column], zero_slot: int) -> None:
        self.keys = keys
        get_j, get_s = joules.__getitem__, seconds.__getitem__
        self.base_joules = tuple(map(get_j, keys))
        self.base_seconds = tuple(map(get_s, keys))
        times = dict(zip(*time, strict=True))
        self.time = tuple(map(times.get, keys, repeat(0.0)))
        # Every holder's first GPU term (in slot order) in columns: one product per holder, in
        # C. A holder without one draws on the zero slot, whose amount stays 0.0; a holder on
        # several GPUs (a pod whose claims sit on two) has its further terms in ``extra``.
        # Made with dict updates in C: under --per-process the shares move with the processes'
        # memory, and a plan is made every cycle.
        cols = list(gpus)
        src: dict[tuple[str, str], int] = {}
        coef: dict[tuple[str, str], float] = {}
        for slot in range(len(cols) - 1, -1, -1):  # backwards: the first slot's term wins
            gkeys, gcoefs = cols[slot]
            src.update(zip(gkeys, repeat(slot)))
            coef.update(zip(gkeys, gcoefs, strict=True))
        extra: list[tuple[int, int, float]] = []
        if sum(len(c[0]) for c in cols) > len(src):
            pos = {k: i for i, k in enumerate(keys)}
            for slot, (gkeys, gcoefs) in enumerate(cols):
                for k, c in zip(gkeys, gcoefs, strict=True):
                    # a holder's other GPUs; and none for one expired since the GPU's last
                    # reading (a gap longer than the retention)
                    if src[k] != slot and (i := pos.get(k)) is not None:
                        extra.append((i, slot, c))
        self.coef = tuple(map(coef.get, keys, repeat(0.0)))
        self.src = _picker(list(map(src.get, keys, repeat(zero_slot))))
        self.extra = tuple(extra)

    def values(self, amounts: tuple[float, ...], elapsed: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(joules, device-seconds) in key order, given each source's amount since the plan."""
        seconds = tuple(map(operator.add, self.base_seconds, map(operator.mul, self.time, repeat(float(elapsed)))))
        joules = tuple(map(operator.add, self.base_joules, map(operator.mul, self.coef, self.src(amounts))))
        if self.extra:
            more = list(joules)
            for i, slot, c in self.extra:
                more[i] += c * amounts[slot]
            joules = tuple(more)
        return joules, seconds


def _picker(slots: list[int]) -> Callable[[tuple[float, ...]], tuple[float, ...]]:
    """The amounts of these slots, as a tuple: one itemgetter call (a third of a map's cost)."""
    if len(slots) >= 2:
        return operator.itemgetter(*slots)
    return lambda amounts: tuple(amounts[i] for i in slots)


class _Layout:
    """One kind's series as of the last change: the final blocks' columns and the live plan.
    Joined the first time they are rendered and kept, so a cycle that changes nothing hands
    the renderer the same keys (and it reuses its label tuples)."""

    __slots__ = ("_cols", "blocks", "plan")

    def __init__(self, blocks: tuple[Cols, ...], plan: _Plan) -> None:
        self.blocks, self.plan = blocks, plan
        self._cols: Cols | None = None

    def cols(self) -> Cols:
        c = self._cols
        if c is None:
            keys: list[Key] = []
            joules: list[float] = []
            seconds: list[float] = []
            for k, j, s in self.blocks:
                keys += k
                joules += j
                seconds += s
            c = self._cols = (tuple(keys) + self.plan.keys, tuple(joules), tuple(seconds))
        return c


class _Gpu:
    """One physical GPU's energy counter: its mark, and the intervals since the counter last
    moved, each [its holders' coefficients, length, length x power] (a run of intervals with the
    same holders is one entry)."""

    __slots__ = ("coef", "mark", "planned", "power", "since", "slot", "window")

    def __init__(self) -> None:
        self.mark: float | None = None
        self.since = 0.0  # the instant of the mark: every interval still waiting starts at or after it
        self.window: list[list[Any]] = []
        self.coef: Coefficients = _NONE  # the holders of the last cycle: they get the next interval
        self.planned: Coefficients | None = None  # the coefficients of the GPU's column in the plan
        self.slot = -1
        self.power = 0.0  # the last power measured


class _Block:
    """The holders that became final at one cycle, both kinds: immutable columns each."""

    __slots__ = ("cols", "expires")

    def __init__(self, expires: float, cols: list[Cols]) -> None:
        self.expires, self.cols = expires, cols

    def remove(self, kind: int, keys: set[Key]) -> None:
        k, j, s = self.cols[kind]
        keep = [i for i, key in enumerate(k) if key not in keys]
        self.cols[kind] = (tuple(k[i] for i in keep), tuple(j[i] for i in keep), tuple(s[i] for i in keep))


class _Book:
    """One kind of holder (claims or pods): the live ones' totals as of the last plan (held now,
    or gone with energy still to come), the gone ones in the order they left, and where each
    final one is kept."""

    __slots__ = ("active", "gone", "joules", "kind", "seconds", "waiting", "where")

    def __init__(self, kind: int) -> None:
        self.kind = kind  # 0 claims, 1 pods: the part of a block and of a coefficient that is theirs
        self.joules: dict[Key, float] = {}
        self.seconds: dict[Key, float] = {}
        self.active: set[Key] = set()
        self.gone: dict[Key, float] = {}  # live but gone: key -> the last cycle that held it
        self.waiting: deque[tuple[float, Key]] = deque()  # (when it was last held, key), in that order
        self.where: dict[Key, _Block] = {}  # final -> its block

    def hold(self, current: set[Key], last_seen: float) -> tuple[int, bool]:
        """The holders changed: new ones start at 0, kept ones continue; the ones that left were
        last held at ``last_seen``. How many more are kept now, and whether a block lost some."""
        joules, seconds, gone, kind = self.joules, self.seconds, self.gone, self.kind
        came: dict[_Block, set[Key]] = {}
        kept = 0
        for k in current - self.active:
            if k in gone:
                del gone[k]  # its entry in ``waiting`` is stale now
                kept -= 1
            elif (b := self.where.pop(k, None)) is not None:
                came.setdefault(b, set()).add(k)
                kept -= 1
            else:
                joules[k] = seconds[k] = 0.0
        for b, keys in came.items():
            for k, j, s in zip(*b.cols[kind], strict=True):
                if k in keys:
                    joules[k], seconds[k] = j, s
            b.remove(kind, keys)
        for k in self.active - current:
            gone[k] = last_seen
            self.waiting.append((last_seen, k))
            kept += 1
        self.active = current
        return kept, bool(came)

    def ripe(self, before: float) -> list[tuple[float, Key]]:
        """The gone holders last held before ``before``, taken out of the live ones, oldest first."""
        out = []
        waiting, gone = self.waiting, self.gone
        while waiting and waiting[0][0] < before:
            t, k = waiting.popleft()
            if gone.get(k) == t:
                del gone[k]
                out.append((t, k))
        return out

    def final(self, ripe: list[tuple[float, Key]]) -> Cols:
        keys = tuple(k for _, k in ripe)
        pop_j, pop_s = self.joules.pop, self.seconds.pop
        return keys, tuple(map(pop_j, keys)), tuple(map(pop_s, keys))

    def forget(self, keys: Iterable[Key]) -> None:
        for k in keys:
            self.joules.pop(k, None)
            self.seconds.pop(k, None)
            self.gone.pop(k, None)
            self.where.pop(k, None)


class UsageAccountant:
    """Integrates each cycle's energy increases and allocated time into per-claim and per-pod totals.

    Called by the sampler thread only (once per cycle, after the join); not thread-safe, and
    needs not be: what it hands out is immutable.

    A steady cycle (holders and devices as before, readings moving) adds one number per physical
    GPU and one for the clock: each GPU's energy increase goes to the column of its holders, and
    while those stay the same the split of a sum is the sum of the splits, so the increases are
    summed per GPU (and the intervals summed) and split only when a total is asked for
    (:class:`_Plan`, :class:`Totals`). When the holders change, what was summed is folded into the
    live totals and a new plan is made over the live holders only; an increase owed to holders of
    an earlier cycle is credited to them directly. Gone holders whose totals are final leave the
    plan for a block (see the module doc).
    """

    def __init__(self, retention: float = 600.0, max_series: int = 10_000) -> None:
        self.retention = retention
        self.max_series = max_series
        self._books = (_Book(0), _Book(1))  # claims, pods
        self._blocks: deque[_Block] = deque()
        self._blocks_touched = False  # a block lost holders that came back
        self._kept = 0  # gone holders of both kinds, live or final: 2 series each
        self._prev_t: float | None = None
        self._time_coef: Coefficients = _NONE  # the holders at the last cycle, for the interval since
        self._gpus: dict[str, _Gpu] = {}
        self._integrated = 0.0
        self._unattributed = 0.0
        # the last splits and what they were made from (the join hands back the very same
        # allocations tuple while nothing moved, see JoinMemo)
        self._memo: tuple[object, object, object, tuple[DeviceSplit, ...], tuple[Held, ...]] | None = None
        self._gpu_coef: dict[str, Coefficients] = {}  # of the current splits, per physical GPU
        self._split_time_coef: Coefficients = _NONE  # of the current splits
        self._physical: tuple[tuple[str, int], ...] = ()  # (uuid, position in snap.devices) of each physical GPU
        # Since the plans were made: each GPU's summed energy increases (by slot, the last one
        # always 0.0) and the summed intervals.
        self._amounts: list[float] = [0.0]
        self._elapsed = 0.0
        self._layouts: tuple[_Layout, _Layout] | None = None  # claims', pods'

    @property
    def retained_series(self) -> int:
        """Series of gone holders kept now (2 per claim, 2 per pod): at most ``max_series``."""
        return 2 * self._kept

    def update(self, snap: Snapshot, process_memory: ProcessMemory | None = None) -> Usage:
        now = snap.monotonic
        prev = self._prev_t
        splits, changed = self._splits(snap, process_memory, prev, now)
        # a cycle whose clock is behind the last one counts no time, and the holders of the last
        # one keep the interval
        advance = prev is None or now >= prev
        dt = now - prev if prev is not None and now > prev else 0.0
        if advance:
            self._prev_t = now
            self._elapsed += dt
            if self._time_coef is not self._split_time_coef:
                self._time_coef = self._split_time_coef
                changed = True
        credits: list[tuple[Coefficients, float]] = []  # owed to the holders of earlier cycles
        gpus, devices, gpu_coef = self._gpus, snap.devices, self._gpu_coef
        for uuid, i in self._physical:
            g = gpus.get(uuid)
            if g is None:
                g = gpus[uuid] = _Gpu()
            r = devices[i].reading
            ok = r is not None and r.ok
            e = r.energy_joules if r is not None and ok else None
            moved = e is not None and e >= 0.0 and e != g.mark
            if advance:
                p = r.power_watts if r is not None and ok else None
                if p is not None and p >= 0.0 and not math.isinf(p):  # NaN fails the >=
                    g.power = p
                # an interval the counter covers alone needs no entry: the increase is all its
                if g.mark is not None and dt > 0.0 and (g.window or not moved):
                    w = g.window
                    if w and w[-1][0] is g.coef:
                        w[-1][1] += dt
                        w[-1][2] += dt * g.power
                    else:
                        w.append([g.coef, dt, dt * g.power])
            if moved and e is not None:
                if g.mark is None:
                    changed = True  # the first reading: a mark to count from (and a new source)
                else:
                    self._settle(g, e - g.mark if e > g.mark else e, credits)
                g.mark, g.since = e, now
                if g.window:
                    g.window = []
            elif g.mark is not None and now - g.since > self.retention:
                g.mark, g.window = None, []  # not moved for a whole retention: give it up
                changed = True
            if advance:
                coef = gpu_coef.get(uuid, _NONE)
                if coef is not g.coef:
                    g.coef = coef
                    changed = True  # the intervals from now on go to other holders
        if len(gpus) > len(self._physical):
            present = {u for u, _ in self._physical}
            for gone in [u for u in gpus if u not in present]:
                del gpus[gone]
                changed = True
        if changed or credits or self._layouts is None or self._due(now):
            self._replan(now, credits)
        layouts, amounts, elapsed = self._layouts, tuple(self._amounts), self._elapsed
        assert layouts is not None
        return Usage(
            timestamp=snap.timestamp,
            claims=Totals(layouts[0], amounts, elapsed),
            pods=Totals(layouts[1], amounts, elapsed),
            splits=splits,
            integrated_joules=self._integrated,
            unattributed_joules=max(0.0, self._unattributed),
        )

    def _settle(self, g: _Gpu, delta: float, credits: list[tuple[Coefficients, float]]) -> None:
        """Split a counter's increase over the intervals it covers (see the module doc)."""
        window = g.window
        if not window:  # one interval (or none: no time passed): the last holders'
            self._take(g, g.coef, delta, credits)
            return
        col = 2 if sum(x[2] for x in window) > 0.0 else 1
        total = sum(x[col] for x in window)
        left = delta
        for n, entry in enumerate(window):
            # the last part is what is left, so the parts add up to the increase exactly
            part = left if n == len(window) - 1 else min(left, delta * entry[col] / total)
            left -= part
            self._take(g, entry[0], part, credits)

    def _take(self, g: _Gpu, coef: Coefficients, part: float, credits: list[tuple[Coefficients, float]]) -> None:
        """An interval's part of an increase, to its holders: summed in the GPU's plan column
        while they are the plan's, else credited at the next replan."""
        if coef is g.planned:
            self._amounts[g.slot] += part
        elif coef[2] > 0.0:
            credits.append((coef, part))
        self._integrated += part
        self._unattributed += part - part * coef[2]

    def _due(self, now: float) -> bool:
        """Whether a gone holder's totals became final or a kept one expires."""
        horizon = self._horizon()
        for b in self._books:
            if b.waiting and (b.waiting[0][0] < horizon or b.waiting[0][0] + self.retention < now):
                return True
        return bool(self._blocks) and self._blocks[0].expires < now

    def _horizon(self) -> float:
        """A holder last seen before this has all its totals: the intervals that start before it
        have had their time (the last cycle's) and their energy (every GPU's mark)."""
        last = self._prev_t if self._prev_t is not None else -math.inf
        return min(last, min((g.since for g in self._gpus.values() if g.mark is not None), default=last))

    def _replan(self, now: float, credits: list[tuple[Coefficients, float]]) -> None:
        """Fold what was summed under the old plans into the totals, credit what earlier holders
        are owed, move the final ones to a block, let the expired go, then plan anew from zero."""
        amounts, elapsed = tuple(self._amounts), self._elapsed
        books = self._books
        if self._layouts is not None:
            for book, layout in zip(books, self._layouts, strict=True):
                joules, seconds = layout.plan.values(amounts, elapsed)
                book.joules.update(zip(layout.plan.keys, joules, strict=True))
                book.seconds.update(zip(layout.plan.keys, seconds, strict=True))
        for coef, part in credits:
            for book, (keys, coefs) in zip(books, coef[:2], strict=False):
                totals = book.joules
                for k, c in zip(keys, coefs, strict=True):
                    if k in totals:  # not dropped by the cap meanwhile
                        totals[k] += c * part
        blocks_changed = self._retire(now) or self._blocks_touched
        self._blocks_touched = False
        live: list[_Gpu] = []
        for g in self._gpus.values():
            if g.mark is not None:
                g.slot, g.planned = len(live), g.coef
                live.append(g)
            else:
                g.slot, g.planned = -1, None
        self._amounts = [0.0] * (len(live) + 1)
        self._elapsed = 0.0
        old = self._layouts
        layouts = []
        for kind, book in enumerate(books):
            keys = tuple(sorted(book.joules))
            if old is not None and keys == old[kind].plan.keys:
                keys = old[kind].plan.keys  # the same tuple: the renderer keeps its labels
            cols = (_column(g.coef, kind) for g in live)
            plan = _Plan(keys, book.joules, book.seconds, _column(self._time_coef, kind), cols, len(live))
            blocks = old[kind].blocks if old is not None and not blocks_changed else tuple(
                col for b in self._blocks if (col := b.cols[kind])[0]
            )
            layouts.append(_Layout(blocks, plan))
        self._layouts = (layouts[0], layouts[1])

    def _retire(self, now: float) -> bool:
        """Final holders into a block, expired and over-the-cap ones out; whether blocks changed."""
        books, blocks, retention = self._books, self._blocks, self.retention
        horizon = self._horizon()
        ripe = [b.ripe(horizon) for b in books]
        changed = False
        if ripe[0] or ripe[1]:
            last = max(t for r in ripe for t, _ in r[-1:])
            block = _Block(last + retention, [b.final(r) for b, r in zip(books, ripe, strict=True)])
            for book, cols in zip(books, block.cols, strict=True):
                book.where.update(zip(cols[0], repeat(block)))
            blocks.append(block)
            changed = True
        while blocks and (blocks[0].expires < now or 2 * self._kept > self.max_series):
            b = blocks[0]
            over = (2 * self._kept - self.max_series + 1) // 2 if blocks[0].expires >= now else None
            for kind, book in enumerate(books):
                keys = b.cols[kind][0]
                drop = keys if over is None else keys[:over]
                if over is not None:
                    over -= len(drop)
                book.forget(drop)
                self._kept -= len(drop)
                if drop:
                    ks, js, secs = b.cols[kind]
                    b.cols[kind] = (ks[len(drop):], js[len(drop):], secs[len(drop):])
            if not b.cols[0][0] and not b.cols[1][0]:
                blocks.popleft()
            changed = True
        # gone holders whose energy is still to come: expired, or over the cap (oldest first)
        while True:
            heads = [(b.waiting[0], b) for b in books if b.waiting]
            if not heads:
                break
            (t, k), book = min(heads, key=operator.itemgetter(0))
            if t + retention >= now and 2 * self._kept <= self.max_series:
                break
            book.waiting.popleft()
            if book.gone.get(k) == t:
                book.forget((k,))
                self._kept -= 1
        return changed

    def _splits(self, snap: Snapshot, process_memory: ProcessMemory | None, prev: float | None,
                now: float) -> tuple[tuple[DeviceSplit, ...], bool]:
        """This cycle's splits, remade only when the holders, the devices or the process memory
        moved (only the per-process usage splits when only the memory did); and whether they were."""
        idents = [d.identity for d in snap.devices]
        memo = self._memo
        same_holders = memo is not None and memo[0] is snap.allocations and memo[1] == idents
        if memo is not None and same_holders:
            if memo[2] == process_memory:
                return memo[3], False
            holders = memo[4]
        else:
            holders = _holders(snap)
        splits = _split(holders, process_memory)
        self._memo = (snap.allocations, idents, None if process_memory is None else dict(process_memory), splits,
                      holders)
        by_gpu: dict[str, list[DeviceSplit]] = {}
        for s in splits:
            by_gpu.setdefault(s.gpu, []).append(s)
        self._gpu_coef = {gpu: _coefficients(ss, time=False) for gpu, ss in by_gpu.items()}
        if same_holders:
            # The same holders: the time split (always equal), its coefficients and the set of
            # claims and pods with counters are what they were.
            return splits, True
        self._physical = tuple((i.uuid, n) for n, i in enumerate(idents) if not i.is_partition)
        self._split_time_coef = _coefficients(splits, time=True)
        # Every claim the join exports has counters (a claim whose devices did not resolve stays
        # at 0), and so has every pod of those claims and every holder of a device.
        claims = {(c.namespace, c.name) for c in snap.claims}
        pods = {(c.namespace, p) for c in snap.claims for p in c.pods}
        for s in splits:
            for claim, pod, _ in s.time:
                if claim is not None:
                    claims.add(claim)
                pods.add(pod)
        last_seen = prev if prev is not None else now
        for book, current in zip(self._books, (claims, pods), strict=True):
            kept, touched = book.hold(current, last_seen)
            self._kept += kept
            self._blocks_touched |= touched
        return splits, True


_NONE: Coefficients = (((), ()), ((), ()), 0.0)  # a GPU nobody holds: all of its energy is unattributed
