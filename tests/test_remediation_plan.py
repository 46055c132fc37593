"""Remediation decisions as plain data: exported names, rule bodies and every safety rule of
:func:`exporter.remediation.plan.decide`, plus properties checked over generated inputs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.catalog import BY_NAME
from exporter.config import TaintMode
from exporter.health.model import Condition, DeviceHealth, Tier
from exporter.k8s import names
from exporter.reasons import Suppression
from exporter.remediation.contract import Target, Verdict
from exporter.remediation.plan import ADMIN_DELETED, EFFECT_RANK, RECORD_REFRESH, Safety, decide, wanted
from exporter.remediation.record import OwnedRule

NOW = 1_750_000_000.0
HOLD = 600.0
UUID = "GPU-11111111-2222-3333-4444-555555555555"
T = Target(driver="gpu.nvidia.com", pool="node-a", device="gpu-3", uuid=UUID, gpu=UUID)
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def health(*tiers: Tier, last_seen: float = NOW, since: float = NOW - 5) -> DeviceHealth:
    conds = tuple(
        Condition(uuid=UUID, tier=t, reason=f"r_{t.value}", since=since, last_seen=last_seen, evidence=f"evidence {t.value}") for t in tiers
    )
    return DeviceHealth(uuid=UUID, conditions=conds)


HEALTHY = DeviceHealth(uuid=UUID)


def rule(
    effect: str, tier: str = "fatal", uuid: str = UUID, managed: bool = True, calm_since: float | None = None,
    reason: str | None = None, evidence: str | None = None, sticky: bool = False, refreshed_at: float | None = None,
) -> OwnedRule:
    """A rule as the agent wrote it for ``health(tier)`` (same reason and evidence), unless told otherwise."""
    return OwnedRule(
        name="r", driver=T.driver, pool=T.pool, device=T.device, uuid=uuid, effect=effect, tier=tier, managed=managed, calm_since=calm_since,
        reason=f"r_{tier}" if reason is None else reason, evidence=f"evidence {tier}" if evidence is None else evidence,
        sticky=sticky, refreshed_at=refreshed_at,
    )


def d(h: DeviceHealth, r: OwnedRule | None = None, mode: TaintMode = TaintMode.ENFORCE, now: float = NOW, admin_deleted_at: float | None = None, **safety):
    return decide(T, h, r, mode, Safety(**safety), HOLD, now, admin_deleted_at)


# ------------------------------------------------------------------------------ names and bodies


def test_rule_names_are_deterministic_valid_and_distinct():
    a = names.rule_name("node-a", "gpu.nvidia.com", "node-a", "gpu-3")
    assert a == names.rule_name("node-a", "gpu.nvidia.com", "node-a", "gpu-3")
    assert a.startswith(names.NAME_PREFIX) and DNS_SUBDOMAIN.match(a)
    assert a != names.rule_name("node-a", "gpu.nvidia.com", "node-a", "gpu-4")
    assert a != names.rule_name("node-a", "gpu.amd.com", "node-a", "gpu-3")  # same name, other driver
    long_node = "n" * 240 + ".example.com"
    x = names.rule_name(long_node, "gpu.nvidia.com", long_node, "gpu-1-mig-1g10gb-19-0")
    y = names.rule_name(long_node, "gpu.nvidia.com", long_node, "gpu-1-mig-1g10gb-19-1")
    assert len(x) <= 253 and DNS_SUBDOMAIN.match(x) and x != y  # truncated, still unique
    assert DNS_SUBDOMAIN.match(names.rule_name("Node_A", "d", "p", "GPU 0")), "upper case and odd characters are squeezed"


@given(st.text(min_size=0, max_size=300))
def test_label_value_is_always_a_valid_label_value(s):
    v = names.label_value(s)
    assert len(v) <= 63 and LABEL_VALUE.match(v)


def test_taint_key_is_in_our_domain():
    for tier in Tier:
        key = f"{names.TAINT_DOMAIN}/{tier.value}"
        assert key.split("/")[0].endswith(names.DOMAIN) and "kubernetes.io" not in key and "nvidia.com" not in key


def test_every_suppression_reason_is_in_the_metric_help():
    """Regression: the help omitted api_rejected and name_conflict, which the agent counts."""
    help_ = BY_NAME["dra_gpu_exporter_taint_suppressed_total"].help
    listed = re.fullmatch(r".*\(([a-z_, ]+)\)", help_).group(1).split(", ")
    assert listed == [s.value for s in Suppression]
    assert {"api_rejected", "name_conflict", "no_api", "budget"} <= set(listed)


def test_the_suppression_counter_is_only_counted_with_a_suppression():
    """Every reason the remediator can count goes through Notices.announce, which takes a
    Suppression (a stray string raises there): so the enum, and the help built from it, lists
    every reason the metric can carry. (Every module of the remediator is looked at.)"""
    writers = set()
    for src in sorted((Path(__file__).resolve().parent.parent / "exporter" / "remediation").glob("*.py")):
        for fn in ast.walk(ast.parse(src.read_text())):
            if isinstance(fn, ast.FunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "suppressed":
                        writers.add((src.name, fn.name))
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "announce":
                        what = node.args[1]
                        assert not isinstance(what, ast.Constant), f"{src.name} {fn.name}: announce with a bare string {what.value!r}"
    assert writers == {("writer.py", "announce")}


# ------------------------------------------------------------------------------ effect by tier and mode


@pytest.mark.parametrize("tier,effect", [(Tier.FATAL, "NoExecute"), (Tier.DEGRADED, "NoSchedule"), (Tier.INFORMATIONAL, "None")])
def test_enforce_effect_by_tier(tier, effect):
    dec = d(health(tier))
    assert (dec.action, dec.effect, dec.tier, dec.reason, dec.suppressed) == ("create", effect, tier.value, f"r_{tier.value}", "")
    assert dec.evidence == f"evidence {tier.value}"


def test_the_worst_condition_decides():
    dec = d(health(Tier.INFORMATIONAL, Tier.FATAL, Tier.DEGRADED))
    assert (dec.effect, dec.tier, dec.reason) == ("NoExecute", "fatal", "r_fatal")


def test_informational_without_none_support_writes_nothing():
    assert d(health(Tier.INFORMATIONAL), supports_none=False).action == "nothing"


@pytest.mark.parametrize("tier", list(Tier))
def test_shadow_writes_effect_none_for_every_tier(tier):
    dec = d(health(tier), mode=TaintMode.SHADOW)
    assert (dec.action, dec.effect, dec.tier) == ("create", "None", tier.value)


def test_shadow_without_none_support_writes_nothing():
    assert d(health(Tier.FATAL), mode=TaintMode.SHADOW, supports_none=False).action == "nothing"


def test_dry_run_decides_like_enforce_and_off_decides_nothing():
    assert d(health(Tier.FATAL), mode=TaintMode.DRY_RUN) == d(health(Tier.FATAL))
    assert d(health(Tier.FATAL), mode=TaintMode.OFF).action == "nothing"
    assert wanted(health(Tier.FATAL), TaintMode.OFF, True) == (None, Tier.FATAL)


def test_healthy_device_without_rule_needs_nothing():
    assert d(HEALTHY).action == "nothing"


# ------------------------------------------------------------------------------ safety


def test_node_wide_fault_gives_noschedule_only():
    dec = d(health(Tier.FATAL), verdict=Verdict.NODE_FAULT)
    assert (dec.action, dec.effect, dec.suppressed) == ("create", "NoSchedule", "node_fault")


def test_rate_limit_gives_noschedule_until_the_window_allows():
    dec = d(health(Tier.FATAL), verdict=Verdict.RATE_LIMITED)
    assert (dec.action, dec.effect, dec.suppressed) == ("create", "NoSchedule", "rate_limit")
    later = d(health(Tier.FATAL), rule("NoSchedule"))
    assert (later.action, later.effect) == ("update", "NoExecute")


def test_budget_exhausted_gives_effect_none_or_noschedule_without_none():
    dec = d(health(Tier.FATAL), verdict=Verdict.BUDGET_FULL)
    assert (dec.action, dec.effect, dec.suppressed) == ("create", "None", "budget")
    dec = d(health(Tier.FATAL), verdict=Verdict.BUDGET_FULL, supports_none=False)
    assert (dec.action, dec.effect, dec.suppressed) == ("create", "NoSchedule", "budget")


def test_limits_do_not_touch_lower_effects():
    for kw in ({"verdict": Verdict.NODE_FAULT}, {"verdict": Verdict.RATE_LIMITED}, {"verdict": Verdict.BUDGET_FULL}):
        assert d(health(Tier.DEGRADED), **kw).effect == "NoSchedule"
        assert d(health(Tier.DEGRADED), **kw).suppressed == ""


def test_a_rule_that_already_has_noexecute_keeps_it_under_limits():
    dec = d(health(Tier.FATAL), rule("NoExecute"), verdict=Verdict.NODE_FAULT)
    assert dec.action == "keep" and dec.suppressed == ""


def test_a_limit_never_lowers_an_existing_rule():
    """Regression: a fatal device whose rule is NoSchedule (rate-limited) lost it to effect None
    once the cluster budget filled up: the budget limit must cap a raise, not cause a step down."""
    dec = d(health(Tier.FATAL), rule("NoSchedule", calm_since=NOW - 2 * HOLD), verdict=Verdict.BUDGET_FULL)
    assert dec.action == "keep" and dec.suppressed == "budget"


def test_budget_suppressed_rule_stays_none_while_the_budget_is_used_up():
    dec = d(health(Tier.FATAL), rule("None"), verdict=Verdict.BUDGET_FULL)
    assert (dec.action, dec.suppressed) == ("keep", "budget")


def test_kill_switch_stops_create_raise_and_step_down():
    assert d(health(Tier.FATAL), kill_switch=True).action == "nothing"
    assert d(health(Tier.FATAL), kill_switch=True).suppressed == "kill_switch"
    assert (d(health(Tier.FATAL), rule("NoSchedule", "degraded"), kill_switch=True).action) == "keep"
    calm = d(HEALTHY, rule("NoExecute", calm_since=NOW - HOLD), kill_switch=True)
    assert (calm.action, calm.suppressed) == ("keep", "kill_switch")


def test_kill_switch_stops_the_hardware_swap_delete_too():
    """Regression: the swap delete bypassed the node's kill switch ("stops every write")."""
    dec = d(HEALTHY, rule("NoExecute", uuid="GPU-00000000-0000-0000-0000-000000000000"), kill_switch=True)
    assert dec.action == "keep" and dec.suppressed == "kill_switch"


