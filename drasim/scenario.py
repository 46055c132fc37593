"""Scenario files for the simulated node (YAML or JSON).

A scenario describes one node: its GPUs (MIG instances included), how their utilization,
memory and power move over time, the pods and DRA claims that use them, and a fault schedule.
The format is documented in docs/scenarios.md; parsing is strict, and every error names the
place in the file ("gpus[2].mig[0].profile: ...") so a user can fix it in one go.
"""

from __future__ import annotations

import builtins
import json
import math
import re
import reprlib
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from exporter.constants import NVIDIA_DRIVER
from exporter.devices.model import normalize_pci_bus_id
from exporter.text import one_line

DRIVER = NVIDIA_DRIVER  # the DRA driver the simulated node's slice and claims name
_NS = uuidlib.UUID("6f1c2f4e-1d0b-4c55-9a57-8a3c0e1d2b7a")


class ScenarioError(ValueError):
    """A scenario is unusable. The message names the place and is always one line: a name
    or file name with a newline in it is escaped, so the demo's error stays one line."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class _ShortRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int over 4300 digits raises ValueError; a message never needs the digits
        return f"<{x.bit_length()}-bit integer>" if x.bit_length() > 256 else super().repr_int(x, level)


_REPR = _ShortRepr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel = 2
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def _show(v: Any) -> str:
    """repr() for messages, bounded: YAML aliases can make a small file hold a value that is
    exponentially large when printed, and a message must stay one readable line."""
    return _REPR.repr(v)


@dataclass(frozen=True)
class Curve:
    """A value over simulated time: base + amplitude * wave(t / period), clamped to [lo, hi]."""

    pattern: str = "constant"  # constant | sine | square | sawtooth | ramp
    base: float = 0.0
    amplitude: float = 0.0
    period: float = 300.0
    phase: float = 0.0

    def at(self, t: float, lo: float = 0.0, hi: float = 1.0) -> float:
        if self.period <= 0:
            x = 0.0
        elif self.pattern == "ramp":
            x = (t + self.phase) / self.period  # may be inf (tiny period): min(x, 1) copes
        else:
            # the position within one period: (t + phase) / period overflows to inf for a tiny
            # period or a huge phase, and sin(inf) raises
            x = ((t + self.phase) % self.period) / self.period
        if self.pattern == "sine":
            w = math.sin(2 * math.pi * x)
        elif self.pattern == "square":
            w = 1.0 if (x % 1.0) < 0.5 else -1.0
        elif self.pattern == "sawtooth":
            w = 2.0 * (x % 1.0) - 1.0
        elif self.pattern == "ramp":
            w = min(x, 1.0)
        else:
            w = 0.0
        return max(lo, min(hi, self.base + self.amplitude * w))


@dataclass(frozen=True)
class MigSpec:
    profile: str
    gi_profile_id: int
    placement_start: int
    memory_bytes: int
    uuid: str
    utilization: Curve
    memory_used: Curve  # ratio of the instance's memory


@dataclass(frozen=True)
class GpuSpec:
    name: str  # scenario-local name used by claims and faults
    uuid: str
    model: str
    minor: int
    pci_bus_id: str
    memory_bytes: int
    power_limit_watts: float
    idle_power_watts: float
    utilization: Curve
    memory_used: Curve
    temperature_base: float
    mig: tuple[MigSpec, ...] = ()
    # taints the driver put on the GPU in its slice (each of its MIG devices for a GPU in MIG
    # mode), as NVIDIA's driver writes them: (key, value, effect), e.g. gpu.nvidia.com/xid=43:None
    taints: tuple[tuple[str, str, str], ...] = ()
    published: bool = True  # False: the slice leaves the GPU out (a plugin that missed it)
    # NVIDIA's ConsumableShares (KEP-5075): several claims may hold the GPU, each consuming memory
    consumable_shares: bool = False

    @property
    def device_name(self) -> str:
        return f"gpu-{self.minor}"

    def mig_device_name(self, m: MigSpec) -> str:
        # NVIDIA DRA driver v25.12+ naming: gpu-<minor>-mig-<profile without dots>-<giProfileId>-<start>
        prof = re.sub(r"[^a-z0-9]", "", m.profile.lower())
        return f"gpu-{self.minor}-mig-{prof}-{m.gi_profile_id}-{m.placement_start}"


_RECOVERY_ACTIONS = (1, 2, 3, 4, 5)  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values other than none
FAULT_KINDS = ("xid", "lost", "ecc_uncorrectable", "hang", "reset", "recovery_action", "row_remap_failure",
               "row_remap_pending")


@dataclass(frozen=True)
class Fault:
    kind: str
    gpu: str  # GpuSpec.name, or "<gpu>/<mig profile>@<start>" is not supported: faults are physical
    at: float
    until: float | None = None  # lost, hang: end time; None = forever
    code: int = 0  # xid number, recovery action value
    rate_per_minute: float = 0.0  # ecc_uncorrectable growth


@dataclass(frozen=True)
class ClaimSpec:
    namespace: str
    name: str
    devices: tuple[str, ...]  # GPU names, or "<gpu>:<mig profile>:<placement start>" for MIG
    memory: int | None = None  # consumed on each consumable-shares GPU; None: the whole GPU (the driver's default)


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    claims: tuple[str, ...] = ()  # claim names in the pod's namespace
    device_plugin: tuple[tuple[str, str], ...] = ()  # (resource name, GPU name or gpu:profile:start)
    restartable_init: bool = False
    # DRA-backed extended resources (KEP-5004): (resource name, device), allocated through the
    # claim the scheduler generates for the pod (drasim.objects.extended_claim_name)
    extended: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PodSpec:
    namespace: str
    name: str
    containers: tuple[ContainerSpec, ...]
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    start: float = 0.0  # pod exists from this simulated time
    end: float | None = None  # and until this one


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    node: str
    driver_version: str
    gpus: tuple[GpuSpec, ...]
    claims: tuple[ClaimSpec, ...]
    pods: tuple[PodSpec, ...]
    faults: tuple[Fault, ...]

    def gpu(self, name: str) -> GpuSpec:
        for g in self.gpus:
            if g.name == name:
                return g
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# parsing helpers

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


# Limits that keep every value the simulator derives finite and printable.
_MAX_BYTES = 2**63 - 1  # sizes: beyond int64, float(size) overflows in the readings
_MAX_INT = 2**31 - 1  # minors, placements, codes: str() of an int over 4300 digits raises
_MAX_WATTS = 100_000.0  # so that power x simulated time (energy) stays finite
_MAX_ECC_RATE = 1e6  # errors per minute: the count must stay a finite number over any run


def parse_bytes(v: Any, where: str) -> int:
    if isinstance(v, bool):
        raise ScenarioError(f"{where}: expected a size like 80Gi, got {_show(v)}")
    if isinstance(v, (int, float)):
        if not (0 <= v <= _MAX_BYTES):  # also rejects NaN; beyond int64, float(size) overflows
            raise ScenarioError(f"{where}: must be a size from 0 to {_MAX_BYTES}, got {_show(v)}")
        return int(v)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?|[kmgt]i?)?[Bb]?\s*", str(v))
    if not m:
        raise ScenarioError(f"{where}: expected a size like 80Gi or 40GB, got {_show(v)}")
    n = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if not n <= _MAX_BYTES:  # 400 digits are a valid match, and int(inf) raises OverflowError
        raise ScenarioError(f"{where}: size too large (at most {_MAX_BYTES} bytes), got {_show(v)}")
    return int(n)


def parse_duration(v: Any, where: str) -> float:
    if isinstance(v, bool):
        raise ScenarioError(f"{where}: expected a duration like 90s or 5m, got {_show(v)}")
    if isinstance(v, (int, float)):
        if not (0 <= v < math.inf):  # also rejects NaN
            raise ScenarioError(f"{where}: must be a duration >= 0, got {_show(v)}")
        return _finite(v, where)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", str(v))
    if not m:
        raise ScenarioError(f"{where}: expected a duration like 90s, 5m or 1h, got {_show(v)}")
    # finite: 400 digits match the pattern, and an infinite phase makes sin() raise at read time
    return _finite(float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)], where)


def _finite(v: int | float, where: str) -> float:
    """``v`` as a finite float. NaN and infinity are numbers to YAML (.nan, .inf) and JSON
    (NaN, Infinity), and float() of a huge int raises OverflowError."""
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ScenarioError(f"{where}: expected a finite number, got {_show(v)}")
    return f


class _Obj:
    """A mapping read with location-aware errors and a check for unknown keys."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ScenarioError(f"{where}: expected a mapping, got {type(data).__name__}")
        self.d = data
        self.where = where
        self.used: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.d.get(key, default)

    def req(self, key: str) -> Any:
        self.used.add(key)
        if key not in self.d:
            raise ScenarioError(f"{self.where}.{key}: required")
        return self.d[key]

    def str(self, key: str, default: str | None = None) -> str:
        v = self.req(key) if default is None else self.get(key, default)
        if not isinstance(v, str):
            raise ScenarioError(f"{self.where}.{key}: expected a string, got {_show(v)}")
        return _text(v, f"{self.where}.{key}")

    def num(self, key: builtins.str, default: float, lo: float = -math.inf, hi: float = math.inf) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ScenarioError(f"{self.where}.{key}: expected a number, got {_show(v)}")
        f = _finite(v, f"{self.where}.{key}")
        if not lo <= f <= hi:
            raise ScenarioError(f"{self.where}.{key}: must be between {lo:g} and {hi:g}, got {_show(v)}")
        return f

    def int(self, key: builtins.str, default: int) -> int:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_INT:
            raise ScenarioError(
                f"{self.where}.{key}: expected a whole number >= 0 (at most {_MAX_INT}), got {_show(v)}"
            )
        return v

    def bool(self, key: builtins.str, default: bool) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise ScenarioError(f"{self.where}.{key}: expected true or false, got {_show(v)}")
        return v

    def list(self, key: builtins.str) -> builtins.list[Any]:
        v = self.get(key, [])
        if v is None:
            return []
        if not isinstance(v, list):
            raise ScenarioError(f"{self.where}.{key}: expected a list, got {type(v).__name__}")
        return v

    def done(self) -> None:
        # str first: YAML keys can be numbers or null, and sorting mixed types raises TypeError
        extra = sorted(_show(k) if not isinstance(k, str) else k for k in set(self.d) - self.used)
        if extra:
            raise ScenarioError(f"{self.where}: unknown key(s) {', '.join(extra)}")



