"""The sources' own counters as self-metrics, and a dense node's first claim fetch.

The agent is built by the production wiring around a simulated node (real gRPC kubelet, real HTTP
API emulation); its own /metrics is scraped. Cycles are driven by hand (interval: an hour).
"""

from __future__ import annotations

from test_agent_isolation import MIXED, simulated_node

from drasim.backend import SimClock
from drasim.node import SimulatedNode
from drasim.scenario import parse_scenario
from exporter.config import TaintMode

REQ, ERR = "dra_gpu_exporter_source_requests_total", "dra_gpu_exporter_source_errors_total"
RELIST, RESTART = "dra_gpu_exporter_source_relists_total", "dra_gpu_exporter_source_watch_restarts_total"


def test_each_sources_requests_and_errors_are_self_metrics():
    with simulated_node(MIXED, pod_label_allowlist=("app",)) as n:
        m = n.scrape()
        # the claims the agent reads: those on a GPU shared by consumable capacity (the others'
        # devices the kubelet's answer and the slices resolve)
        shared = {g.device_name for g in n.sc.gpus if g.consumable_shares}
        allocations = n.agent.found.get(n.agent.src.get("kubelet").slot).allocations
        claims = {(a.claim_namespace, a.claim_name) for a in allocations if a.claim_name and a.device in shared}
        assert claims
        assert m.value(REQ, source="kubelet", verb="list") == 2  # the start-up cycle's and this one's
        assert m.value(REQ, source="slices", verb="list") == 1 and m.value(REQ, source="slices", verb="watch") >= 1
        assert m.value(REQ, source="claims", verb="get") == len(claims)  # each claim once, then cached
        assert m.value(REQ, source="pods", verb="list") == 1  # cached for its TTL
        for source in ("kubelet", "slices", "claims", "pods"):
            assert m.value(ERR, source=source) == 0, source
        assert m.value(RELIST, source="slices") == 0 and m.value(RESTART, source="slices") == 0
        assert m.find(RELIST, source="kubelet") == []  # only a watching source has these

        # 410 Gone on the slices' next watch: a relist and a new watch, no error
        n.api.fail_next("GET", r"/resourceslices", 410, watch=True, message="too old resource version")
        n.api.close_watches()
        from kit_helpers import wait_until

        wait_until(lambda: n.scrape().value(RELIST, source="slices") == 1, timeout=60, message="the relist counted")
        m = n.scrape()
        assert m.value(REQ, source="slices", verb="list") == 2 and m.value(RESTART, source="slices") >= 1
        assert m.value(ERR, source="slices") == 0

        # the kubelet goes away: its List fails, counted
        n.kubelet.stop()
        m = n.scrape()
        assert m.value(ERR, source="kubelet") >= 1
        assert m.value("dra_gpu_exporter_collector_success", collector="kubelet") == 0


def many_claims(claims: int = 64) -> dict:
    # eight claims on each GPU, by consumable capacity: the claims the agent reads (their consumed memory)
    gpus = [{"name": f"g{i}", "consumable_shares": True} for i in range(8)]
    cl = [{"namespace": "ns", "name": f"claim-{c}", "devices": [f"g{c % 8}"], "memory": "10Gi"} for c in range(claims)]
    pods = [{"namespace": "ns", "name": f"pod-{p}", "containers": [{"name": "main", "claims": [f"claim-{2 * p}", f"claim-{2 * p + 1}"]}]} for p in range(claims // 2)]
    return {"name": "many-claims", "node": "n-many", "gpus": gpus, "claims": cl, "pods": pods}


def test_a_dense_nodes_first_claim_fetch_is_waited_for_while_it_progresses():
    """Every claim answers, slowly enough that the first fetch of all of them takes several API
    deadlines (64 claims, 8 GETs in flight, 0.3 s each: ~2.4 s against a 1 s deadline). The
    first cycle waits while answers keep coming: /readyz is "ready", not "ready (degraded)", and
    every claim is joined from the first snapshot on."""
    sc = parse_scenario(many_claims())
    with SimulatedNode(sc, SimClock(scale=1e-6), bookmark_interval=0.2, kubelet_qps=None) as node:
        node.start(api_setup=lambda api: api.delay_next(r"/resourceclaims/", 0.3, count=10_000))
        agent = node.start_agent(interval=3600.0, call_timeout=1.0, taint_mode=TaintMode.OFF)
        assert agent.readiness() == (True, "ready")
        assert agent.snapshot is not None and len(agent.snapshot.claims) == 64
        assert agent.status["claims"].success
        gets = [r for r in node.api.requests if "/resourceclaims/" in r.path]
        assert len(gets) == 64 and all(r.status == 200 for r in gets)