def test_unmanaged_rule_is_never_touched():
    for h in (HEALTHY, health(Tier.FATAL)):
        for r in (rule("NoSchedule", managed=False, calm_since=NOW - 10 * HOLD), rule("None", managed=False, uuid="GPU-other")):
            dec = d(h, r)
            assert (dec.action, dec.suppressed) == ("nothing", "unmanaged")


def test_hardware_swap_deletes_the_rule():
    dec = d(health(Tier.FATAL), rule("NoExecute", uuid="GPU-00000000-0000-0000-0000-000000000000"))
    assert (dec.action, dec.why) == ("delete", "hardware_swap")


def test_admin_deleted_rule_is_not_recreated_without_new_evidence():
    dec = d(health(Tier.FATAL, last_seen=NOW - 10), admin_deleted_at=NOW - 5)
    assert (dec.action, dec.suppressed) == ("nothing", "admin_deleted")
    dec = d(health(Tier.FATAL, last_seen=NOW), admin_deleted_at=NOW - 5)
    assert (dec.action, dec.effect) == ("create", "NoExecute")


# ------------------------------------------------------------------------------ escalation and step-down


def test_escalation_updates_the_rule():
    dec = d(health(Tier.FATAL), rule("NoSchedule", "degraded"))
    assert (dec.action, dec.effect, dec.tier) == ("update", "NoExecute", "fatal")
    dec = d(health(Tier.DEGRADED), rule("None", "informational"))
    assert (dec.action, dec.effect, dec.tier) == ("update", "NoSchedule", "degraded")