def _text(v: str, where: str) -> str:
    # YAML and JSON escapes can produce a lone surrogate ("\ud800"), which no UTF-8 consumer
    # (the kubelet's protobuf messages, the API's JSON) can encode
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ScenarioError(f"{where}: not valid Unicode text, got {_show(v)}") from None
    return v


def _curve(v: Any, where: str, default: Curve) -> Curve:
    if v is None:
        return default
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return Curve(base=_finite(v, where))
    o = _Obj(v, where)
    pattern = o.str("pattern", "constant")
    if pattern not in ("constant", "sine", "square", "sawtooth", "ramp"):
        raise ScenarioError(f"{where}.pattern: expected constant, sine, square, sawtooth or ramp, got {_show(pattern)}")
    c = Curve(
        pattern=pattern,
        base=o.num("base", default.base),
        amplitude=o.num("amplitude", 0.0),
        period=parse_duration(o.get("period", 300), f"{where}.period"),
        phase=parse_duration(o.get("phase", 0), f"{where}.phase"),
    )
    o.done()
    return c


def _stable_uuid(prefix: str, *parts: str) -> str:
    return f"{prefix}-{uuidlib.uuid5(_NS, '/'.join(parts))}"


_MIG_PROFILES = {  # H100 80GB: profile -> (GI profile id, memory GiB)
    "1g.10gb": (19, 10),
    "1g.20gb": (15, 20),
    "2g.20gb": (14, 20),
    "3g.40gb": (9, 40),
    "4g.40gb": (5, 40),
    "7g.80gb": (0, 80),
}


