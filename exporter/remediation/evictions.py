"""Evictions you can see: the pods that still hold a device this agent tainted NoExecute.

For every NoExecute rule the agent owns, each pass counts the pods holding the rule's device in
the snapshot it was handed (its allocations are the kubelet's PodResources answer: which pod
holds which DRA device through which claim; nothing cluster-wide is read for it). The count is
published in the report (``dra_taint_pods_pending_eviction``, one series per rule, 0 once the
pods have gone).

A pod still there ``grace`` seconds after the taint (or after it came onto the device, for a pod
that arrived later) is looked at once: the pod by name and its claim, both single GETs, and only
for such pods. What it finds decides:

* the pod is being deleted: wait until its deletion time plus the grace;
* its claim's allocation tolerates the taint for ``tolerationSeconds``: wait until the taint's
  time plus those seconds plus the grace (the eviction controller's own deadline);
* otherwise one Warning Event on the pod and one on the rule, naming the reason when there is
  one: the device came through a DRA extended-resource claim (KEP-5004: the eviction controller
  evicts only for ``spec.resourceClaims``, kubernetes/kubernetes#141290), the claim tolerates
  the taint for ever, the pod was created after the taint by a controller that keeps putting
  pods on the device (its claim stays allocated), or the pod is stuck terminating.

Every deadline is a monotonic instant; a pod's deletion and creation dates (wall, from the API)
are converted as they are read. One Event per pod (and per controller, for recreated pods) per
episode: an episode is the time a rule stays NoExecute. The agent never deletes a pod itself.
Pure bookkeeping plus the lookups and Events it is handed; it runs on the remediation thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from ..clock import SYSTEM, Clock, from_wall
from ..k8s import names
from ..k8s.connection import ApiError
from ..k8s.events import micro_time, pod_ref
from ..k8s.model import ClaimInfo, DeviceKey, PodInfo
from ..k8s.parse import ParseError
from ..model.snapshot import AllocationView
from .contract import Effect, EventSink, PendingEvictionView, PodLookup
from .record import OwnedRule

log = structlog.get_logger(__name__)

GRACE = 60.0  # seconds a pod may stay past the taint (and its toleration) before it is looked at
LOOKUPS_PER_PASS = 16  # pods looked up in one pass at most: a shared claim with many pods is spread over passes
RETRY = 30.0  # seconds before a pod whose lookup failed (API down) is asked about again
EVENT_REASON = "GPUEvictionOverdue"


class Overdue(str, enum.Enum):
    """Why a pod is still on a NoExecute device (the ``why`` of its Event and log line)."""

    EXTENDED_RESOURCE_CLAIM = "extended_resource_claim"
    TOLERATION = "toleration"
    RECREATED = "recreated_by_controller"
    TERMINATING = "terminating"
    UNKNOWN = "unknown"


@dataclass
class _Holder:
    claim: str  # the claim through which the pod holds the device ("" if PodResources named none)
    since: float  # when its eviction clock started: the taint, or its arrival on the tainted device
    due: float  # when it is looked at (again)
    done: bool = False  # told, or found to be nothing to tell


@dataclass
class _Episode:
    since: float  # the first pass that saw the rule NoExecute
    holders: dict[tuple[str, str], _Holder] = field(default_factory=dict)
    told: set[tuple[str, ...]] = field(default_factory=set)  # ("pod", ns, name, uid) and ("controller", uid)


class EvictionWatch:
    def __init__(self, lookup: PodLookup | None, events: EventSink, rule_ref: Callable[[str], Mapping[str, str]],
                 grace: float = GRACE, clock: Clock = SYSTEM) -> None:
        self.lookup, self.events, self.rule_ref, self.grace, self.clock = lookup, events, rule_ref, grace, clock
        self._episodes: dict[DeviceKey, _Episode] = {}
        self.pending: tuple[PendingEvictionView, ...] = ()
        self.told: dict[str, int] = {}  # Events sent, by Overdue value (tests, debugging)

    def run(self, rules: Iterable[OwnedRule], allocations: Sequence[AllocationView], now: float) -> None:
        noexec = {r.key: r for r in rules if r.effect == Effect.NO_EXECUTE.value and not r.virtual}
        for key in self._episodes.keys() - noexec.keys():
            del self._episodes[key]  # stepped down or gone: the episode is over
        if not noexec:
            self.pending = ()
            return
        holding: dict[DeviceKey, dict[tuple[str, str], str]] = {}
        for a in allocations:
            key = (a.driver, a.pool, a.device)
            if a.source == "dra" and key in noexec:
                holding.setdefault(key, {}).setdefault((a.namespace, a.pod), a.claim)
        lookups = LOOKUPS_PER_PASS
        views = []
        for key, rule in sorted(noexec.items()):
            ep = self._episodes.setdefault(key, _Episode(since=now))
            current = holding.get(key, {})
            for gone in ep.holders.keys() - current.keys():
                del ep.holders[gone]
            for pk, claim in sorted(current.items()):
                h = ep.holders.setdefault(pk, _Holder(claim=claim, since=now, due=now + self.grace))
                if not h.done and now >= h.due and lookups > 0:
                    lookups -= 1
                    try:
                        self._look(rule, ep, pk, h, now)
                    except Exception:  # a bug or a surprise about one pod must not cost the pass (or the count)
                        log.exception("eviction_check_crashed", namespace=pk[0], pod=pk[1], retry_in=RETRY)
                        h.due = now + RETRY
            views.append(PendingEvictionView(rule.name, rule.driver, rule.pool, rule.device, len(current)))
        self.pending = tuple(views)

    # -- one overdue pod -------------------------------------------------------------------------
    def _look(self, rule: OwnedRule, ep: _Episode, pk: tuple[str, str], h: _Holder, now: float) -> None:
        ns, name = pk
        pod: PodInfo | None = None
        unread = ""
        if self.lookup is None:
            unread = "no API access to read it"
        else:
            try:
                pod = self.lookup.pod(ns, name)
            except ApiError as e:
                if e.retryable:  # the API is down or throttling: ask again later, say nothing yet
                    log.warning("eviction_check_failed", namespace=ns, pod=name, error=str(e), retry_in=RETRY)
                    h.due = now + RETRY
                    return
                unread = f"the pod could not be read ({e.status})"
            except ParseError as e:
                unread = f"the pod could not be parsed ({e})"
            else:
                if pod is None:  # gone from the API; the kubelet has not let go yet
                    h.due = now + self.grace
                    return
        deleting = None if pod is None or pod.deleting_at is None else from_wall(self.clock, pod.deleting_at)
        if deleting is not None and now < deleting + self.grace:
            h.due = deleting + self.grace  # being evicted: its grace period runs
            return
        claim = self._claim(ns, h.claim)
        why, detail, wait_until = self._why(rule, ep, pod, claim, h)
        if wait_until is not None and wait_until > now:
            h.due = wait_until
            return
        h.done = True
        tags: list[tuple[str, ...]] = [("pod", ns, name, pod.uid if pod is not None else "")]
        if why is Overdue.RECREATED and pod is not None and pod.controller is not None:
            tags.append(("controller", pod.controller.uid or f"{pod.controller.kind}/{pod.controller.name}"))
        if any(t in ep.told for t in tags):
            return  # this pod (or its controller's) is told already in this episode
        ep.told.update(tags)
        self._tell(rule, ns, name, pod, why, detail + (f"; {unread}" if unread else ""), now - h.since)

    def _claim(self, ns: str, name: str) -> ClaimInfo | None:
        if self.lookup is None or not name:
            return None
        try:
            return self.lookup.claim(ns, name)
        except (ApiError, ParseError) as e:  # (a ClaimCache does not raise; another lookup might)
            log.warning("eviction_claim_unreadable", namespace=ns, claim=name, error=str(e))
            return None

    def _why(self, rule: OwnedRule, ep: _Episode, pod: PodInfo | None, claim: ClaimInfo | None,
             h: _Holder) -> tuple[Overdue, str, float | None]:
        """(reason, its sentence, a later deadline to wait for instead: a finite toleration)."""
        if (pod is not None and h.claim and pod.extended_claim == h.claim) or (claim is not None and claim.extended):
            return (Overdue.EXTENDED_RESOURCE_CLAIM,
                    f"its device came through the extended-resource claim {h.claim} (KEP-5004), and NoExecute does "
                    "not evict such pods (kubernetes/kubernetes#141290): delete the pod, or move the workload to a "
                    "ResourceClaim", None)
        tolerated = ""
        dev = claim.device(rule.driver, rule.pool, rule.device) if claim is not None else None
        key, value = f"{names.TAINT_DOMAIN}/{rule.tier}", names.label_value(rule.reason)
        tolerations = dev.tolerations if dev is not None else ()
        matching = [t for t in tolerations if t.tolerates(key, value, Effect.NO_EXECUTE.value)]
        if matching:
            # as the eviction controller counts: the shortest tolerationSeconds of the matching
            # tolerations; for ever only when none of them has one
            finite = [max(0, t.seconds) for t in matching if t.seconds is not None]
            if not finite:
                return (Overdue.TOLERATION, f"its claim {h.claim} tolerates the taint {key} without tolerationSeconds",
                        None)
            seconds = min(finite)
            tolerated = f"; its claim tolerates the taint for {seconds}s"
            wait = h.since + seconds + self.grace
            if wait > h.due:
                return Overdue.UNKNOWN, tolerated, wait
        if pod is not None and pod.deleting_at is not None:
            return (Overdue.TERMINATING, f"deleted at {micro_time(pod.deleting_at)} and still running (a finalizer, or "
                    "a kubelet that cannot stop it)", None)
        created = None if pod is None or pod.created_at is None else from_wall(self.clock, pod.created_at)
        if pod is not None and pod.controller is not None and created is not None and created > ep.since:
            c = pod.controller
            return (Overdue.RECREATED,
                    f"created after the taint by its controller {c.kind}/{c.name}, which puts new pods on the device "
                    f"while their claim {h.claim} stays allocated", None)
        return (Overdue.UNKNOWN,
                "no toleration, extended-resource claim or controller explains it: is kube-controller-manager's "
                f"device-taint eviction controller running (DRADeviceTaintRules)?{tolerated}", None)

    def _tell(self, rule: OwnedRule, ns: str, name: str, pod: PodInfo | None, why: Overdue, detail: str,
              age: float) -> None:
        device = f"{rule.driver}/{rule.pool}/{rule.device}"
        log.warning("eviction_overdue", rule=rule.name, device=rule.device, namespace=ns, pod=name, why=why.value,
                    seconds=round(age))
        self.told[why.value] = self.told.get(why.value, 0) + 1
        gpu = f" (GPU {rule.uuid})" if rule.uuid else ""
        self.events.record(pod_ref(ns, name, pod.uid if pod is not None else ""), EVENT_REASON,
                           f"still holds {device}{gpu} {age:.0f}s after DeviceTaintRule {rule.name} tainted it "
                           f"NoExecute ({rule.tier} {rule.reason}): {detail}",
                           "Observe", warning=True)
        self.events.record(self.rule_ref(rule.name), EVENT_REASON,
                           f"pod {ns}/{name} still holds {device}{gpu} {age:.0f}s after the NoExecute taint: {detail}",
                           "Observe", warning=True)