def test_same_effect_other_tier_updates_the_tier_in_shadow():
    dec = d(health(Tier.FATAL), rule("None", "informational"), mode=TaintMode.SHADOW)
    assert (dec.action, dec.effect, dec.tier) == ("update", "None", "fatal")


def test_recovery_steps_down_one_level_per_hold_then_deletes():
    r = rule("NoExecute")
    first = d(HEALTHY, r)
    assert first.action == "keep" and first.calm_since == NOW  # the hold starts now
    r.calm_since = first.calm_since
    assert d(HEALTHY, r, now=NOW + HOLD - 1).action == "keep"
    down = d(HEALTHY, r, now=NOW + HOLD)
    assert (down.action, down.effect, down.tier, down.calm_since) == ("update", "NoSchedule", "fatal", None)
    r2 = rule("NoSchedule", "fatal", calm_since=None)
    again = d(HEALTHY, r2, now=NOW + HOLD + 1)
    assert again.action == "keep" and again.calm_since == NOW + HOLD + 1  # a fresh hold for the next step
    r2.calm_since = again.calm_since
    gone = d(HEALTHY, r2, now=NOW + 2 * HOLD + 1)
    assert (gone.action, gone.why) == ("delete", "recovered")


def test_fatal_to_degraded_steps_to_noschedule_with_the_new_tier():
    dec = d(health(Tier.DEGRADED), rule("NoExecute", calm_since=NOW - HOLD))
    assert (dec.action, dec.effect, dec.tier) == ("update", "NoSchedule", "degraded")


