"""SliceWatcher against the in-process API server over real HTTP (list, watch, 410, outages)."""

from __future__ import annotations

import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from k8s_helpers import running_apiserver, wait_until, write_kubeconfig

from exporter.backoff import Backoff
from exporter.k8s import slices as slices_module
from exporter.k8s.connection import (
    MERGE_PATCH,
    ApiError,
    ApiUnavailable,
    KubeconfigError,
    connect,
    get_json,
    request_json,
    stream_watch,
)
from exporter.k8s.discovery import Discovery, pick_version, resource_version_for, served_versions
from exporter.k8s.slices import SliceWatcher
from exporter.k8s.watch import Reflector

NV = "gpu.nvidia.com"
SLICES = r"/apis/resource\.k8s\.io/[^/]+/resourceslices$"


def slice_obj(name: str, node: str = "node-a", gen: int = 1, devices=("gpu-0",), version: str = "v1", driver: str = NV) -> dict:
    if version in ("v1beta1", "v1alpha3"):
        devs = [{"name": d, "basic": {"attributes": {"uuid": {"string": f"GPU-{d}"}}}} for d in devices]
    else:
        devs = [{"name": d, "attributes": {"uuid": {"string": f"GPU-{d}"}}} for d in devices]
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": gen, "resourceSliceCount": 1},
            "devices": devs,
        },
    }


def client_for(server):
    """Connect the way the agent does: through a kubeconfig file."""
    with tempfile.TemporaryDirectory() as tmp:
        return connect(str(write_kubeconfig(Path(tmp) / "kubeconfig", server.url)))


def names(watcher: SliceWatcher) -> set[str]:
    return {dev for (_driver, _pool, dev) in watcher.devices()}


def slice_watcher(server, node: str = "node-a", **kwargs) -> SliceWatcher:
    """A SliceWatcher as the wiring builds it, with the agent's shared Discovery."""
    client = client_for(server)
    return SliceWatcher(client, node, discovery=Discovery(client), **kwargs)


@contextmanager
def watching(server, node: str = "node-a", **kwargs):
    changes = []
    lock = threading.Lock()

    def on_change():
        with lock:
            changes.append(names(w))

    kwargs.setdefault("backoff_initial", 0.02)
    kwargs.setdefault("backoff_max", 0.2)
    w = slice_watcher(server, node, on_change=on_change, **kwargs)
    w.changes = changes
    w.start()
    try:
        wait_until(lambda: w.synced, message="first list")
        yield w
    finally:
        w.stop()
        assert not w._thread.is_alive(), "watcher thread did not stop"


def test_initial_list_sees_only_this_nodes_slices():
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        server.apply(slice_obj("a-0", devices=("gpu-0", "gpu-1")))
        server.apply(slice_obj("b-0", node="node-b", devices=("gpu-7",)))
        with watching(server) as w:
            assert names(w) == {"gpu-0", "gpu-1"}
            assert w.api_version == "v1"
            dev = w.devices()[(NV, "node-a", "gpu-1")]
            assert dev.attr("uuid") == "GPU-gpu-1" and dev.slice_name == "a-0"
            assert w.changes == [{"gpu-0", "gpu-1"}]
            # other nodes' slices never reach the agent: the filter is server-side
            server.apply(slice_obj("b-0", node="node-b", devices=("gpu-7", "gpu-8")))
            server.apply(slice_obj("a-1", devices=("gpu-2",)))
            wait_until(lambda: "gpu-2" in names(w))
            assert names(w) == {"gpu-0", "gpu-1", "gpu-2"}
            slice_requests = [r for r in server.requests if "resourceslices" in r.path]
            assert slice_requests and all(r.query.get("fieldSelector") == "spec.nodeName=node-a" for r in slice_requests)
            assert any(r.watch and r.query.get("allowWatchBookmarks") == "true" for r in slice_requests)


