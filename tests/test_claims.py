"""ClaimCache and NodePods against the in-process API server over real HTTP."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from clock_helpers import ManualClock
from k8s_helpers import running_apiserver, write_kubeconfig

from exporter.k8s import pods as pods_module
from exporter.k8s.claims import ClaimCache
from exporter.k8s.connection import connect
from exporter.k8s.discovery import Discovery
from exporter.k8s.model import AllocatedDevice
from exporter.k8s.pods import NodePods

CLAIMS = "resourceclaims"


def claim_cache(client, **kwargs) -> ClaimCache:
    """A ClaimCache as the wiring builds it, with the agent's shared Discovery."""
    return ClaimCache(client, discovery=Discovery(client), **kwargs)


def client_for(server):
    with tempfile.TemporaryDirectory() as tmp:
        return connect(str(write_kubeconfig(Path(tmp) / "kubeconfig", server.url)))


def claim_obj(name: str, namespace: str = "ml", device: str = "gpu-0", version: str = "v1", uuid: str = "GPU-0") -> dict:
    exactly = {"deviceClassName": "gpu.nvidia.com"}
    request = {"name": "gpu", "exactly": exactly} if version != "v1beta1" else {"name": "gpu", **exactly}
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [request]}},
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": device}]}
            },
            "devices": [{"driver": "gpu.nvidia.com", "pool": "node-a", "device": device, "data": {"uuid": {"string": uuid}}}],
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": f"uid-{name}"}],
        },
    }


def claim_gets(server, name: str | None = None) -> int:
    return sum(
        1
        for r in server.requests
        if r.method == "GET" and f"/{CLAIMS}/" in r.path and (name is None or r.path.endswith(f"/{name}"))
    )


# --------------------------------------------------------------------------- ClaimCache


def test_miss_then_hit_then_expiry():
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        server.apply(claim_obj("train", device="gpu-1", uuid="GPU-1"))
        cache = claim_cache(client_for(server), ttl=30.0, clock=clock)
        info = cache.get("ml", "train")
        assert info is not None and info.uid
        assert info.devices == (AllocatedDevice(request="gpu", driver="gpu.nvidia.com", pool="node-a", device="gpu-1"),)
        assert info.devices[0].data == {"uuid": {"string": "GPU-1"}}
        assert info.reserved_for == ("train-pod",)
        assert cache.api_version == "v1"
        assert claim_gets(server, "train") == 1
        assert cache.get("ml", "train") == info
        assert claim_gets(server, "train") == 1, "a fresh entry is served from the cache"
        assert (cache.stats.fetches, cache.stats.hits) == (1, 1)
        server.apply(claim_obj("train", device="gpu-2", uuid="GPU-2"))
        clock.advance(31.0)
        assert cache.get("ml", "train").devices[0].device == "gpu-2"
        assert claim_gets(server, "train") == 2


def test_not_found_is_remembered_briefly():
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        cache = claim_cache(client_for(server), ttl=30.0, negative_ttl=5.0, clock=clock)
        assert cache.get("ml", "later") is None
        assert cache.get("ml", "later") is None
        assert claim_gets(server, "later") == 1
        assert cache.stats.not_found == 1
        server.apply(claim_obj("later"))
        clock.advance(6.0)
        assert cache.get("ml", "later") is not None
        assert claim_gets(server, "later") == 2


def test_refresh_fetches_only_missing_or_expired():
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        for name in ("a", "b", "c"):
            server.apply(claim_obj(name))
        cache = claim_cache(client_for(server), ttl=30.0, clock=clock)
        assert cache.due([("ml", "a")])
        cache.refresh([("ml", "a"), ("ml", "b")])
        assert claim_gets(server) == 2
        assert not cache.due([("ml", "a"), ("ml", "b")]) and not cache.due([])
        clock.advance(10.0)
        assert cache.due([("ml", "a"), ("ml", "c")])
        cache.refresh([("ml", "a"), ("ml", "b"), ("ml", "c"), ("ml", "c")])
        assert claim_gets(server) == 3 and claim_gets(server, "c") == 1
        clock.advance(23.0)  # t = 33 s: a (fetched at 0) expired by 30 s, c (fetched at 10) lives until 34-40 s (jittered TTL)
        assert cache.due([("ml", "a")]) and not cache.due([("ml", "c")])
        every = [("ml", "a"), ("ml", "b"), ("ml", "c")]
        assert set(cache.infos(every)) == set(every)
        cache.prune([("ml", "c")])
        assert set(cache.infos(every)) == {("ml", "c")}