def test_refailing_during_the_hold_resets_it():
    dec = d(health(Tier.FATAL), rule("NoExecute", calm_since=NOW - HOLD + 1))
    assert dec.action == "keep" and dec.calm_since is None


def test_same_effect_with_another_reason_refreshes_the_record():
    dec = d(health(Tier.FATAL), rule("NoExecute", reason="xid_48", evidence="XID 48", refreshed_at=NOW - RECORD_REFRESH))
    assert (dec.action, dec.effect, dec.tier, dec.reason, dec.evidence) == ("refresh", "NoExecute", "fatal", "r_fatal", "evidence fatal")
    # not within a minute of the last write: conditions clearing one by one during a recovery
    # must not rename a rule that is about to step down
    assert d(health(Tier.FATAL), rule("NoExecute", reason="xid_48", refreshed_at=NOW - 1)).action == "keep"


def test_the_rule_keeps_naming_its_condition_while_that_holds():
    both = DeviceHealth(uuid=UUID, conditions=(
        Condition(uuid=UUID, tier=Tier.FATAL, reason="gpu_lost", since=NOW, last_seen=NOW, evidence="lost"),
        Condition(uuid=UUID, tier=Tier.FATAL, reason="xid_79", since=NOW, last_seen=NOW, evidence="XID 79"),
    ))
    assert d(both, rule("NoExecute", reason="xid_79", evidence="XID 79")).action == "keep"  # no rewrite per new condition
    assert d(both).reason == "gpu_lost"  # a new rule takes the first one


def test_evidence_only_changes_are_refreshed_at_most_every_record_refresh():
    """An event storm on a tainted GPU changes its evidence on every event: not a write each."""
    assert d(health(Tier.FATAL), rule("NoExecute", evidence="older", refreshed_at=NOW - 1)).action == "keep"
    assert d(health(Tier.FATAL), rule("NoExecute", evidence="older", refreshed_at=NOW - RECORD_REFRESH)).action == "refresh"
    assert d(health(Tier.FATAL), rule("NoExecute", evidence="older")).action == "refresh"  # adopted: never written by us
    assert d(health(Tier.FATAL), rule("NoExecute", refreshed_at=NOW - 10 * RECORD_REFRESH)).action == "keep"  # nothing new


def test_a_refresh_is_a_write_the_kill_switch_stops():
    dec = d(health(Tier.FATAL), rule("NoExecute", reason="xid_48"), kill_switch=True)
    assert (dec.action, dec.suppressed) == ("keep", "kill_switch")


def sticky(*tiers: Tier) -> DeviceHealth:
    return DeviceHealth(uuid=UUID, conditions=health(*tiers).conditions, sticky=True)


