"""One pass over this node's fault domains: every device's rule decided (:func:`.plan.decide`)
under the rails' verdict for its fault domain, and applied by the writer; rules for devices no longer
published retired; the budget settled; GPUs no DRA device maps to told about.

Fault domains: which DRA devices one physical fault takes down. Faults happen to physical GPUs;
DRA devices are what a DeviceTaintRule selects. One GPU is published as many DRA devices, and all
of them go down with it:

* NVIDIA full GPU ``gpu-<minor>`` (``uuid`` attribute ``GPU-...``);
* NVIDIA static MIG devices ``gpu-<minor>-mig-<profile>-<gi>-<start>``: attribute ``uuid``
  (``MIG-...``) and ``parentUUID`` (the GPU);
* NVIDIA DynamicMIG partitions, one per profile and placement (about 26 per H100), published
  next to ``gpu-<minor>`` and drawing on its counter set through ``consumesCounters``: no
  ``uuid`` (the MIG instance exists only once prepared), ``parentUUID`` names the GPU;
* AMD partitions (``type`` ``amdgpu-partition``): the parent GPU through ``parentPciAddr`` /
  ``parentDeviceID`` (before v1.0) or the shared ``resource.kubernetes.io/pciBusID``, told apart
  by card and render index.

Sources: NVIDIA/k8s-dra-driver-gpu ``cmd/gpu-kubelet-plugin/deviceinfo.go``, ``mig.go`` and
``partitions.go``; ROCm/k8s-gpu-dra-driver's driver-attributes document and
``cmd/gpu-kubeletplugin/deviceinfo.go``. The join (:func:`exporter.model.join.join`) resolves
each published device to the local device (its ``uuid``) and the GPU it lives on, and the
snapshot carries them (``Snapshot.published``); here they are only grouped (:func:`group`).

A GPU's devices are one decision and one Event; a fault domain (the GPU, or a MIG instance with a
fatal fault of its own) is checked against the rails once, however many devices it has.
Everything held back is counted once per episode (:class:`.writer.Notices`); a write the server
refuses is held (:class:`.writer.Refusals`) and the pass goes on with the other devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import structlog

from ..devices.model import DeviceIdentity
from ..health.model import Condition, DeviceHealth, Scope, Tier
from ..k8s.connection import ApiError
from ..k8s.model import DeviceKey
from ..model.join import effective_health
from ..model.snapshot import PublishedDevice
from ..reasons import Suppression
from .adoption import AdminMemory
from .contract import Action, Effect, RemediationPolicy, Target, Verdict
from .plan import ADMIN_DELETED, Decision, Safety, decide, wanted
from .rails import SafetyRails
from .record import OwnedRules
from .writer import BUDGET_KEY, NODE_KEY, NameTaken, Notices, Outcome, Refusals, RuleWriter

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GpuDevices:
    """One physical GPU and every DRA device of this node's slices backed by it."""

    gpu: str  # the physical GPU's uuid: the fault domain of its GPU-wide faults
    targets: tuple[Target, ...]


def targets(published: Iterable[PublishedDevice]) -> list[Target]:
    """Every published device that resolves to a local device, with its fault domain."""
    return [Target(driver=p.driver, pool=p.pool, device=p.device, uuid=p.uuid, gpu=p.gpu or p.uuid)
            for p in published if p.uuid]


def group(ts: list[Target]) -> list[GpuDevices]:
    """Targets grouped by physical GPU, in a stable order (by GPU uuid, devices by name)."""
    by: dict[str, list[Target]] = {}
    for t in ts:
        by.setdefault(t.gpu, []).append(t)
    return [GpuDevices(gpu=g, targets=tuple(sorted(v, key=lambda t: t.key))) for g, v in sorted(by.items())]


