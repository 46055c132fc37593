"""A node that churns (issue 33): short jobs with new names every interval (drasim.churn), through the
simulated node's kubelet and the API emulation, scraped over HTTP after every cycle. What holds
without timing: every job that held its GPU for two intervals is billed (claim and pod series
with device-seconds and energy), counters never fall, the retained series never exceed the
active ones plus the cap, and retained holders expire. CPU per cycle, RSS and requests per new
claim are measured by ``python bench/run.py churn``.
"""

from __future__ import annotations

from kit_helpers import scrape_samples, wait_until

from drasim.backend import SimClock
from drasim.churn import NAMESPACE, Churn
from drasim.node import SimulatedNode
from drasim.scenario import bundled_scenarios, load_scenario
from exporter.config import TaintMode

COUNTERS = ("dra_claim_energy_joules_total", "dra_claim_device_seconds_total", "dra_pod_energy_joules_total",
            "dra_pod_device_seconds_total")


def batch_counters(url: str) -> dict[tuple[str, str], float]:
    """(metric, claim or pod) -> value of the churn jobs' billing counters."""
    samples = scrape_samples(url)
    return {(name, labels.get("claim") or labels["pod"]): v for name in COUNTERS
            for labels, v in samples.get(name, []) if labels["namespace"] == NAMESPACE}


def test_a_churning_node_bills_every_job_within_a_series_cap_and_forgets_them():
    sc = load_scenario(bundled_scenarios()["small-node"])
    clock = SimClock(scale=1e-6)
    with SimulatedNode(sc, clock, bookmark_interval=0.2, kubelet_qps=None) as node:
        node.start()
        clock.pause()
        agent = node.start_agent(interval=3600.0, call_timeout=2.0, taint_mode=TaintMode.OFF)
        wait_until(lambda: agent.src.get("slices").watcher.synced, timeout=60, message="ResourceSlices listed")
        acc = agent.out.usage
        acc.max_series, acc.retention = 40, 6.0  # 3 jobs a step: the cap binds after 4 steps
        churn = Churn(node, per_step=3, hold_steps=2)
        best: dict[tuple[str, str], float] = {}
        for _ in range(30):
            churn.step()
            clock.advance_to(clock.now() + 0.5)
            agent.run_cycle()
            seen = batch_counters(agent.server.url)
            for key, v in seen.items():
                assert v >= best.get(key, 0.0), key  # never falls while it has a series
                best[key] = v
            active = 4 * churn.per_step * churn.hold_steps  # live jobs: a claim and a pod, 2 counters each
            assert len(seen) <= active + acc.max_series
        assert len(best) > active + acc.max_series  # the cap did bind
        left = [j for j in churn.jobs if j.left is not None]
        assert len(left) >= 80
        for j in left:  # held for two intervals: billed, claim and pod
            for name in COUNTERS:
                assert best.get((name, j.claim if "claim" in name else j.pod), 0.0) > 0.0, (name, j)
        # the churn stops: once the retention has passed, no job keeps a series
        churn.per_step = 0
        for _ in range(churn.hold_steps + 1):
            churn.step()
            clock.advance_to(clock.now() + 0.5)
            agent.run_cycle()
        clock.advance_to(clock.now() + acc.retention + 1.0)
        agent.run_cycle()
        assert batch_counters(agent.server.url) == {}