def test_a_sticky_device_marks_its_rule_at_once():
    assert d(sticky(Tier.FATAL)).sticky is True  # created marked
    dec = d(sticky(Tier.FATAL), rule("NoExecute", refreshed_at=NOW))
    assert (dec.action, dec.effect, dec.sticky) == ("refresh", "NoExecute", True)
    # sticky with only a degraded condition left: marked, not stepped down to NoSchedule
    dec = d(sticky(Tier.DEGRADED), rule("NoExecute", calm_since=NOW - 10 * HOLD))
    assert (dec.action, dec.effect, dec.sticky) == ("refresh", "NoExecute", True)


def test_a_sticky_rule_is_never_stepped_down_or_removed_by_the_agent():
    """The label outlives the agent's memory: after a restart the device looks healthy."""
    r = rule("NoExecute", sticky=True, calm_since=NOW - 10 * HOLD)
    for h in (HEALTHY, health(Tier.DEGRADED), health(Tier.INFORMATIONAL)):
        assert d(h, r).action == "keep"
    assert d(health(Tier.FATAL), rule("NoSchedule", "degraded", sticky=True)).action == "update"  # raising still happens
    assert d(HEALTHY, rule("NoExecute", uuid="GPU-new", sticky=True)).why == "hardware_swap"  # another board


def test_none_rule_is_deleted_after_the_hold():
    dec = d(HEALTHY, rule("None", "informational", calm_since=NOW - HOLD))
    assert (dec.action, dec.why) == ("delete", "recovered")


# ------------------------------------------------------------------------------ properties

tiers = st.lists(st.sampled_from(list(Tier)), max_size=3)
effects = st.sampled_from(["None", "NoSchedule", "NoExecute"])
rules = st.one_of(
    st.none(),
    st.builds(
        rule,
        effect=effects,
        tier=st.sampled_from([t.value for t in Tier]),
        uuid=st.sampled_from([UUID, "", "GPU-other"]),
        managed=st.booleans(),
        calm_since=st.one_of(st.none(), st.floats(NOW - 3 * HOLD, NOW)),
        reason=st.sampled_from([None, "", "r_other"]),
        evidence=st.sampled_from([None, "", "older evidence"]),
        sticky=st.booleans(),
        refreshed_at=st.one_of(st.none(), st.floats(NOW - 3 * RECORD_REFRESH, NOW)),
    ),
)
safeties = st.builds(Safety, kill_switch=st.booleans(), supports_none=st.booleans(), verdict=st.sampled_from(list(Verdict)))


@settings(max_examples=400, deadline=None)
@given(tiers, rules, st.sampled_from(list(TaintMode)), safeties)
def test_decisions_respect_every_safety_rule(ts, r, mode, safety):
    h = health(*ts)
    dec = decide(T, h, r, mode, safety, HOLD, NOW)
    writes = dec.action in ("create", "update", "refresh", "delete")
    assert dec.action in ("nothing", "keep", "create", "update", "refresh", "delete")
    assert dec.suppressed in {"", ADMIN_DELETED, *(s.value for s in Suppression)}
    if dec.action == "refresh":
        assert r is not None and (dec.effect, dec.tier) == (r.effect, r.tier)  # the record only
    if r is not None and r.sticky and dec.action in ("update", "delete"):
        # only a person lowers or removes a sticky rule; a hardware swap is another GPU
        assert dec.why == "hardware_swap" if dec.action == "delete" else EFFECT_RANK[dec.effect] >= EFFECT_RANK[r.effect]
    if r is not None and not r.managed:
        assert not writes  # managed=false: hands off
    if safety.kill_switch:
        assert not writes  # kill switch: no write at all
    if mode == TaintMode.OFF and r is None:
        assert dec.action == "nothing"  # (the engine does not call decide at all when off)
    if dec.action in ("create", "update"):
        assert dec.effect in EFFECT_RANK and dec.tier in {t.value for t in Tier}
        if dec.effect == "None":
            assert safety.supports_none
        raising = r is None or EFFECT_RANK[dec.effect] > EFFECT_RANK[r.effect]
        if mode == TaintMode.SHADOW and raising:
            assert dec.effect == "None"  # (a rule from enforce days may still be stepping down)
        if dec.effect == "NoExecute" and raising:
            assert safety.verdict is Verdict.ALLOWED
        if r is not None and EFFECT_RANK[dec.effect] < EFFECT_RANK[r.effect]:
            assert EFFECT_RANK[r.effect] - EFFECT_RANK[dec.effect] == 1  # one step at a time
            want, _ = wanted(h, mode, safety.supports_none)
            assert want is None or EFFECT_RANK[want] < EFFECT_RANK[r.effect], "a safety limit lowered a rule"
            assert r.calm_since is not None and NOW - r.calm_since >= HOLD  # only after the hold
    if dec.action == "create":
        assert r is None and h.worst is not None
    if dec.action == "delete":
        assert r is not None
        if dec.why != "hardware_swap":
            assert dec.why == "recovered" and r.effect != "NoExecute"
            assert wanted(h, mode, safety.supports_none)[0] is None