class Reconciler:
    def __init__(self, policy: RemediationPolicy, record: OwnedRules, rails: SafetyRails, writer: RuleWriter,
                 notices: Notices, refusals: Refusals, admin: AdminMemory) -> None:
        self.policy, self.record, self.rails, self.writer = policy, record, rails, writer
        self.notices, self.refusals, self.admin = notices, refusals, admin
        self.pending: dict[str, list[Outcome]] = {}  # a domain's writes not yet told (pass failed midway)
        self._plugin_notified: dict[str, str] = {}

    def run(self, targets: Sequence[Target], gpus: Sequence[DeviceIdentity], published: frozenset[DeviceKey] | None,
            health: dict[str, DeviceHealth], now: float, supports_none: bool, kill_switch: bool) -> None:
        fatal_since: dict[str, float] = {}  # GPU-wide fatal faults by physical GPU
        for i in gpus:
            times = [c.since for c in _conditions(health, i.uuid) if c.tier == Tier.FATAL]
            if times:
                fatal_since[i.uuid] = min(times)
        nodewide = self.rails.begin(now, fatal_since, len(gpus), self.record.noexecute_domains())
        window = self.policy.node_fault_window
        if nodewide:
            self.notices.announce(NODE_KEY, Suppression.NODE_FAULT,
                                  f"{len(nodewide)} of {len(gpus)} GPUs failed within {window:g}s of each other: "
                                  "treating it as a node problem, NoSchedule only")
        else:
            self.notices.over(NODE_KEY, Suppression.NODE_FAULT)
        covered: set[str] = set()
        wanting: set[str] = set()
        for g in group(list(targets)):
            outcomes = self.pending.pop(g.gpu, [])
            try:
                self._gpu(g, health, fatal_since, nodewide, supports_none, now, kill_switch, covered, wanting, outcomes)
            except BaseException:
                self.pending[g.gpu] = outcomes  # told once the rest of the GPU's devices are written
                raise
            if outcomes and not self.policy.dry_run:
                self.writer.tell(outcomes)
        if published is not None:
            self._retire_unpublished(published, now, kill_switch)
        self.rails.return_slots(self.record.noexecute_domains() | wanting)
        if not self.rails.budget_error:
            self.notices.over(BUDGET_KEY, Suppression.BUDGET_UNAVAILABLE)
        if published is not None:  # (before the first slice list every GPU would look device-plugin managed)
            self._device_plugin_notices(gpus, health, covered)

    def _gpu(self, g: GpuDevices, health: dict[str, DeviceHealth], fatal_since: dict[str, float], nodewide: set[str],
             supports_none: bool, now: float, kill_switch: bool, covered: set[str], wanting: set[str],
             outcomes: list[Outcome]) -> None:
        """One physical GPU's devices, by fault domain: the GPU itself, and each MIG instance with a
        fatal fault of its own (unless the GPU has one too: then the GPU is the domain of all)."""
        gpu_fatal = g.gpu in fatal_since
        # every device's effective health: its own conditions plus its GPU's GPU-wide ones
        hs = {t.key: effective_health(t.uuid, t.gpu if t.gpu != t.uuid else "", health) for t in g.targets}
        domains: dict[str, list[Target]] = {}
        for t in g.targets:
            covered.update((t.uuid, t.gpu))
            domains.setdefault(g.gpu if gpu_fatal or t.uuid == g.gpu else t.uuid, []).append(t)
        for domain, ts in domains.items():
            verdict = Verdict.ALLOWED
            if any(wanted(hs[t.key], self.policy.mode, supports_none)[0] == Effect.NO_EXECUTE.value for t in ts):
                wanting.add(domain)
                if domain == g.gpu:
                    since = fatal_since.get(g.gpu)
                else:  # an instance's own fatal fault
                    times = [c.since for c in _conditions(health, ts[0].uuid) if c.tier == Tier.FATAL]
                    since = min(times) if times else None
                holds = self.record.holds_noexecute([t.key for t in ts])
                verdict = self.rails.check(domain, holds=holds, since=since, node_fault=domain in nodewide, now=now,
                                           kill_switch=kill_switch)
                if verdict is Verdict.BUDGET_UNAVAILABLE:
                    self.notices.announce(BUDGET_KEY, Suppression.BUDGET_UNAVAILABLE,
                                          "the cluster NoExecute budget cannot be read or updated "
                                          f"({self.rails.budget_error}): new faults get NoSchedule only")
            safety = Safety(kill_switch=kill_switch, supports_none=supports_none, verdict=verdict)
            scope = Scope.GPU if domain == g.gpu else Scope.INSTANCE
            for t in ts:
                self._apply(t, hs[t.key], safety, now, scope, outcomes)

    def _apply(self, t: Target, h: DeviceHealth, safety: Safety, now: float, scope: Scope,
               outcomes: list[Outcome]) -> None:
        rule = self.record.get(t.key)
        if rule is None and not h.conditions and t.key not in self.refusals and t.key not in self.admin:
            # The steady state of nearly every device: healthy, no rule, nothing refused or
            # deleted by an admin; plan.decide says NOTHING and the writer has nothing to do.
            self.notices.over(t.key)
            return
        d = decide(t, h, rule, self.policy.mode, safety, self.policy.hold, now, self.admin.since(t.key, h))
        sig = (d.action.value, d.effect, d.tier)
        if self.refusals.holds(t.key, sig, now):
            return  # refused before; asking again on every pass would only be refused again
        what = Suppression(d.suppressed) if d.suppressed and d.suppressed != ADMIN_DELETED else None
        # (node-wide and budget-unreadable episodes are told once for the node, with their cause)
        node_wide = (Suppression.NODE_FAULT, Suppression.BUDGET_UNAVAILABLE)
        if what is not None and what not in node_wide and d.action != Action.DELETE:
            state = h.worst.value if h.worst else "healthy"
            limit = what.value.replace("_", " ")
            self.notices.announce(t.key, what, f"{t.device}: {limit} limits remediation of {state} device {t.uuid}")
        try:
            out = self.writer.apply(t, h, rule, d, now, scope)
        except ApiError as e:
            if e.retryable:
                raise  # outage: the whole pass is retried with backoff
            # The server refused this one write (admission policy, validation, authorization):
            # report it (collector, /readyz, alert) and go on, or one bad device would block
            # every device sorted after it on every pass.
            log.error("remediation_write_rejected", device=t.device, action=d.action.value, status=e.status,
                      error=str(e), retry_in=self.policy.refused_retry)
            self.notices.announce(t.key, Suppression.API_REJECTED,
                                  f"{t.device}: the API server refused to {d.action.value} its DeviceTaintRule: {e}")
            self.refusals.hold(t.key, sig, now + self.policy.refused_retry,
                               f"{t.device}: {d.action.value} refused ({e.status}): {str(e)[:200]}")
            return
        except NameTaken as e:
            log.error("rule_name_taken", rule=str(e), device=t.device, retry_in=self.policy.refused_retry)
            self.refusals.hold(t.key, sig, now + self.policy.refused_retry,
                               f"{t.device}: rule name {e} taken by an object that is not this agent's")
            self.notices.announce(t.key, Suppression.NAME_CONFLICT, f"{t.device}: a DeviceTaintRule named {e} exists "
                                  f"and is not this agent's; left alone, so {t.uuid} is not tainted")
            return
        if out is not None:
            outcomes.append(out)
            if d.action == Action.CREATE:
                self.admin.forget(t.key)
        if not d.suppressed:
            self.notices.over(t.key)  # applied without any limit: this device's episode (if any) is over

    def _retire_unpublished(self, published: frozenset[DeviceKey], now: float, kill_switch: bool) -> None:
        """Rules for devices this node no longer publishes (MIG layout changed, driver gone)
        select nothing and would otherwise be orphaned forever; they go after the hold."""
        outcomes: list[Outcome] = []
        for rule in self.record.values():
            if rule.key in published or not rule.managed:
                self.record.unpublished(rule, None)
                continue
            if rule.gone_since is None:
                self.record.unpublished(rule, now)
            if now - (rule.gone_since or now) < self.policy.hold or kill_switch:
                continue
            t = Target(driver=rule.driver, pool=rule.pool, device=rule.device, uuid=rule.uuid,
                       gpu=rule.gpu or rule.uuid)
            try:
                out = self.writer.delete(t, rule, Decision(Action.DELETE, why="device_gone"))
            except ApiError as e:
                if e.retryable:
                    raise
                log.error("remediation_write_rejected", device=rule.device, action="delete", error=str(e))
                continue
            if out is not None:
                outcomes.append(out)
        if outcomes:
            self.writer.tell(outcomes)

    def _device_plugin_notices(self, gpus: Sequence[DeviceIdentity], health: dict[str, DeviceHealth],
                               covered: set[str]) -> None:
        """GPUs no DRA device maps to (device-plugin GPUs) get Events but no rule: nothing can
        select them."""
        for ident in gpus:
            if ident.uuid in covered:
                continue
            h = health.get(ident.uuid)
            state = h.worst.value if h is not None and h.worst is not None else ""
            prev = self._plugin_notified.get(ident.uuid)
            self._plugin_notified[ident.uuid] = state
            if prev == state or (prev is None and not state):
                continue  # no change, or healthy from the start: nothing to tell
            why = f": {h.conditions[0].reason}" if state and h is not None else ""
            note = (f"GPU {ident.uuid} ({ident.pci_bus_id}) is {state or 'healthy again'}{why}; not DRA-managed, so no "
                    "DeviceTaintRule can select it")
            self.writer.node_event("GPUUnhealthy" if state else "GPUHealthy", note, "Observe", warning=bool(state))


def _conditions(health: dict[str, DeviceHealth], uuid: str) -> tuple[Condition, ...]:
    h = health.get(uuid)
    return h.conditions if h is not None else ()