def test_added_modified_deleted():
    with running_apiserver("1.34", bookmark_interval=3600) as server, watching(server) as w:
        assert names(w) == set()
        server.apply(slice_obj("a-0", devices=("gpu-0",)))
        wait_until(lambda: names(w) == {"gpu-0"}, message="ADDED")
        server.apply(slice_obj("a-0", devices=("gpu-0", "gpu-1")))
        wait_until(lambda: names(w) == {"gpu-0", "gpu-1"}, message="MODIFIED")
        server.delete("resource.k8s.io", "resourceslices", "a-0")
        wait_until(lambda: names(w) == set(), message="DELETED")
        assert w.stats.events == 3
        assert w.changes[-3:] == [{"gpu-0"}, {"gpu-0", "gpu-1"}, set()]


def test_slice_moved_to_another_node_disappears():
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        server.apply(slice_obj("a-0"))
        with watching(server) as w:
            assert names(w) == {"gpu-0"}
            server.apply(slice_obj("a-0", node="node-b"))
            wait_until(lambda: names(w) == set())


def test_highest_pool_generation_wins():
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        server.apply(slice_obj("old", gen=1, devices=("gpu-0", "gpu-1")))
        server.apply(slice_obj("new", gen=2, devices=("gpu-0",)))
        # another pool is independent of node-a's generations
        other = slice_obj("other", gen=1, devices=("nic-0",), driver="nic.example.com")
        server.apply(other)
        with watching(server) as w:
            assert set(w.devices()) == {(NV, "node-a", "gpu-0"), ("nic.example.com", "node-a", "nic-0")}
            assert w.devices()[(NV, "node-a", "gpu-0")].slice_name == "new"
            # the driver republishes with generation 3: generation 2 is stale at once
            server.apply(slice_obj("newer", gen=3, devices=("gpu-5",)))
            wait_until(lambda: (NV, "node-a", "gpu-5") in w.devices())
            assert {k for k in w.devices() if k[0] == NV} == {(NV, "node-a", "gpu-5")}
            # and when the newest slice goes away, the highest remaining generation counts again
            server.delete("resource.k8s.io", "resourceslices", "newer")
            wait_until(lambda: (NV, "node-a", "gpu-5") not in w.devices())
            assert w.devices()[(NV, "node-a", "gpu-0")].slice_name == "new"


def test_bookmarks_advance_the_resource_version():
    with running_apiserver("1.34", bookmark_interval=0.02) as server:
        server.apply(slice_obj("a-0"))
        with watching(server) as w:
            listed_rv = w.resource_version
            # writes the watcher cannot see (another node) move the server's revision on
            for i in range(3):
                server.apply(slice_obj(f"b-{i}", node="node-b"))
            wait_until(lambda: w.resource_version == server.resource_version, message="bookmark rv")
            assert int(w.resource_version) > int(listed_rv)
            assert w.stats.bookmarks >= 1 and w.stats.events == 0
            # the advanced rv is what a reconnect resumes from, so a compaction of everything
            # before it does not force a relist
            server.compact()
            server.close_watches()
            wait_until(lambda: w.stats.watch_restarts >= 1 and server.open_watches == 1)
            resumed = [r for r in server.requests if r.watch][-1]
            assert int(resumed.query["resourceVersion"]) > int(listed_rv)
            assert w.stats.relists == 0


def _hold_watches(server):
    """Make every watch request fail until clear_faults(): the watcher keeps its old rv."""
    server.fail_next("GET", SLICES, 503, count=10_000, watch=True)
    server.close_watches()


def test_gone_as_error_event_relists_without_losing_state():
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        server.apply(slice_obj("a-0", devices=("gpu-0", "gpu-1")))
        with watching(server) as w:
            wait_until(lambda: server.open_watches == 1)
            _hold_watches(server)
            wait_until(lambda: w.stats.errors >= 1, message="watch refused")
            # while disconnected: changes the watcher misses, then history is compacted
            server.apply(slice_obj("a-0", devices=("gpu-1",)))
            server.apply(slice_obj("a-1", devices=("gpu-2",)))
            server.compact()
            assert names(w) == {"gpu-0", "gpu-1"}, "state is kept while the API cannot be watched"
            server.clear_faults()
            wait_until(lambda: w.stats.relists == 1, message="relist after 410")
            wait_until(lambda: names(w) == {"gpu-1", "gpu-2"})
            # the 410 came in-band: HTTP 200 and an ERROR event with code 410
            gone_watch = [r for r in server.requests if r.watch and r.status == 200][-2]
            assert gone_watch.query["resourceVersion"] != w.resource_version
            # the state was replaced in one step: no change notification ever saw an empty node
            assert set() not in w.changes


