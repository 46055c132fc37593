"""The safety rails with plain data (issue 26): settle window, node-wide test, rate window and the
budget's take, wait, cancel and return, on numbers and a LocalBudget, no cluster."""

from __future__ import annotations

import pytest

from exporter.config import TaintMode
from exporter.k8s.connection import ApiError
from exporter.remediation.contract import RemediationPolicy, Verdict
from exporter.remediation.rails import LocalBudget, SafetyRails

NOW = 1000.0


def rails(capacity: int = 8, **kw) -> tuple[SafetyRails, LocalBudget]:
    budget = LocalBudget(capacity)
    kw.setdefault("settle", 2.0)
    kw.setdefault("node_fault_window", 2.0)
    return SafetyRails(RemediationPolicy(node="n", **kw), budget), budget


def test_a_new_fault_settles_for_the_longer_window_then_is_allowed_once():
    r, budget = rails(settle=2.0, node_fault_window=3.0)
    r.begin(NOW, {"g0": NOW}, 8, ())
    assert r.check("g0", holds=False, since=NOW, node_fault=False, now=NOW + 1, kill_switch=False) is Verdict.SETTLING
    assert r.next_due == NOW + 3.0 and budget.held() == set()
    r.begin(NOW + 3, {"g0": NOW}, 8, ())
    assert r.next_due is None
    assert r.check("g0", holds=False, since=NOW, node_fault=False, now=NOW + 3, kill_switch=False) is Verdict.ALLOWED
    assert budget.held() == {"n.g0"} and r.raised == {"g0"}
    assert r.check("g0", holds=False, since=NOW, node_fault=False, now=NOW + 4, kill_switch=False) is Verdict.ALLOWED  # raised: not taken again
    assert budget.held() == {"n.g0"}


def test_a_node_wide_fault_is_noschedule_only():
    r, budget = rails()
    fatal = {f"g{i}": NOW + 0.1 * i for i in range(6)}
    nodewide = r.begin(NOW + 5, fatal, 8, ())
    assert nodewide == set(fatal)
    assert r.check("g0", holds=False, since=NOW, node_fault=True, now=NOW + 5, kill_switch=False) is Verdict.NODE_FAULT and budget.held() == set()


def test_the_rate_window_counts_units_and_forgets_after_the_window():
    r, _ = rails(rate_limit=2, rate_window=600.0, settle=0.0, node_fault_window=0.0)
    r.begin(NOW, {}, 8, ())
    assert [r.check(u, holds=False, since=None, node_fault=False, now=NOW, kill_switch=False) for u in ("a", "b", "c")] == [Verdict.ALLOWED, Verdict.ALLOWED, Verdict.RATE_LIMITED]
    r.begin(NOW + 601, {}, 8, ())
    assert r.check("c", holds=False, since=None, node_fault=False, now=NOW + 601, kill_switch=False) is Verdict.ALLOWED


def test_a_full_budget_waits_and_a_freed_slot_is_taken_and_returned():
    r, budget = rails(capacity=1, settle=0.0, node_fault_window=0.0)
    budget.take("other.gX")
    r.begin(NOW, {}, 8, ())
    assert r.check("g0", holds=False, since=None, node_fault=False, now=NOW, kill_switch=False) is Verdict.BUDGET_FULL
    assert r.waiting == {"g0"} and r.budget_exhausted
    budget.release("other.gX")
    assert r.check("g0", holds=False, since=None, node_fault=False, now=NOW + 1, kill_switch=False) is Verdict.ALLOWED
    assert not r.budget_exhausted and budget.held() == {"n.g0"}
    r.return_slots({"g0"})  # still holding: kept
    assert budget.held() == {"n.g0"}
    r.return_slots(set())  # neither holds nor wants NoExecute: returned
    assert budget.held() == set() and r.raised == set()


def test_a_waiting_unit_that_recovers_stops_waiting():
    class Recording(LocalBudget):
        cancelled: list[str] = []

        def cancel(self, holder: str) -> None:
            self.cancelled.append(holder)

    budget = Recording(0)
    r = SafetyRails(RemediationPolicy(node="n", settle=0.0, node_fault_window=0.0), budget)
    r.begin(NOW, {}, 8, ())
    assert r.check("g0", holds=False, since=None, node_fault=False, now=NOW, kill_switch=False) is Verdict.BUDGET_FULL
    r.return_slots(set())
    assert budget.cancelled == ["n.g0"] and not r.budget_exhausted


def test_an_unreadable_budget_fails_safe_and_says_why():
    class Broken(LocalBudget):
        def take(self, holder: str) -> bool:
            raise ApiError(status=404, reason="NotFound", message="configmap missing")

    r = SafetyRails(RemediationPolicy(node="n", settle=0.0, node_fault_window=0.0), Broken(8))
    r.begin(NOW, {}, 8, ())
    assert r.check("g0", holds=False, since=None, node_fault=False, now=NOW, kill_switch=False) is Verdict.BUDGET_UNAVAILABLE
    assert "configmap missing" in r.budget_error and r.raised == set()


@pytest.mark.parametrize("holds", [True, False])
def test_the_kill_switch_and_dry_run_take_no_slot(holds):
    r, budget = rails(settle=0.0, node_fault_window=0.0)
    r.begin(NOW, {}, 8, ())
    assert r.check("g0", holds=False, since=None, node_fault=False, now=NOW, kill_switch=True) is Verdict.ALLOWED and budget.held() == set() and r.raised == set()
    d, dbudget = rails(settle=0.0, node_fault_window=0.0, mode=TaintMode.DRY_RUN)
    d.begin(NOW, {}, 8, ())
    assert d.check("g0", holds=holds, since=None, node_fault=False, now=NOW, kill_switch=False) is Verdict.ALLOWED and dbudget.held() == set() and d.raised == {"g0"}
    d.return_slots(set())
    assert d.raised == set()


def test_a_domain_whose_rule_holds_noexecute_holds_its_slot_until_it_no_longer_does():
    """What the record holds is what the rails count (an adopted NoExecute rule's slot, taken by
    an earlier process): derived at each pass's start, returned once the rule no longer holds it."""
    r, budget = rails()
    budget.take("n.g0")  # the earlier process's slot
    r.begin(NOW, {}, 8, {"g0"})
    assert r.raised == {"g0"}
    r.return_slots({"g0"})
    assert budget.held() == {"n.g0"}
    r.begin(NOW + 1, {}, 8, ())
    r.return_slots(set())
    assert budget.held() == set() and r.raised == set()