def test_the_same_keys_every_cycle_still_see_every_change():
    """The agent asks due/prune/infos for the same keys every cycle, and the cache answers
    from memos while nothing changed: expiry, a fetch, a prune and an outage still show."""
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        for name in ("a", "b"):
            server.apply(claim_obj(name, device=f"gpu-{name}"))
        cache = claim_cache(client_for(server), ttl=30.0, negative_ttl=5.0, clock=clock)
        both = [("ml", "a"), ("ml", "b")]

        def cycle(keys):  # what Agent._claims does, in its order, with a fresh list each time
            if cache.due(list(keys)):
                cache.refresh(list(keys))
            cache.prune(list(keys))
            return cache.infos(list(keys))

        first = cycle(both)
        assert {k: i.devices[0].device for k, i in first.items()} == {("ml", "a"): "gpu-a", ("ml", "b"): "gpu-b"}
        assert cycle(both) is first and not cache.due(list(both))  # nothing changed: the same answer
        server.apply(claim_obj("a", device="gpu-z"))
        clock.advance(31.0)  # both expired: no change to the cache, only time
        assert cache.due(list(both))
        assert cycle(both)[("ml", "a")].devices[0].device == "gpu-z"
        assert not cache.due(list(both))
        cache.prune([("ml", "a")])  # b's pod is gone
        assert cache.entry("ml", "b") is None
        assert cache.due(list(both))  # b is missing again
        assert set(cycle([("ml", "a")])) == {("ml", "a")}
        server.delete("resource.k8s.io", "resourceclaims", "b", namespace="ml")
        assert set(cycle(both)) == {("ml", "a")}  # not found: no info, remembered briefly
        assert not cache.due(list(both))
        clock.advance(6.0)
        server.apply(claim_obj("b", device="gpu-b"))
        assert set(cycle(both)) == set(both)


def test_outage_serves_stale_copies_and_pauses_fetching():
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        server.apply(claim_obj("a"))
        server.apply(claim_obj("b"))
        cache = claim_cache(client_for(server), ttl=30.0, clock=clock, backoff_initial=10.0, backoff_max=20.0)
        cache.refresh([("ml", "a"), ("ml", "b")])
        good = cache.get("ml", "a")
        server.outage(True, mode="503")
        clock.advance(31.0)
        before = len(server.requests)
        cache.refresh([("ml", "a"), ("ml", "b")])
        # the first failure stops the round: one request, not one per claim
        assert len(server.requests) == before + 1
        entry = cache.entry("ml", "a")
        assert entry.info == good and entry.stale and "503" in entry.error
        assert cache.entry("ml", "b").stale
        assert "503" in (cache.last_error or "")
        # inside the backoff window nothing is sent at all
        cache.refresh([("ml", "a"), ("ml", "b")])
        assert cache.get("ml", "a") == good
        assert len(server.requests) == before + 1
        assert cache.stats.stale_served == 1
        server.outage(False)
        server.apply(claim_obj("a", device="gpu-5"))
        clock.advance(20.0)
        assert cache.get("ml", "a").devices[0].device == "gpu-5"
        assert not cache.entry("ml", "a").stale and cache.last_error is None


def test_connection_refused_is_an_outage_not_a_crash():
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        server.apply(claim_obj("a"))
        client = client_for(server)
        cache = claim_cache(client, ttl=30.0, clock=clock)
        good = cache.get("ml", "a")
    # the server is gone now: connection refused
    clock.advance(31.0)
    assert cache.get("ml", "a") == good
    assert cache.entry("ml", "a").stale and cache.last_error
    assert cache.get("ml", "never-seen") is None


def test_malformed_claim_is_skipped_and_counted():
    with running_apiserver("1.34") as server:
        bad = claim_obj("bad")
        bad["status"]["allocation"]["devices"]["results"][0]["device"] = 7
        server.apply(bad)
        cache = claim_cache(client_for(server), ttl=30.0, clock=ManualClock())
        assert cache.get("ml", "bad") is None
        assert cache.stats.malformed == 1
        assert "results[0].device" in cache.entry("ml", "bad").error


def test_v1beta1_only_server():
    with running_apiserver("1.32", served_versions={"v1", "resource.k8s.io/v1beta1"}) as server:
        server.apply(claim_obj("old", version="v1beta1"))
        cache = claim_cache(client_for(server), ttl=30.0, clock=ManualClock())
        info = cache.get("ml", "old")
        assert cache.api_version == "v1beta1"
        assert info is not None and info.devices[0].data == {"uuid": {"string": "GPU-0"}}
        assert all("/v1beta1/" in r.path for r in server.requests if f"/{CLAIMS}/" in r.path)


def test_no_dra_api_gives_none_without_raising():
    with running_apiserver("1.32", served_versions={"v1"}) as server:
        cache = claim_cache(client_for(server), ttl=30.0, clock=ManualClock())
        assert cache.get("ml", "x") is None
        assert "serves no version" in (cache.last_error or "")


# --------------------------------------------------------------------------- NodePods


def pod_obj(name: str, node: str = "node-a", claims=()) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "image": "busybox"}],
            "resourceClaims": [{"name": c, "resourceClaimName": c} for c in claims],
        },
        "status": {"phase": "Running"},
    }


