"""Billing counters: energy and allocated device-time per claim and per pod, exact across cycles.

Fed each cycle's :class:`~exporter.model.snapshot.Snapshot` (and the per-process memory when
``--per-process`` is on), :class:`UsageAccountant` keeps running totals and hands back an
immutable :class:`Usage`. The join stays pure; this is the model layer's one piece of state
about the past, and it is small: a few floats per claim and pod, kept a while after they go.

**What is counted.** Energy comes from the GPUs' own energy counters
(``DeviceReading.energy_joules``, ``gpu_energy_joules_total``), never from sampled power: each
cycle, the increase of a physical GPU's counter since its last good reading is split between the
holders of its devices. A counter that went *down* (driver reload, GPU reset) restarted from 0,
so its new value is the increase; a GPU that could not be read keeps its last good value, and the
increase over the gap is split when it reads again; the first reading only sets the mark.
Device-time is allocation: every second a device is held counts, busy or not.

**Who gets an interval.** The holders of the devices at the *start* of the interval: what a
cycle observed stays in effect until the next cycle observes otherwise. So a claim seen by a
single cycle still gets the interval that follows it, even if it is gone before the next scrape,
and every new claim's counters start at 0.

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

**How long a gone claim is kept.** ``retention`` (10 minutes) after it was last seen, then its
series goes. Long enough for any usual scrape interval (up to 5 minutes) to read its final value
twice, so ``increase()`` sees the last interval; short enough that a node with claim churn keeps
state (and series) for one retention window of churn, capped at ``max_gone`` entries. A claim
that comes back within the window continues its counters; after it, it starts again at 0, which
Prometheus reads as a new counter (``rate``/``increase`` are made for that).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat

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
    """Running totals of one kind of holder (claims or pods), in key order. Column tuples: the
    renderer pairs them with its cached label tuples without a loop of its own.

    Made by the accountant as a *lazy* view (:meth:`lazy`): the values are worked out from the
    totals as of the last change of holders plus what each GPU and the clock added since, the
    first time anyone asks, and kept. A cycle that nobody renders costs them nothing. Immutable:
    a second thread asking at the same time computes the same tuples.
    """

    __slots__ = ("_joules", "_plan", "_seconds", "keys")

    def __init__(self, keys: tuple[tuple[str, str], ...] = (), joules: tuple[float, ...] = (), seconds: tuple[float, ...] = ()) -> None:
        self.keys = keys  # (namespace, claim) or (namespace, pod), sorted
        self._joules: tuple[float, ...] | None = joules
        self._seconds: tuple[float, ...] | None = seconds  # device-seconds
        self._plan: tuple[_Plan, tuple[float, ...], float] | None = None

    @classmethod
    def lazy(cls, plan: _Plan, amounts: tuple[float, ...], elapsed: float) -> Totals:
        t = cls(plan.keys)
        t._joules = t._seconds = None
        t._plan = (plan, amounts, elapsed)
        return t

    def _values(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        joules, seconds = self._joules, self._seconds
        if joules is None or seconds is None:
            assert self._plan is not None
            plan, amounts, elapsed = self._plan
            joules, seconds = plan.values(amounts, elapsed)
            self._joules, self._seconds = joules, seconds
        return joules, seconds

    @property
    def joules(self) -> tuple[float, ...]:
        return self._values()[0]

    @property
    def seconds(self) -> tuple[float, ...]:
        return self._values()[1]

    def get(self, key: tuple[str, str]) -> tuple[float, float] | None:
        """(joules, device-seconds) of one claim or pod; None if it has no series."""
        try:
            i = self.keys.index(key)
        except ValueError:
            return None
        joules, seconds = self._values()
        return joules[i], seconds[i]

    def as_dict(self) -> dict[tuple[str, str], tuple[float, float]]:
        joules, seconds = self._values()
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


def _per_process(uuid: str, units: Mapping[tuple[str, str, str], set[str]], memory: ProcessMemory) -> tuple[Part, ...] | None:
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

    def __init__(self, keys: tuple[tuple[str, str], ...], joules: Mapping[tuple[str, str], float], seconds: Mapping[tuple[str, str], float],
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


class _Running:
    """The totals of one kind of holder as of the last plan, with who holds now and who went when."""

    __slots__ = ("gone", "joules", "keys", "seconds")

    def __init__(self) -> None:
        self.joules: dict[tuple[str, str], float] = {}
        self.seconds: dict[tuple[str, str], float] = {}
        self.keys: tuple[tuple[str, str], ...] = ()  # every key with a series, sorted
        self.gone: dict[tuple[str, str], float] = {}  # key -> when it was last held

    def hold(self, current: set[tuple[str, str]], prev_t: float | None, now: float) -> None:
        """The holders changed: new ones start at 0 (or continue, back within the retention);
        the ones that left were last held at the previous cycle."""
        joules, seconds, gone = self.joules, self.seconds, self.gone
        for k in current:
            if k not in joules:
                joules[k] = seconds[k] = 0.0
            gone.pop(k, None)
        left = prev_t if prev_t is not None else now
        for k in joules:
            if k not in current and k not in gone:
                gone[k] = left
        # holding only adds keys: none added, the same keys keep their tuple (the renderer's
        # label tuples are remade when it is another)
        if len(joules) != len(self.keys):
            self.keys = tuple(sorted(joules))

    def fold(self, plan: _Plan, amounts: tuple[float, ...], elapsed: float) -> None:
        """Take what the sources added under ``plan`` into the totals: the values it gives now."""
        joules, seconds = plan.values(amounts, elapsed)
        self.joules.update(zip(plan.keys, joules, strict=True))
        self.seconds.update(zip(plan.keys, seconds, strict=True))

    def expiring(self, now: float, retention: float, max_gone: int) -> list[tuple[str, str]]:
        gone = self.gone
        if not gone:
            return []
        drop = [k for k, t in gone.items() if now - t > retention]
        if len(gone) - len(drop) > max_gone:  # a churn storm: keep the most recent
            kept = sorted(((t, k) for k, t in gone.items() if now - t <= retention), reverse=True)
            drop += [k for _, k in kept[max_gone:]]
        return drop

    def drop(self, keys: list[tuple[str, str]]) -> None:
        if keys:
            for k in keys:
                del self.gone[k], self.joules[k], self.seconds[k]
            self.keys = tuple(sorted(self.joules))


class UsageAccountant:
    """Integrates each cycle's energy increases and allocated time into per-claim and per-pod totals.

    Called by the sampler thread only (once per cycle, after the join); not thread-safe, and
    needs not be: what it hands out is immutable.

    A steady cycle (holders and devices as before, readings moving) adds one number per physical
    GPU and one for the clock: each GPU's energy increase is split by the coefficients of its
    last good reading, and while those stay the same the split of a sum is the sum of the splits,
    so the increases are summed per GPU (and the intervals summed) and split only when a total is
    asked for (:class:`_Plan`, :class:`Totals`). When any coefficient or the set of holders
    changes, what was summed under the old ones is split into the totals first (``fold``).
    """

    def __init__(self, retention: float = 600.0, max_gone: int = 10_000) -> None:
        self.retention = retention
        self.max_gone = max_gone
        self._claims = _Running()
        self._pods = _Running()
        self._prev_t: float | None = None
        self._time_coef: Coefficients = _NONE  # the holders at the last cycle, for the interval since
        # physical GPU -> (energy counter at its last good reading, the GPU's energy coefficients then)
        self._energy: dict[str, tuple[float, Coefficients]] = {}
        self._integrated = 0.0
        self._unattributed = 0.0
        # the last splits and what they were made from (the join hands back the very same
        # allocations tuple while nothing moved, see JoinMemo)
        self._memo: tuple[object, object, object, tuple[DeviceSplit, ...], tuple[Held, ...]] | None = None
        self._gpu_coef: dict[str, Coefficients] = {}  # of the current splits, per physical GPU
        self._split_time_coef: Coefficients = _NONE  # of the current splits
        self._physical: tuple[tuple[str, int], ...] = ()  # (uuid, position in snap.devices) of each physical GPU
        # Since the plans were made: each GPU's summed energy increases (by slot, the last one
        # always 0.0) and the summed intervals. A GPU's slot exists while it has a mark.
        self._slot: dict[str, int] = {}
        self._amounts: list[float] = [0.0]
        self._elapsed = 0.0
        self._plans: tuple[_Plan, _Plan] | None = None  # claims', pods'

    def update(self, snap: Snapshot, process_memory: ProcessMemory | None = None) -> Usage:
        now = snap.timestamp
        prev = self._prev_t
        splits, changed = self._splits(snap, process_memory, prev, now)
        claims, pods = self._claims, self._pods

        # allocated time since the last cycle, to the holders of that cycle
        if prev is not None and now > prev:
            self._elapsed += now - prev
        if prev is None or now >= prev:
            self._prev_t = now
            if self._time_coef is not self._split_time_coef:
                self._time_coef = self._split_time_coef
                changed = True

        # energy increases since each GPU's last good reading, to the holders of that reading
        gpu_coef, energy, amounts, slot = self._gpu_coef, self._energy, self._amounts, self._slot
        devices = snap.devices
        for uuid, i in self._physical:
            r = devices[i].reading
            e = r.energy_joules if r is not None and r.ok else None
            if e is None or not e >= 0.0:  # no reading, not supported, or NaN
                continue
            last = energy.get(uuid)
            coef = gpu_coef.get(uuid, _NONE)
            energy[uuid] = (e, coef)
            if last is None:
                changed = True  # the first reading: a mark to count from (and a new source)
                continue
            if coef is not last[1]:
                changed = True  # the increases from now on go to other holders
            delta = e - last[0] if e >= last[0] else e  # went down: the counter restarted from 0
            if delta <= 0.0:
                continue
            amounts[slot[uuid]] += delta
            self._integrated += delta
            self._unattributed += delta - delta * last[1][2]
        if len(energy) > len(self._physical):
            present = {u for u, _ in self._physical}
            for gone in [u for u in energy if u not in present]:
                del energy[gone]
                changed = True

        drop_claims = claims.expiring(now, self.retention, self.max_gone)
        drop_pods = pods.expiring(now, self.retention, self.max_gone)
        if changed or drop_claims or drop_pods or self._plans is None:
            self._replan(drop_claims, drop_pods)
        plans, totals, elapsed = self._plans, tuple(self._amounts), self._elapsed
        assert plans is not None
        return Usage(
            timestamp=now,
            claims=Totals.lazy(plans[0], totals, elapsed),
            pods=Totals.lazy(plans[1], totals, elapsed),
            splits=splits,
            integrated_joules=self._integrated,
            unattributed_joules=max(0.0, self._unattributed),
        )

    def _replan(self, drop_claims: list[tuple[str, str]], drop_pods: list[tuple[str, str]]) -> None:
        """Fold what was summed under the old plans into the totals, then plan anew from zero."""
        amounts, elapsed = tuple(self._amounts), self._elapsed
        if self._plans is not None:
            self._claims.fold(self._plans[0], amounts, elapsed)
            self._pods.fold(self._plans[1], amounts, elapsed)
        self._claims.drop(drop_claims)
        self._pods.drop(drop_pods)
        sources = list(self._energy)
        self._slot = {u: i for i, u in enumerate(sources)}
        self._amounts = [0.0] * (len(sources) + 1)
        self._elapsed = 0.0
        coefs = [self._energy[u][1] for u in sources]
        c, p = self._claims, self._pods
        self._plans = (
            _Plan(c.keys, c.joules, c.seconds, self._time_coef[0], (k[0] for k in coefs), len(sources)),
            _Plan(p.keys, p.joules, p.seconds, self._time_coef[1], (k[1] for k in coefs), len(sources)),
        )

    def _splits(self, snap: Snapshot, process_memory: ProcessMemory | None, prev: float | None, now: float) -> tuple[tuple[DeviceSplit, ...], bool]:
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
        self._memo = (snap.allocations, idents, None if process_memory is None else dict(process_memory), splits, holders)
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
        self._claims.hold(claims, prev, now)
        self._pods.hold(pods, prev, now)
        return splits, True


_NONE: Coefficients = (((), ()), ((), ()), 0.0)  # a GPU nobody holds: all of its energy is unattributed
