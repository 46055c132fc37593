"""Several claims on one GPU by consumable capacity (KEP-5075), in NVIDIA's ConsumableShares format.

The simulated node publishes its shared GPUs as NVIDIA's driver does with ``ConsumableShares`` in
memory mode (``allowMultipleAllocations: true``, ``memory`` capacity with a request policy in 1 Mi
steps), and each claim's allocation states its ``shareID`` and ``consumedCapacity``. The agent,
built by the production wiring around the API emulation and the gRPC kubelet, must: attribute
every claim once; split the GPU between its claims by the memory each consumed (``rule="capacity"``,
shares summing to 1), energy and device-seconds the same way; fetch only the claims on shared
GPUs; and, with the GPU tainted NoExecute, count every claim's pods as pending eviction.
"""

from __future__ import annotations

import math

from kit_helpers import scrape_samples, wait_until
from validation import validate_strict

from drasim import objects
from drasim.backend import SimClock
from drasim.node import SimulatedNode
from drasim.scenario import parse_scenario
from exporter.config import TaintMode
from exporter.health.engine import HealthPolicy
from exporter.remediation.evictions import EVENT_REASON

GIB = 2**30
# gpu0: three claims (10, 20 and 50 Gi of 80), claim b held by two pods; gpu1: two claims (20, 60);
# gpu2: one claim on a GPU allocated whole (no claim GET for it)
SCENARIO = {
    "name": "consumable", "node": "shared-node",
    "gpus": [{"name": "gpu0", "consumable_shares": True, "utilization": 0.6, "memory_used": 0.5},
             {"name": "gpu1", "consumable_shares": True, "utilization": 0.3, "memory_used": 0.5},
             {"name": "gpu2", "utilization": 0.5}],
    "claims": [{"namespace": "ml", "name": "a", "devices": ["gpu0"], "memory": "10Gi"},
               {"namespace": "ml", "name": "b", "devices": ["gpu0"], "memory": "20Gi"},
               {"namespace": "ml", "name": "c", "devices": ["gpu0"], "memory": "50Gi"},
               {"namespace": "team", "name": "d", "devices": ["gpu1"], "memory": "20Gi"},
               {"namespace": "team", "name": "e", "devices": ["gpu1"], "memory": "60Gi"},
               {"namespace": "team", "name": "whole", "devices": ["gpu2"]}],
    "pods": [{"namespace": "ml", "name": "pa", "containers": [{"name": "main", "claims": ["a"]}]},
             {"namespace": "ml", "name": "pb1", "containers": [{"name": "main", "claims": ["b"]}]},
             {"namespace": "ml", "name": "pb2", "containers": [{"name": "main", "claims": ["b"]}]},
             {"namespace": "ml", "name": "pc", "containers": [{"name": "main", "claims": ["c"]}]},
             {"namespace": "team", "name": "pd", "containers": [{"name": "main", "claims": ["d"]}]},
             {"namespace": "team", "name": "pe", "containers": [{"name": "main", "claims": ["e"]}]},
             {"namespace": "team", "name": "pw", "containers": [{"name": "main", "claims": ["whole"]}]}],
}
WANT = {"gpu0": {("ml", "a"): 10 / 80, ("ml", "b"): 20 / 80, ("ml", "c"): 50 / 80},
        "gpu1": {("team", "d"): 20 / 80, ("team", "e"): 60 / 80}}
PODS = {("ml", "a"): ("pa",), ("ml", "b"): ("pb1", "pb2"), ("ml", "c"): ("pc",),
        ("team", "d"): ("pd",), ("team", "e"): ("pe",)}


