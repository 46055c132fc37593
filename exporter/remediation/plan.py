"""What to do about one DRA device: pure decisions, no I/O.

Given the device's health, the rule this agent already owns for it (if any), the mode and the
rails' verdict for its fault domain (:class:`Safety`), :func:`decide` returns one :class:`Decision`;
the writer executes it. Keeping the policy here makes every safety rule a plain-data test.

Effects by tier in ``enforce`` mode: fatal -> NoExecute, degraded -> NoSchedule,
informational -> None (where the server supports None). ``shadow`` writes None for every tier;
``dry-run`` decides exactly like ``enforce`` and writes nothing.

A raise to NoExecute under a verdict other than ALLOWED (the rails decide which, in this order):
  * settling (a new fault inside its settle window) -> NoSchedule, not a suppression;
  * node-wide fault (most of the node's GPUs failing at once) -> NoSchedule only;
  * per-node rate limit on new NoExecute rules -> NoSchedule until the window allows;
  * cluster budget unreadable -> NoSchedule; used up -> None (NoSchedule where None is not served).
Lowering an effect is never blocked by them. The kill switch and ``managed=false`` stop
every write. A rule is lowered one step per hold period (NoExecute -> NoSchedule -> gone), so a
device that recovers and re-fails does not flap its taint. A *sticky* rule (the device re-failed
too often, or the rule carries the sticky label) is never lowered: only a person clears it, by
deleting the rule or removing the label.

A rule whose effect and tier are right but whose record is not (another reason, newer evidence,
sticky not yet marked) is *refreshed*: its labels, annotations and taint value are rewritten,
its effect is not. Sticky is marked at once; reason and evidence at most every
``RECORD_REFRESH`` seconds after the rule was last written, so an event storm on a tainted GPU is
not also a write storm on the API server, and conditions that clear one after the other while
the device recovers do not rename a rule that is about to step down anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..health.model import DeviceHealth, Tier
from ..reasons import Suppression, TaintMode
from .contract import Action, Effect, Target, Verdict
from .record import EVIDENCE_MAX, OwnedRule

EFFECT_RANK = {Effect.NONE.value: 0, Effect.NO_SCHEDULE.value: 1, Effect.NO_EXECUTE.value: 2}
TIER_EFFECT = {Tier.FATAL: Effect.NO_EXECUTE.value, Tier.DEGRADED: Effect.NO_SCHEDULE.value,
               Tier.INFORMATIONAL: Effect.NONE.value}
RECORD_REFRESH = 60.0  # seconds between two rewrites of a rule's reason and evidence
# A decision-only note, never counted or announced: an admin deleted the rule and no new
# evidence has come since, so not recreating it is what they asked for.
ADMIN_DELETED = "admin_deleted"


@dataclass(frozen=True)
class Safety:
    """What limits a decision besides the device: the node's kill switch, whether the server
    serves effect None, and the rails' verdict for the device's fault domain (ALLOWED unless it
    wants NoExecute and may not have it yet)."""

    kill_switch: bool = False
    supports_none: bool = True
    verdict: Verdict = Verdict.ALLOWED


@dataclass(frozen=True)
class Decision:
    action: Action
    effect: str = ""
    tier: str = ""
    reason: str = ""
    evidence: str = ""
    sticky: bool = False
    suppressed: str = ""  # a Suppression (or ADMIN_DELETED) when held back; "" when not
    calm_since: float | None = None
    why: str = ""  # for delete: recovered | hardware_swap | device_gone


def wanted(health: DeviceHealth, mode: TaintMode, supports_none: bool) -> tuple[str | None, Tier | None]:
    """The effect the device's worst condition asks for, before safety limits."""
    tier = health.worst
    if tier is None or mode == TaintMode.OFF:
        return None, tier
    effect = Effect.NONE.value if mode == TaintMode.SHADOW else TIER_EFFECT[tier]
    if effect == Effect.NONE.value and not supports_none:
        return None, tier
    return effect, tier


def _limit(effect: str, safety: Safety) -> tuple[str | None, str]:
    """A raise to NoExecute under the rails' verdict: the effect written instead, and why."""
    v = safety.verdict
    if effect != Effect.NO_EXECUTE.value or v is Verdict.ALLOWED:
        return effect, ""
    if v is Verdict.SETTLING:
        # Fence now (nothing new lands), evict once the picture is clear: not a suppression,
        # the raise is only pending.
        return Effect.NO_SCHEDULE.value, ""
    if v is Verdict.BUDGET_FULL and safety.supports_none:
        return Effect.NONE.value, Suppression.BUDGET
    return Effect.NO_SCHEDULE.value, Suppression(v.value)  # (a verdict that holds back is named as its suppression)


def _stale(rule: OwnedRule, reason: str, evidence: str, sticky: bool, now: float) -> bool:
    """Whether the rule's record (reason, evidence, sticky label) is due to be rewritten."""
    if sticky and not rule.sticky:
        return True  # a person has to find it: at once
    if reason == rule.reason and evidence[:EVIDENCE_MAX] == rule.evidence:
        return False
    return rule.refreshed_at is None or now - rule.refreshed_at >= RECORD_REFRESH