def test_gone_as_http_410_relists():
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        server.apply(slice_obj("a-0"))
        with watching(server) as w:
            wait_until(lambda: server.open_watches == 1)
            server.fail_next("GET", SLICES, 410, watch=True, message="too old resource version")
            server.close_watches()
            wait_until(lambda: w.stats.relists == 1)
            assert names(w) == {"gpu-0"}
            assert w.stats.errors == 0  # a 410 is protocol, not an error


def test_outage_backs_off_and_recovers():
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        server.apply(slice_obj("a-0"))
        with watching(server) as w:
            wait_until(lambda: server.open_watches == 1)
            server.outage(True, mode="reset")
            wait_until(lambda: w.stats.errors >= 3, message="failed reconnects")
            assert w.last_error and names(w) == {"gpu-0"}
            server.outage(False)
            server.outage(True, mode="503")
            wait_until(lambda: "503" in (w.last_error or ""), message="503 seen")
            server.outage(False)
            server.apply(slice_obj("a-0", devices=("gpu-0", "gpu-3")))
            wait_until(lambda: names(w) == {"gpu-0", "gpu-3"}, message="recovery")
            wait_until(lambda: w.last_error is None)


def test_throttled_watch_waits_at_least_retry_after():
    backoff = Backoff(initial=0.01, cap=0.02, rng=lambda: 0.0)
    assert backoff.next_delay(retry_after=2.0) == 2.0
    assert backoff.next_delay(retry_after=10_000.0) == 300.0  # an absurd header is capped