def test_the_simulated_objects_are_nvidias_format_and_valid() -> None:
    sc = parse_scenario(SCENARIO)
    sl = objects.resource_slice(sc)
    dev = {d["name"]: d for d in sl["spec"]["devices"]}
    assert dev["gpu-0"]["allowMultipleAllocations"] is True and "allowMultipleAllocations" not in dev["gpu-2"]
    assert dev["gpu-0"]["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Mi"
    claims = {c["metadata"]["name"]: c for c in objects.resource_claims(sc, list(sc.pods))}
    (res,) = claims["b"]["status"]["allocation"]["devices"]["results"]
    assert res["consumedCapacity"] == {"memory": "20Gi"} and res["shareID"]
    assert "shareID" not in claims["whole"]["status"]["allocation"]["devices"]["results"][0]
    for version in ("1.34", "1.37"):  # consumable capacity is in the v1 schema since 1.34
        validate_strict(sl, version)
        for c in claims.values():
            validate_strict(c, version)


def _shares(m: dict, uuid: str) -> dict[tuple[str, str], tuple[float, str]]:
    rows = m.get("dra_pod_device_share_ratio", [])
    return {(lb["namespace"], lb["pod"]): (v, lb["rule"]) for lb, v in rows if lb["uuid"] == uuid}


def _by_claim(m: dict, name: str) -> dict[tuple[str, str], float]:
    return {(lb["namespace"], lb["claim"]): v for lb, v in m.get(name, [])}


def test_shares_energy_and_device_seconds_follow_consumed_memory_and_noexecute_counts_every_pod() -> None:
    sc = parse_scenario({**SCENARIO, "faults": [{"kind": "xid", "gpu": "gpu0", "at": "10h", "code": 79},
                                                {"kind": "lost", "gpu": "gpu0", "at": "10h"}]})
    clock = SimClock(20.0)
    with SimulatedNode(sc, clock, bookmark_interval=0.2, kubelet_qps=None) as node:
        node.start()
        agent = node.start_agent(interval=0.1, taint_mode=TaintMode.ENFORCE, taint_settle_seconds=1.0,
                                 health_policy=HealthPolicy(clear_hold=60.0), remediation_resync=0.2)
        url = agent.server.url

        def billed() -> dict | None:
            m = scrape_samples(url)
            seconds = _by_claim(m, "dra_claim_device_seconds_total")
            return m if all(seconds.get(k, 0) > 0 for want in WANT.values() for k in want) else None

        m = wait_until(billed, timeout=60, interval=0.1, message="device-seconds for every claim")
        # every claim once, each with its one device and its pods
        devices = _by_claim(m, "dra_claim_devices")
        assert devices == {**dict.fromkeys(PODS, 1.0), ("team", "whole"): 1.0}
        assert _by_claim(m, "dra_claim_pods") == {**{k: float(len(p)) for k, p in PODS.items()}, ("team", "whole"): 1.0}
        for gpu, want in WANT.items():
            shares = _shares(m, node.uuid(gpu))
            assert {r for _, r in shares.values()} == {"capacity"}
            assert math.isclose(sum(v for v, _ in shares.values()), 1.0)
            for claim, part in want.items():
                for pod in PODS[claim]:
                    assert math.isclose(shares[(claim[0], pod)][0], part / len(PODS[claim])), (gpu, claim, pod)
        assert {r for _, r in _shares(m, node.uuid("gpu2")).values()} == {"equal"}

        # energy and device-seconds split the same way: within a GPU, claim / claim = consumed / consumed
        def split_ok() -> bool:
            m = scrape_samples(url)
            for name in ("dra_claim_energy_joules_total", "dra_claim_device_seconds_total"):
                got = _by_claim(m, name)
                for want in WANT.values():
                    total = sum(got.get(k, 0.0) for k in want)
                    if total <= 0 or any(not math.isclose(got[k] / total, p, rel_tol=1e-6) for k, p in want.items()):
                        return False
            return True

        wait_until(split_ok, timeout=30, interval=0.1, message="energy and device-seconds split by consumed memory")
        m = scrape_samples(url)
        pods = {(lb["namespace"], lb["pod"]): v for lb, v in m["dra_pod_device_seconds_total"]}
        assert math.isclose(pods[("ml", "pb1")], pods[("ml", "pb2")], rel_tol=1e-6)
        assert math.isclose(pods[("ml", "pb1")] * 2 / pods[("ml", "pa")], 2.0, rel_tol=1e-6)

        # only the shared GPUs' claims were read from the API: their consumed capacity is needed
        gets = {r.path.rsplit("/", 1)[1] for r in node.api.requests
                if r.method == "GET" and "/resourceclaims/" in r.path}
        assert gets == {"a", "b", "c", "d", "e"}

        # gpu0 falls off the bus: NoExecute on it, and every pod of its three claims is pending eviction
        clock.advance_to(10 * 3600.0)
        def pending() -> float | None:
            pending = scrape_samples(url).get("dra_taint_pods_pending_eviction", [])
            rows = [v for lb, v in pending if lb["device"] == "gpu-0"]
            return rows[0] if rows and rows[0] > 0 else None

        assert wait_until(pending, timeout=90, interval=0.1, message="gpu-0 tainted NoExecute") == 4

        # ... and, past the grace, each of those pods is told in a Warning Event of its own
        def told() -> set[str] | None:
            events = node.api.list("events.k8s.io", "events", namespace="ml")
            pods = {e["regarding"]["name"] for e in events if e["reason"] == EVENT_REASON}
            return pods if len(pods) == 4 else None

        told_pods = wait_until(told, timeout=90, interval=0.1, message="the overdue pods' Events")
        assert told_pods == {"pa", "pb1", "pb2", "pc"}