def decide(
    target: Target,
    health: DeviceHealth,
    rule: OwnedRule | None,
    mode: TaintMode,
    safety: Safety,
    hold: float,
    now: float,
    admin_deleted_at: float | None = None,
) -> Decision:
    effect, tier = wanted(health, mode, safety.supports_none)
    candidates = [c for c in health.conditions if c.tier == tier]
    # A rule keeps naming the condition it was written for while that condition holds: one more
    # condition of the same tier is no news for the rule (gpu_health_condition shows it), and
    # following the sort order instead would rewrite the rule with every condition that comes.
    kept = next((c for c in candidates if rule is not None and c.reason == rule.reason), None)
    worst = kept or next(iter(candidates), None)
    reason = worst.reason if worst else ""
    evidence = worst.evidence if worst else ""
    # Sticky until a person clears it: the health engine's verdict, or the label on the rule
    # (which outlives the agent process and its in-memory failure history).
    sticky = health.sticky or (rule is not None and rule.sticky)

    if rule is not None and not rule.managed:
        return Decision(Action.NOTHING, suppressed=Suppression.UNMANAGED)
    if rule is not None and rule.uuid and target.uuid and rule.uuid != target.uuid:
        # Rules select by name; another GPU now answers to this name, so the rule's evidence
        # is about hardware that is gone.
        if safety.kill_switch:
            return Decision(Action.KEEP, suppressed=Suppression.KILL_SWITCH)
        return Decision(Action.DELETE, why="hardware_swap")

    if effect is None:
        limited, suppressed = None, ""
    elif rule is not None and rule.effect == effect:
        # Safety limits gate *raising* an effect; a rule that already has it keeps it (the
        # budget and rate window already count this rule).
        limited, suppressed = effect, ""
    else:
        limited, suppressed = _limit(effect, safety)
        has = EFFECT_RANK.get(rule.effect, 0) if rule is not None else -1
        if rule is not None and limited is not None and EFFECT_RANK[limited] < has <= EFFECT_RANK[effect]:
            # A limit caps a raise; it must not lower what the rule already has (a fatal
            # device keeps its NoSchedule while the NoExecute budget is used up).
            limited = rule.effect

    if rule is None:
        if limited is None:
            return Decision(Action.NOTHING)
        if admin_deleted_at is not None and (worst is None or worst.last_seen <= admin_deleted_at):
            return Decision(Action.NOTHING, suppressed=ADMIN_DELETED)
        if safety.kill_switch:
            return Decision(Action.NOTHING, suppressed=Suppression.KILL_SWITCH)
        return Decision(Action.CREATE, effect=limited, tier=tier.value if tier else "", reason=reason,
                        evidence=evidence, sticky=sticky, suppressed=suppressed)

    current = EFFECT_RANK.get(rule.effect, 0)
    target_rank = EFFECT_RANK[limited] if limited is not None else -1
    # ranks are >= 0, so a higher target always has an effect (limited is None ranks -1)
    retier = target_rank == current and tier is not None and tier.value != rule.tier
    if limited is not None and (target_rank > current or retier):
        if safety.kill_switch:
            return Decision(Action.KEEP, suppressed=Suppression.KILL_SWITCH)
        return Decision(Action.UPDATE, effect=limited, tier=tier.value if tier else rule.tier, reason=reason,
                        evidence=evidence, sticky=sticky, suppressed=suppressed)
    if target_rank == current:
        if _stale(rule, reason, evidence, sticky, now):
            if safety.kill_switch:
                return Decision(Action.KEEP, suppressed=Suppression.KILL_SWITCH)
            return Decision(Action.REFRESH, effect=rule.effect, tier=rule.tier, reason=reason, evidence=evidence,
                            sticky=sticky, suppressed=suppressed)
        return Decision(Action.KEEP, suppressed=suppressed)

    if sticky:
        # Re-failed too often: whatever the device says now, a person decides when it is
        # trusted again. The rule is never lowered, only marked (once) so that person finds it.
        if rule.sticky:
            return Decision(Action.KEEP, suppressed=suppressed)
        if safety.kill_switch:
            return Decision(Action.KEEP, suppressed=Suppression.KILL_SWITCH)
        return Decision(Action.REFRESH, effect=rule.effect, tier=rule.tier, reason=reason or rule.reason,
                        evidence=evidence if reason else rule.evidence, sticky=True, suppressed=suppressed)
    # The device wants less than the rule says: step down once the hold period has passed.
    calm = rule.calm_since if rule.calm_since is not None else now
    if now - calm < hold:
        return Decision(Action.KEEP, calm_since=calm)
    if safety.kill_switch:
        return Decision(Action.KEEP, calm_since=calm, suppressed=Suppression.KILL_SWITCH)
    step: str | None
    if rule.effect == Effect.NO_EXECUTE.value and target_rank < EFFECT_RANK[Effect.NO_SCHEDULE.value]:
        step = Effect.NO_SCHEDULE.value
    else:
        step = limited
    if step is None or (step == Effect.NONE.value and rule.effect == Effect.NONE.value):
        return Decision(Action.DELETE, why="recovered")
    # A device with nothing left to show keeps the record of why it was tainted.
    reason, evidence = (reason, evidence) if reason else (rule.reason, rule.evidence)
    return Decision(Action.UPDATE, effect=step,
                    tier=tier.value if (tier is not None and step == limited) else rule.tier, reason=reason,
                    evidence=evidence, calm_since=None)