def _parse_gpu(i: int, raw: Any, node: str) -> GpuSpec:
    where = f"gpus[{i}]"
    o = _Obj(raw, where)
    name = o.str("name", f"gpu{i}")
    minor = o.int("minor", i)
    uid = o.str("uuid", _stable_uuid("GPU", node, name))
    if not re.fullmatch(r"GPU-[0-9a-fA-F-]{8,}", uid):
        raise ScenarioError(f"{where}.uuid: expected GPU-<hex uuid>, got {_show(uid)}")
    memory = parse_bytes(o.get("memory", "80Gi"), f"{where}.memory")
    pci = o.str("pci_bus_id", "%04x:%02x:00.0" % (i // 200, 0x18 + i % 200))
    pci_n = normalize_pci_bus_id(pci)
    if not re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", pci_n):
        raise ScenarioError(f"{where}.pci_bus_id: expected a PCI address like 0000:1b:00.0, got {_show(pci)}")
    util = _curve(o.get("utilization"), f"{where}.utilization", Curve(base=0.0))
    mem = _curve(o.get("memory_used"), f"{where}.memory_used", Curve(base=0.0))
    migs = []
    for j, mraw in enumerate(o.list("mig")):
        mw = f"{where}.mig[{j}]"
        mo = _Obj(mraw, mw)
        profile = mo.str("profile")
        known = _MIG_PROFILES.get(profile)
        if known is None and "gi_profile_id" not in mo.d:
            raise ScenarioError(f"{mw}.gi_profile_id: required for profile {_show(profile)} (known: "
                                f"{', '.join(_MIG_PROFILES)})")
        gi = mo.int("gi_profile_id", known[0] if known else 0)
        start = mo.int("placement_start", j)
        mmem = parse_bytes(mo.get("memory", f"{known[1]}Gi" if known else "10Gi"), f"{mw}.memory")
        muid = mo.str("uuid", _stable_uuid("MIG", node, name, profile, str(start)))
        if not re.fullmatch(r"MIG-[0-9a-fA-F-]{8,}", muid):
            raise ScenarioError(f"{mw}.uuid: expected MIG-<hex uuid>, got {_show(muid)}")
        migs.append(
            MigSpec(
                profile=profile,
                gi_profile_id=gi,
                placement_start=start,
                memory_bytes=mmem,
                uuid=muid,
                utilization=_curve(mo.get("utilization"), f"{mw}.utilization", Curve()),
                memory_used=_curve(mo.get("memory_used"), f"{mw}.memory_used", Curve()),
            )
        )
        mo.done()
    starts = [m.placement_start for m in migs]
    if len(set(starts)) != len(starts):
        raise ScenarioError(f"{where}.mig: two instances share a placement_start")
    # A MIG parent's activity is its instances' weighted by their share of its memory: with no
    # memory that divides by zero, and with more in the instances than in the GPU it exceeds 1.
    held = sum(m.memory_bytes for m in migs)
    if migs and memory == 0:
        raise ScenarioError(f"{where}.memory: a GPU in MIG mode needs memory")
    if held > memory:
        raise ScenarioError(f"{where}.memory: {memory} bytes, less than its MIG instances hold ({held})")
    g = GpuSpec(
        name=name,
        uuid=uid,
        model=o.str("model", "NVIDIA H100 80GB HBM3"),
        minor=minor,
        pci_bus_id=pci_n,
        memory_bytes=memory,
        # watts >= 0 (energy is a counter: negative power would run it backwards), bounded so
        # that power x simulated time stays finite
        power_limit_watts=o.num("power_limit_watts", 700.0, 0, _MAX_WATTS),
        idle_power_watts=o.num("idle_power_watts", 70.0, 0, _MAX_WATTS),
        utilization=util,
        memory_used=mem,
        temperature_base=o.num("temperature_celsius", 35.0),
        mig=tuple(migs),
        taints=tuple(_parse_taint(t, f"{where}.taints[{j}]") for j, t in enumerate(o.list("taints"))),
        published=o.bool("published", True),
        consumable_shares=o.bool("consumable_shares", False),
    )
    o.done()
    if g.consumable_shares and g.mig:
        raise ScenarioError(f"{where}.consumable_shares: only a full GPU is shared here, not one in MIG mode")
    return g


def _parse_taint(raw: Any, where: str) -> tuple[str, str, str]:
    t = _Obj(raw, where)
    out = (t.str("key"), str(t.get("value", "")), t.str("effect", "NoSchedule"))
    if out[2] not in ("None", "NoSchedule", "NoExecute"):
        raise ScenarioError(f"{where}.effect: expected None, NoSchedule or NoExecute, got {_show(out[2])}")
    t.done()
    return out


# an extended resource name: a domain-prefixed name (nvidia.com/gpu), as the API requires
_EXTENDED_RESOURCE_RE = re.compile(
    r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


def _device_ref(ref: Any, where: str, gpus: dict[str, GpuSpec]) -> str:
    """Validate a device reference: "<gpu>" or "<gpu>:<profile>:<start>"."""
    if not isinstance(ref, str):
        raise ScenarioError(f"{where}: expected a device reference string, got {_show(ref)}")
    parts = ref.split(":")
    g = gpus.get(parts[0])
    if g is None:
        raise ScenarioError(f"{where}: unknown GPU {_show(parts[0])} (known: {', '.join(gpus)})")
    if len(parts) == 1:
        if g.mig:
            raise ScenarioError(f"{where}: GPU {_show(g.name)} is in MIG mode; reference an instance as "
                                f"{g.name}:<profile>:<start>")
        return ref
    if len(parts) != 3 or not any(m.profile == parts[1] and str(m.placement_start) == parts[2] for m in g.mig):
        raise ScenarioError(f"{where}: no MIG instance {_show(ref)} (expected <gpu>:<profile>:<placement start>)")
    return ref


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    o = _Obj(data, source)
    node = o.str("node", "demo-node")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", node):  # as --node-name: at most 253
        raise ScenarioError(f"{source}.node: {_show(node)} is not a valid node name")
    gpu_list = [_parse_gpu(i, g, node) for i, g in enumerate(o.list("gpus"))]
    if not gpu_list:
        raise ScenarioError(f"{source}.gpus: at least one GPU is required")
    gpus: dict[str, GpuSpec] = {}
    for g in gpu_list:
        if g.name in gpus:
            raise ScenarioError(f"{source}.gpus: duplicate name {_show(g.name)}")
        gpus[g.name] = g
    for attr in ("minor", "uuid", "pci_bus_id"):
        vals = [getattr(g, attr) for g in gpu_list]
        if len(set(vals)) != len(vals):
            raise ScenarioError(f"{source}.gpus: duplicate {attr}")
    all_uuids = [g.uuid for g in gpu_list] + [m.uuid for g in gpu_list for m in g.mig]
    if len(set(all_uuids)) != len(all_uuids):
        raise ScenarioError(f"{source}.gpus: duplicate MIG uuid")

    claims = []
    for i, raw in enumerate(o.list("claims")):
        co = _Obj(raw, f"claims[{i}]")
        devs = tuple(_device_ref(d, f"claims[{i}].devices[{j}]", gpus) for j, d in enumerate(co.list("devices")))
        if not devs:
            raise ScenarioError(f"claims[{i}].devices: at least one device is required")
        mem = co.get("memory")
        claims.append(ClaimSpec(namespace=co.str("namespace", "default"), name=co.str("name"), devices=devs,
                                memory=None if mem is None else parse_bytes(mem, f"claims[{i}].memory")))
        co.done()
        if mem is not None and not any(gpus[d.split(":")[0]].consumable_shares for d in devs):
            raise ScenarioError(f"claims[{i}].memory: only a claim on a consumable_shares GPU consumes memory")
    for g in gpu_list:  # the scheduler never allocates more of a shared GPU than it has
        held = [c.memory if c.memory is not None else g.memory_bytes for c in claims if g.name in c.devices]
        if g.consumable_shares and sum(held) > g.memory_bytes:
            raise ScenarioError(f"{source}.claims: the claims on {_show(g.name)} consume more memory than it has")
    claim_keys = {(c.namespace, c.name) for c in claims}
    if len(claim_keys) != len(claims):
        raise ScenarioError(f"{source}.claims: duplicate claim")

    pods = []
    for i, raw in enumerate(o.list("pods")):
        pw = f"pods[{i}]"
        po = _Obj(raw, pw)
        ns = po.str("namespace", "default")
        containers = []
        for j, craw in enumerate(po.list("containers")):
            cw = f"{pw}.containers[{j}]"
            cobj = _Obj(craw, cw)
            cl = tuple(cobj.list("claims"))
            for k, cn in enumerate(cl):
                if not isinstance(cn, str):  # a list here is unhashable: TypeError in the lookup
                    raise ScenarioError(f"{cw}.claims[{k}]: expected a claim name, got {_show(cn)}")
                if (ns, cn) not in claim_keys:
                    raise ScenarioError(f"{cw}.claims[{k}]: no claim {_show(cn)} in namespace {_show(ns)}")
            dp = []
            for k, draw in enumerate(cobj.list("device_plugin")):
                dobj = _Obj(draw, f"{cw}.device_plugin[{k}]")
                dp.append((dobj.str("resource", "nvidia.com/gpu"),
                           _device_ref(dobj.req("device"), f"{cw}.device_plugin[{k}].device", gpus)))
                dobj.done()
            ext = []
            for k, draw in enumerate(cobj.list("extended_resources")):
                dobj = _Obj(draw, f"{cw}.extended_resources[{k}]")
                res = dobj.str("resource", "nvidia.com/gpu")
                if not _EXTENDED_RESOURCE_RE.fullmatch(res):
                    raise ScenarioError(f"{cw}.extended_resources[{k}].resource: expected an extended resource name "
                                        f"like nvidia.com/gpu, got {_show(res)}")
                ext.append((res, _device_ref(dobj.req("device"), f"{cw}.extended_resources[{k}].device", gpus)))
                dobj.done()
            containers.append(ContainerSpec(name=cobj.str("name"), claims=cl, device_plugin=tuple(dp),
                                            restartable_init=cobj.bool("restartable_init", False),
                                            extended=tuple(ext)))
            cobj.done()
        if not containers:
            raise ScenarioError(f"{pw}.containers: at least one container is required")
        cnames = [c.name for c in containers]
        if len(set(cnames)) != len(cnames):
            raise ScenarioError(f"{pw}.containers: duplicate container name")
        labels = _labels(po.get("labels"), f"{pw}.labels")
        end = po.get("end")
        pods.append(
            PodSpec(
                namespace=ns,
                name=po.str("name"),
                containers=tuple(containers),
                labels=labels,
                start=parse_duration(po.get("start", 0), f"{pw}.start"),
                end=None if end is None else parse_duration(end, f"{pw}.end"),
            )
        )
        po.done()
        p = pods[-1]
        if p.end is not None and p.end <= p.start:
            raise ScenarioError(f"{pw}.end: must be after start")
        if sum(1 for q in pods if (q.namespace, q.name) == (p.namespace, p.name)) > 1:
            raise ScenarioError(f"{pw}.name: duplicate pod {p.namespace}/{p.name}")

    faults = []
    for i, raw in enumerate(o.list("faults")):
        fw = f"faults[{i}]"
        fo = _Obj(raw, fw)
        kind = fo.str("kind")
        if kind not in FAULT_KINDS:
            raise ScenarioError(f"{fw}.kind: expected one of {', '.join(FAULT_KINDS)}, got {_show(kind)}")
        gname = fo.str("gpu")
        if gname not in gpus:
            raise ScenarioError(f"{fw}.gpu: unknown GPU {_show(gname)}")
        until = fo.get("until")
        f = Fault(
            kind=kind,
            gpu=gname,
            at=parse_duration(fo.req("at"), f"{fw}.at"),
            until=None if until is None else parse_duration(until, f"{fw}.until"),
            code=fo.int("code", 0),  # a whole number: int() of a NaN or 1e400 raised
            rate_per_minute=fo.num("rate_per_minute", 0.0),
        )
        if kind == "xid" and f.code <= 0:
            raise ScenarioError(f"{fw}.code: an xid fault needs its XID number, e.g. code: 79")
        if kind == "recovery_action" and f.code not in _RECOVERY_ACTIONS:
            raise ScenarioError(f"{fw}.code: a recovery_action fault needs a value 1..5 (1 GPU reset, 2 node reboot, 3 "
                                f"drain P2P, 4 drain and reset, 5 recover IMEX domain), got {f.code}")
        if "code" in fo.d and kind not in ("xid", "recovery_action"):
            raise ScenarioError(f"{fw}.code: only xid and recovery_action faults take a code")
        if "rate_per_minute" in fo.d and kind != "ecc_uncorrectable":
            raise ScenarioError(f"{fw}.rate_per_minute: only ecc_uncorrectable faults take a rate")
        if f.rate_per_minute < 0:
            raise ScenarioError(f"{fw}.rate_per_minute: must not be negative")
        if f.rate_per_minute > _MAX_ECC_RATE:
            raise ScenarioError(f"{fw}.rate_per_minute: at most {_MAX_ECC_RATE:g}")
        if f.until is not None and kind in ("xid", "reset"):
            raise ScenarioError(f"{fw}.until: an {kind} fault is an instant; it takes no until")
        if f.until is not None and f.until <= f.at:
            raise ScenarioError(f"{fw}.until: must be after at")
        faults.append(f)
        fo.done()

    driver_version = o.str("driver_version", "580.95.05")
    # digits and dots, as NVML reports it: the ResourceSlice's version attribute is built from
    # the digit groups ("²".isdigit() is true, and int("²") raises)
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)*", driver_version):
        raise ScenarioError(f"{source}.driver_version: expected a version like 580.95.05, got {_show(driver_version)}")
    sc = Scenario(
        name=o.str("name", Path(source).stem),
        description=o.str("description", ""),
        node=node,
        driver_version=driver_version,
        gpus=tuple(gpu_list),
        claims=tuple(claims),
        pods=tuple(pods),
        faults=tuple(sorted(faults, key=lambda f: f.at)),
    )
    o.done()
    return sc


def _labels(raw: Any, where: str) -> dict[str, str]:
    """Pod labels: a mapping of scalars, turned into strings."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: expected a mapping, got {_show(raw)}")
    out = {}
    for k, v in raw.items():
        for x in (k, v):
            # a list or mapping would be stringified whole (exponentially large through YAML
            # aliases) and is no label value anyway; an int over 4300 digits cannot be
            if isinstance(x, (list, dict)) or x is None or (isinstance(x, int) and abs(x) > 10**100):
                raise ScenarioError(f"{where}: expected text or a number, got {_show(x)}")
        out[_text(str(k), where)] = _text(str(v), where)
    return out


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    kind = "JSON" if p.suffix == ".json" else "YAML"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ScenarioError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ScenarioError(f"{p}: not valid {kind}: not UTF-8 text (byte {e.start})") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    # Not just the loaders' own errors: a 5000-digit number or a bad date is a ValueError, deep
    # nesting exhausts the stack of both loaders, and PyYAML's constructors raise IndexError,
    # KeyError or AttributeError for tagged scalars they cannot read (!!float "", !!bool x).
    # Only the loader runs in this try, so whatever it raises means the file is unreadable.
    except Exception as e:
        first = (str(e).splitlines() or [""])[0]
        if not isinstance(e, (ValueError, RecursionError, yaml.YAMLError)):
            first = f"cannot construct a value ({type(e).__name__}: {first})"
        raise ScenarioError(f"{p}: not valid {kind}: {first}") from None
    return parse_scenario(data, str(p.name))


BUNDLED = Path(__file__).parent / "scenarios"


def bundled_scenarios() -> dict[str, Path]:
    return {p.stem: p for p in sorted(BUNDLED.glob("*.yaml"))}


def find_scenario(value: str) -> Path:
    """A scenario file's path, or a bundled scenario's by its name (as --list-scenarios
    prints it); a file of that name wins, as a path on the command line should."""
    p = Path(value)
    if p.is_file():
        return p
    bundled = bundled_scenarios()
    if value in bundled:
        return bundled[value]
    raise ScenarioError(f"--scenario {value}: no such file, and no bundled scenario of that name (bundled: "
                        f"{', '.join(bundled)})")


def default_scenario() -> Scenario:
    return load_scenario(BUNDLED / "mixed-node.yaml")