@settings(max_examples=200, deadline=None)
@given(tiers, effects, safeties)
def test_a_failing_device_never_loses_its_rule_to_a_step_down(ts, effect, safety):
    h = health(*ts)
    if h.worst in (None, Tier.INFORMATIONAL):
        return
    dec = decide(T, h, rule(effect, calm_since=NOW - 10 * HOLD), TaintMode.ENFORCE, safety, HOLD, NOW)
    assert dec.action != "delete"


# ------------------------------------------------------------------ fault-domain rails (issue 16)

from exporter.remediation.contract import Action, Effect  # noqa: E402
from exporter.remediation.rails import node_wide, settle_due, settling  # noqa: E402


def test_node_wide_is_a_majority_within_the_window():
    six_of_eight = {f"g{i}": 100.0 + 0.1 * i for i in range(6)}
    assert node_wide(six_of_eight, 8, 0.5, 2.0) == set(six_of_eight)
    assert node_wide({"g0": 100.0, "g1": 100.1, "g2": 100.2, "g3": 100.3}, 8, 0.5, 2.0) == set()  # half is not most
    assert node_wide({"g0": 100.0, "g1": 160.0}, 4, 0.5, 2.0) == set()  # a minute apart: independent
    assert node_wide({"g0": 100.0, "g1": 100.5, "g2": 101.0}, 4, 0.5, 2.0) == {"g0", "g1", "g2"}
    # failures far from the cluster are not swept into it
    assert node_wide({"g0": 0.0, "g1": 100.0, "g2": 100.5, "g3": 101.0}, 4, 0.5, 2.0) == {"g1", "g2", "g3"}
    assert node_wide({"g0": 100.0}, 1, 0.5, 2.0) == set()  # one GPU is never a node fault


def test_settling_waits_for_the_longer_window():
    assert settling(100.0, 101.9, 2.0, 1.0) and not settling(100.0, 102.0, 2.0, 1.0)
    assert settling(100.0, 104.0, 2.0, 5.0) and settle_due(100.0, 2.0, 5.0) == 105.0
    assert not settling(None, 100.0, 2.0, 2.0)


def test_a_settling_fatal_fault_is_fenced_with_noschedule_without_a_suppression():
    x = d(health(Tier.FATAL), verdict=Verdict.SETTLING)
    assert (x.action, x.effect, x.suppressed) == (Action.CREATE, Effect.NO_SCHEDULE.value, "")
    x = d(health(Tier.FATAL), rule("NoSchedule", "fatal"), verdict=Verdict.SETTLING)
    assert x.action == Action.KEEP  # raised only once the window is over
    x = d(health(Tier.FATAL), rule("NoSchedule", "fatal"))
    assert (x.action, x.effect) == (Action.UPDATE, "NoExecute")


def test_an_unreadable_budget_fails_safe_to_noschedule():
    x = d(health(Tier.FATAL), verdict=Verdict.BUDGET_UNAVAILABLE)
    assert (x.action, x.effect, x.suppressed) == (Action.CREATE, "NoSchedule", Suppression.BUDGET_UNAVAILABLE)
    x = d(health(Tier.FATAL), rule("NoExecute", "fatal"), verdict=Verdict.BUDGET_UNAVAILABLE)
    assert x.action == Action.KEEP  # a raised domain keeps what it has