def test_node_pods_lists_this_node_with_ttl():
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        server.apply(pod_obj("p0", claims=("train",)))
        server.apply(pod_obj("p1"))
        server.apply(pod_obj("elsewhere", node="node-b"))
        pods = NodePods(client_for(server), "node-a", ttl=10.0, clock=clock)
        listed = pods.list()
        assert sorted(p.name for p in listed) == ["p0", "p1"]
        assert pods.by_uid()["uid-p0"].claims == ("train",)
        assert pods.by_uid()["uid-p0"].phase == "Running"
        lists = [r for r in server.requests if r.path == "/api/v1/pods"]
        assert len(lists) == 1 and lists[0].query.get("fieldSelector") == "spec.nodeName=node-a"
        server.apply(pod_obj("p2"))
        assert len(pods.list()) == 2, "cached within the TTL"
        clock.advance(11.0)
        assert sorted(p.name for p in pods.list()) == ["p0", "p1", "p2"]
        assert len(pods.list(force=True)) == 3


def test_node_pods_paginates(monkeypatch):
    monkeypatch.setattr(pods_module, "PAGE_SIZE", 2)
    with running_apiserver("1.34") as server:
        for i in range(5):
            server.apply(pod_obj(f"p{i}"))
        pods = NodePods(client_for(server), "node-a", clock=ManualClock())
        assert sorted(p.name for p in pods.list()) == [f"p{i}" for i in range(5)]
        assert len([r for r in server.requests if r.path == "/api/v1/pods"]) == 3


def test_node_pods_outage_returns_last_good_list():
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        server.apply(pod_obj("p0"))
        pods = NodePods(client_for(server), "node-a", ttl=10.0, clock=clock, backoff_initial=5.0, backoff_max=5.0)
        assert [p.name for p in pods.list()] == ["p0"]
        server.outage(True, mode="reset")
        clock.advance(11.0)
        assert [p.name for p in pods.list()] == ["p0"]
        assert pods.stale and pods.last_error
        server.outage(False)
        server.apply(pod_obj("p1"))
        clock.advance(6.0)
        assert sorted(p.name for p in pods.list()) == ["p0", "p1"]
        assert not pods.stale and pods.last_error is None


def test_node_pods_skips_malformed_pods():
    with running_apiserver("1.34") as server:
        server.apply(pod_obj("p0"))
        bad = pod_obj("bad")
        bad["spec"]["resourceClaims"] = [{"name": "x", "resourceClaimName": 5}]
        server.apply(bad)
        pods = NodePods(client_for(server), "node-a", clock=ManualClock())
        assert [p.name for p in pods.list()] == ["p0"]
        assert pods.stats.malformed_skipped == 1


@pytest.mark.parametrize("node", [""])
def test_node_name_is_required(node):
    with pytest.raises(ValueError):
        NodePods(None, node)  # type: ignore[arg-type]


def test_steady_state_makes_no_claim_request_and_reads_come_from_the_cache():
    """Issue 13: an allocated claim is read once, from the API server's cache
    (resourceVersion=0), and never again while the node's pods hold it."""
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        names = [f"c{i}" for i in range(20)]
        for n in names:
            server.apply(claim_obj(n))
        cache = claim_cache(client_for(server), clock=clock)  # the agent's defaults
        keys = [("ml", n) for n in names]
        cache.refresh(keys)  # the first cycle: every claim, a few at a time
        assert all(cache.entry("ml", n).info is not None for n in names)
        gets = [r for r in server.requests if r.method == "GET" and f"/{CLAIMS}/" in r.path]
        assert len(gets) == len(names) and all(r.query.get("resourceVersion") == "0" for r in gets)
        before = claim_gets(server)
        for _ in range(100):  # 100 cycles, an hour of simulated time
            clock.advance(36.0)
            cache.refresh(keys)
        assert claim_gets(server) == before


def test_a_claim_not_allocated_yet_is_asked_again_soon():
    clock = ManualClock()
    with running_apiserver("1.34") as server:
        pending = claim_obj("p")
        pending["status"] = {}
        server.apply(pending)
        cache = claim_cache(client_for(server), negative_ttl=5.0, clock=clock)
        cache.refresh([("ml", "p")])
        assert cache.entry("ml", "p").info.devices == ()
        server.apply(claim_obj("p", device="gpu-3"))
        clock.advance(6.0)
        cache.refresh([("ml", "p")])
        assert cache.get("ml", "p").devices[0].device == "gpu-3"
        before = claim_gets(server)
        clock.advance(3600.0)
        cache.refresh([("ml", "p")])
        assert claim_gets(server) == before  # allocated now: kept


def test_the_connection_pool_holds_what_the_agent_uses_at_once(monkeypatch):
    """On a 2-CPU node the kubernetes client's default pool is 10 connections, fewer than the
    agent's start-up claim fetches plus its watches: each burst's surplus was discarded
    ("Connection pool is full") and re-opened to the API server on the next one."""
    import multiprocessing

    from exporter.k8s import connection
    from exporter.k8s.claims import FETCH_PARALLEL

    monkeypatch.setattr(multiprocessing, "cpu_count", lambda: 2)
    with running_apiserver("1.34") as server:
        api = client_for(server)
    size = api.configuration.connection_pool_maxsize
    watches = 4  # ResourceSlices, Node, own DeviceTaintRules, the budget
    assert size == connection.POOL_CONNECTIONS >= FETCH_PARALLEL + watches + 4
    assert api.rest_client.pool_manager.connection_pool_kw["maxsize"] == size