def test_backoff_is_capped_and_jittered():
    lows = Backoff(initial=1.0, cap=8.0, rng=lambda: 0.0)
    highs = Backoff(initial=1.0, cap=8.0, rng=lambda: 1.0)
    assert [lows.next_delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert [highs.next_delay() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    highs.reset()
    assert highs.next_delay() == 1.0


def test_429_with_retry_after_is_an_error_then_recovers():
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        server.apply(slice_obj("a-0"))
        server.fail_next("GET", SLICES, 429, retry_after=0, watch=False)
        w = slice_watcher(server, backoff_initial=0.02, backoff_max=0.1)
        w.start()
        try:
            wait_until(lambda: w.synced)
            assert w.stats.errors == 1 and names(w) == {"gpu-0"}
        finally:
            w.stop()


def test_malformed_slices_are_skipped_and_counted():
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        bad = slice_obj("bad-0")
        bad["spec"]["devices"][0]["attributes"]["uuid"] = "GPU-not-an-attribute-object"
        server.apply(bad)
        server.apply(slice_obj("good-0", devices=("gpu-1",)))
        with watching(server) as w:
            assert names(w) == {"gpu-1"}
            assert w.stats.malformed_skipped == 1
            worse = slice_obj("bad-1", devices=("gpu-2",))
            worse["spec"]["pool"]["generation"] = "two"
            server.apply(worse)
            server.apply(slice_obj("good-1", devices=("gpu-3",)))
            wait_until(lambda: "gpu-3" in names(w))
            assert names(w) == {"gpu-1", "gpu-3"}
            assert w.stats.malformed_skipped == 2
            # an update that breaks a good slice drops it rather than keeping a stale copy
            broken = slice_obj("good-0", devices=("gpu-1",))
            del broken["spec"]["driver"]
            server.apply(broken)
            wait_until(lambda: names(w) == {"gpu-3"})
            assert w.stats.malformed_skipped == 3 and w.last_error is None


@pytest.mark.parametrize(
    "release, served, expected",
    [
        ("1.32", {"v1", "resource.k8s.io/v1beta1"}, "v1beta1"),
        ("1.33", {"v1", "resource.k8s.io/v1beta1", "resource.k8s.io/v1beta2"}, "v1beta2"),
        ("1.34", None, "v1"),
    ],
)
def test_version_discovery(release, served, expected):
    with running_apiserver(release, served_versions=served, bookmark_interval=3600) as server:
        server.apply(slice_obj("a-0", devices=("gpu-0",), version=expected))
        with watching(server) as w:
            assert w.api_version == expected
            assert w.devices()[(NV, "node-a", "gpu-0")].attr("uuid") == "GPU-gpu-0"
            server.apply(slice_obj("a-1", devices=("gpu-1",), version=expected))
            wait_until(lambda: w.devices().get((NV, "node-a", "gpu-1")) is not None)
            assert w.devices()[(NV, "node-a", "gpu-1")].attr("uuid") == "GPU-gpu-1"


def test_no_dra_api_keeps_retrying_without_crashing():
    with running_apiserver("1.32", served_versions={"v1"}, bookmark_interval=3600) as server:
        w = slice_watcher(server, backoff_initial=0.02, backoff_max=0.05)
        w.start()
        try:
            wait_until(lambda: w.stats.errors >= 2)
            assert not w.synced and "serves no version" in (w.last_error or "")
            assert w.devices() == {}
        finally:
            w.stop()


def test_list_is_paginated(monkeypatch):
    monkeypatch.setattr(slices_module, "LIST_PAGE_SIZE", 2)
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        for i in range(5):
            server.apply(slice_obj(f"a-{i}", devices=(f"gpu-{i}",)))
        with watching(server) as w:
            assert names(w) == {f"gpu-{i}" for i in range(5)}
            lists = [r for r in server.requests if not r.watch and r.path.endswith("/resourceslices")]
            assert len(lists) == 3 and "continue" in lists[1].query


# --------------------------------------------------------------------------- connection + discovery

@pytest.fixture
def no_k8s_env(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)


def test_connect_without_any_configuration_gives_none(no_k8s_env):
    assert connect(None) is None


def test_connect_from_kubeconfig_env_with_bearer_token(no_k8s_env, monkeypatch, tmp_path):
    with running_apiserver("1.34", require_token="s3cret") as server:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "cfg", server.url, token="s3cret")))
        client = connect(None)
        assert client is not None
        assert get_json(client, "/apis/resource.k8s.io")["name"] == "resource.k8s.io"
        wrong = connect(str(write_kubeconfig(tmp_path / "wrong", server.url, token="nope")))
        with pytest.raises(ApiError) as err:
            get_json(wrong, "/apis/resource.k8s.io")
        assert err.value.status == 401


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "does not exist"),
        ("{not: [yaml", ""),
        ("apiVersion: v1\nkind: Config\ncontexts: []\nclusters: []\nusers: []\n", ""),
    ],
)
def test_bad_kubeconfig_is_one_clear_line(no_k8s_env, tmp_path, content, fragment):
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    with pytest.raises(KubeconfigError) as err:
        connect(str(path))
    message = str(err.value)
    assert "\n" not in message and str(path) in message and fragment in message


def test_request_json_verbs_and_errors():
    with running_apiserver("1.37") as server:
        client = client_for(server)
        path = "/api/v1/namespaces/default/events"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": "e1", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": "node-a"},
            "reason": "Test",
            "message": "hello",
        }
        created = request_json(client, "POST", path, body=body)
        assert created["metadata"]["name"] == "e1" and created["metadata"]["resourceVersion"]
        patched = request_json(client, "PATCH", f"{path}/e1", body={"message": "patched"}, content_type=MERGE_PATCH)
        assert patched["message"] == "patched"
        replaced = request_json(client, "PUT", f"{path}/e1", body={**patched, "message": "put"})
        assert replaced["message"] == "put"
        with pytest.raises(ApiError) as err:
            request_json(client, "POST", path, body=body)
        assert (err.value.status, err.value.reason) == (409, "AlreadyExists")
        assert not err.value.retryable
        request_json(client, "DELETE", f"{path}/e1")
        with pytest.raises(ApiError) as err:
            get_json(client, f"{path}/e1")
        assert err.value.status == 404 and "e1" in err.value.message
        server.fail_next("GET", "/api/v1/namespaces$", 429, retry_after=7)
        with pytest.raises(ApiError) as err:
            get_json(client, "/api/v1/namespaces")
        assert (err.value.status, err.value.retry_after, err.value.retryable) == (429, 7.0, True)
    with pytest.raises(ApiUnavailable) as err:
        get_json(client, "/api/v1/namespaces")
    assert err.value.status == 0 and err.value.retryable