def _imports(path: Path) -> set[str]:
    """Absolute module names a module imports (relative imports resolved against its package)."""
    pkg = ".".join(path.relative_to(Path(__file__).parents[1]).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            out.add(f"{base}.{node.module}" if node.level and node.module else (node.module or base))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_layering_back_edges():
    """The k8s layer never imports the remediator (names it writes live in exporter.k8s.names),
    and the remediator never imports the metrics layer (its report has its own views)."""
    root = Path(__file__).parents[1] / "exporter"
    for f in (root / "k8s").glob("*.py"):
        assert not [m for m in _imports(f) if m.startswith("exporter.remediation")], f
    for f in (root / "remediation").glob("*.py"):
        assert not [m for m in _imports(f) if m.startswith("exporter.metrics")], f


def test_the_engine_is_thin_and_every_seam_is_typed():
    """Issue 26: engine.py fits in one sitting; nothing in the remediator takes or returns Any
    in a signature or probes its collaborators with hasattr/getattr (they are Protocols)."""
    root = Path(__file__).parents[1] / "exporter" / "remediation"
    assert len((root / "engine.py").read_text().splitlines()) <= 250
    for f in sorted(root.glob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                annotations = [a.annotation for a in (*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs) if a.annotation]
                annotations += [a.annotation for a in (node.args.vararg, node.args.kwarg) if a is not None and a.annotation]
                for ann in [*annotations, node.returns]:
                    if ann is not None:
                        assert "Any" not in {n.id for n in ast.walk(ann) if isinstance(n, ast.Name)}, f"{f.name}:{node.lineno} {node.name}: Any in a signature"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("hasattr", "getattr"), f"{f.name}:{node.lineno}: {node.func.id}"


def test_every_remediation_delay_is_a_validated_flag_and_env_var(monkeypatch):
    from exporter.config import ConfigError, build_parser, resolve

    def cfg(*argv: str):
        return resolve(build_parser().parse_args(["--node-name", "n", *argv]))

    c = cfg()
    assert (c.taint_settle_seconds, c.node_fault_window, c.fault_clear_seconds, c.taint_hold_seconds) == (2.0, 2.0, 120.0, 1800.0)
    c = cfg("--taint-settle-seconds", "5", "--node-fault-window", "1.5", "--fault-clear-seconds", "30")
    assert (c.taint_settle_seconds, c.node_fault_window, c.fault_clear_seconds) == (5.0, 1.5, 30.0)
    monkeypatch.setenv("DRA_GPU_EXPORTER_TAINT_SETTLE_SECONDS", "0.5")
    monkeypatch.setenv("DRA_GPU_EXPORTER_NODE_FAULT_WINDOW", "3")
    monkeypatch.setenv("DRA_GPU_EXPORTER_FAULT_CLEAR_SECONDS", "60")
    c = cfg()
    assert (c.taint_settle_seconds, c.node_fault_window, c.fault_clear_seconds) == (0.5, 3.0, 60.0)
    for flag, bad in (("--taint-settle-seconds", "-1"), ("--node-fault-window", "nan"), ("--fault-clear-seconds", "1e9")):
        with pytest.raises(ConfigError):
            cfg(flag, bad)


@given(
    mode=st.sampled_from(list(TaintMode)),
    safety=st.builds(Safety, st.booleans(), st.booleans(), st.sampled_from(list(Verdict))),
    hold=st.floats(0, 3600),
    now=st.floats(0, 1e9),
    sticky=st.booleans(),
)
def test_a_healthy_device_without_a_rule_never_needs_a_decision(mode, safety, hold, now, sticky) -> None:
    # Remediator._decide_and_apply skips plan.decide and the writer for such a device (the
    # steady state of nearly every device on every pass); this is what makes that skip exact.
    d = decide(T, DeviceHealth(uuid=UUID, sticky=sticky), None, mode, safety, hold, now)
    assert d.action is Action.NOTHING and not d.suppressed