def test_stream_watch_yields_events_and_can_be_closed_from_another_thread():
    with running_apiserver("1.34", bookmark_interval=3600) as server:
        client = client_for(server)
        path = "/apis/resource.k8s.io/v1/resourceslices"
        rv = get_json(client, path)["metadata"]["resourceVersion"]
        stream = stream_watch(client, path, {"resourceVersion": rv}, timeout=60)
        seen = []

        def consume():
            for event in stream:
                seen.append((event["type"], event["object"]["metadata"]["name"]))

        t = threading.Thread(target=consume)
        t.start()
        server.apply(slice_obj("a-0"))
        wait_until(lambda: seen == [("ADDED", "a-0")])
        stream.close()
        t.join(5)
        assert not t.is_alive()
        watch = [r for r in server.requests if r.watch][-1]
        assert watch.query["watch"] == "true" and watch.query["timeoutSeconds"] == "60"


def test_discovery_per_release():
    with running_apiserver("1.34") as server:
        client = client_for(server)
        served = served_versions(client)
        assert set(served) == {"v1", "v1alpha3"}
        assert pick_version(served, ("v1", "v1beta2", "v1beta1")) == "v1"
        assert pick_version(["v1beta1"], ("v1", "v1beta2")) is None
        # DeviceTaintRule is only in v1alpha3 on 1.34, although v1 is preferred
        assert resource_version_for(client, "resource.k8s.io", "devicetaintrules") == "v1alpha3"
        assert resource_version_for(client, "resource.k8s.io", "resourceslices") == "v1"
        assert resource_version_for(client, "resource.k8s.io", "nonsense") is None
        assert served_versions(client, "nonexistent.example.com") == []
    with running_apiserver("1.37") as server:
        assert resource_version_for(client_for(server), "resource.k8s.io", "devicetaintrules") == "v1"


def test_a_watch_needing_discovery_gets_the_shared_one_or_none_at_all():
    # only the wiring builds the Discovery: a watch that would have to ask which version is
    # served refuses to start without it, rather than building a second cache of its own
    client = object()  # never called: the refusal comes before any request
    with pytest.raises(ValueError, match="needs the shared Discovery"):
        Reflector(client, group="resource.k8s.io", resource="resourceslices", label="node-a")
    Reflector(client, group="resource.k8s.io", resource="resourceslices", label="node-a", api_version="v1")
    Reflector(client, group="", resource="nodes", label="node-a")  # the core group: always v1


def test_discovery_cache_and_refresh():
    with running_apiserver("1.34") as server:
        disco = Discovery(client_for(server))
        assert disco.version_for("resource.k8s.io", "resourceslices") == "v1"
        before = len(server.requests)
        assert disco.version_for("resource.k8s.io", "resourceslices") == "v1"
        assert disco.pick() == "v1"
        assert len(server.requests) == before, "answers come from the cache"
        disco.refresh()
        assert disco.version_for("resource.k8s.io", "devicetaintrules") == "v1alpha3"
        assert len(server.requests) > before


def test_a_failing_on_change_callback_does_not_stop_the_watcher():
    calls = []

    def explode():
        calls.append(1)
        raise RuntimeError("consumer bug")

    with running_apiserver("1.34", bookmark_interval=3600) as server:
        w = slice_watcher(server, on_change=explode, backoff_initial=0.02, backoff_max=0.1)
        w.start()
        try:
            wait_until(lambda: w.synced)
            server.apply(slice_obj("a-0"))
            server.apply(slice_obj("a-1", devices=("gpu-1",)))
            wait_until(lambda: names(w) == {"gpu-0", "gpu-1"})
            assert len(calls) == 3 and w.stats.errors == 0
        finally:
            w.stop()
