"""The in-process Kubernetes API server, driven by the official `kubernetes` client over HTTP.

Everything here goes through real sockets: the generated ResourceV1*Api classes (37.x, pydantic
models), kubernetes.watch.Watch, or raw ApiClient.call_api for the wire-level details.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import kubernetes_validate
import pytest
import urllib3
from hypothesis import given, settings
from hypothesis import strategies as st
from k8s_helpers import api_client, call_json, running_apiserver, wait_until, write_kubeconfig
from kubernetes import client, config, watch

from drasim.apiserver import FakeApiServer
from drasim.apiserver_catalog import ResourceType
from drasim.apiserver_convert import from_version, to_version
from drasim.apiserver_patch import PatchError, json_patch, merge_patch
from drasim.apiserver_selectors import Selector, parse_label_selector

DRA = "resource.k8s.io"


def slice_body(name: str, node: str, devices: tuple[str, ...] = ("gpu-0",),
               driver: str = "gpu.nvidia.com", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "driver": driver, "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": d, "attributes": {"uuid": {"string": f"GPU-{node}-{d}"}},
                         "capacity": {"memory": {"value": "80Gi"}}} for d in devices],
        },
    }


def rule_body(name: str, api_version: str, effect: str = "NoExecute",
              labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": api_version, "kind": "DeviceTaintRule",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"},
                 "taint": {"key": "example.com/unhealthy", "value": "xid-79", "effect": effect}},
    }


class Collector:
    """Runs kubernetes.watch.Watch().stream in a thread and keeps every event it yields."""

    def __init__(self, func: Any, **kwargs: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._watch = watch.Watch()
        kwargs.setdefault("timeout_seconds", 30)  # a server-side bound; tests stop it sooner
        self._thread = threading.Thread(target=self._run, args=(func, kwargs), daemon=True)
        self._thread.start()

    def _run(self, func: Any, kwargs: dict[str, Any]) -> None:
        try:
            for ev in self._watch.stream(func, **kwargs):
                self.events.append(ev)
        except BaseException as exc:  # surfaced to the test through .error
            self.error = exc
        finally:
            self.done.set()

    def summary(self, with_bookmarks: bool = False) -> list[tuple[str, str]]:
        return [(e["type"], e["raw_object"]["metadata"].get("name", ""))
                for e in list(self.events) if with_bookmarks or e["type"] != "BOOKMARK"]

    def stop(self) -> None:
        self._watch.stop()
        self.done.wait(10)


@pytest.fixture
def server():
    with running_apiserver("1.37", bookmark_interval=0.05) as srv:
        yield srv


@pytest.fixture
def api(server: FakeApiServer):
    with api_client(server.url) as c:
        yield c


# ---------------------------------------------------------------- discovery


@pytest.mark.parametrize(("version", "preferred", "rule_version"), [
    ("1.33", "v1beta2", "v1alpha3"),
    ("1.34", "v1", "v1alpha3"),
    ("1.35", "v1", "v1alpha3"),
    ("1.36", "v1", "v1beta2"),
    ("1.37", "v1", "v1"),
])
def test_discovery_follows_the_release(version: str, preferred: str, rule_version: str) -> None:
    with running_apiserver(version) as srv, api_client(srv.url) as c:
        assert client.VersionApi(c).get_code().git_version == f"v{version}.0"
        groups = {g.name: g for g in client.ApisApi(c).get_api_versions().groups}
        assert {"resource.k8s.io", "events.k8s.io", "coordination.k8s.io"} <= set(groups)
        assert groups[DRA].preferred_version.version == preferred
        assert [r.name for r in client.CoreV1Api(c).get_api_resources().resources
                if "/" not in r.name] == ["namespaces", "nodes", "pods", "events", "configmaps"]
        # Which resource.k8s.io version holds DeviceTaintRule, through raw discovery.
        holders = []
        for v in groups[DRA].versions:
            status, body = call_json(c, "GET", f"/apis/resource.k8s.io/{v.version}")
            assert status == 200 and body["kind"] == "APIResourceList"
            for r in body["resources"]:
                if r["name"] == "devicetaintrules":
                    assert r["kind"] == "DeviceTaintRule" and r["namespaced"] is False
                    assert "watch" in r["verbs"] and "patch" in r["verbs"]
                    holders.append(v.version)
        assert holders[0] == rule_version


def test_served_versions_can_be_overridden() -> None:
    with running_apiserver("1.34", served_versions={"v1", "resource.k8s.io/v1beta1"}) as srv, \
            api_client(srv.url) as c:
        status, body = call_json(c, "GET", "/apis/resource.k8s.io/v1")
        assert status == 404 and body["kind"] == "Status" and body["reason"] == "NotFound"
        assert call_json(c, "GET", "/apis/resource.k8s.io/v1beta1")[0] == 200
        assert [g.name for g in client.ApisApi(c).get_api_versions().groups] == [DRA]
    with pytest.raises(ValueError, match="no API version"):
        FakeApiServer("1.33", served_versions={"resource.k8s.io/v1"})
    with pytest.raises(ValueError, match="not emulated"):
        FakeApiServer("1.20")


# ---------------------------------------------------------------- create, list, get, conflicts


def test_create_and_list_resource_slices_by_node(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    created = r.create_resource_slice(slice_body("node-a-gpu", "node-a", ("gpu-0", "gpu-1")))
    assert isinstance(created, client.V1ResourceSlice)
    assert created.metadata.uid and created.metadata.generation == 1
    assert int(created.metadata.resource_version) > 0
    r.create_resource_slice(slice_body("node-b-gpu", "node-b"))
    r.create_resource_slice(slice_body("node-a-nic", "node-a", driver="nic.example.com"))

    mine = r.list_resource_slice(field_selector="spec.nodeName=node-a")
    assert sorted(s.metadata.name for s in mine.items) == ["node-a-gpu", "node-a-nic"]
    assert mine.metadata.resource_version == server.resource_version
    both = r.list_resource_slice(field_selector="spec.nodeName=node-a,spec.driver=gpu.nvidia.com")
    assert [s.metadata.name for s in both.items] == ["node-a-gpu"]
    assert both.items[0].spec.devices[1].attributes["uuid"].string == "GPU-node-a-gpu-1"
    others = r.list_resource_slice(field_selector="spec.nodeName!=node-a")
    assert [s.metadata.name for s in others.items] == ["node-b-gpu"]
    # Generic dotted paths work too (metadata.name is what the real server always offers).
    assert [s.metadata.name for s in r.list_resource_slice(field_selector="metadata.name==node-b-gpu").items] \
        == ["node-b-gpu"]
    # Real list items carry no kind/apiVersion; the list itself does.
    _status, raw = call_json(api, "GET", "/apis/resource.k8s.io/v1/resourceslices")
    assert raw["kind"] == "ResourceSliceList" and raw["apiVersion"] == "resource.k8s.io/v1"
    assert "kind" not in raw["items"][0]


def test_duplicate_create_is_409_already_exists(api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    r.create_resource_slice(slice_body("s", "node-a"))
    with pytest.raises(client.ApiException) as err:
        r.create_resource_slice(slice_body("s", "node-a"))
    assert err.value.status == 409
    status = json.loads(err.value.body)
    assert status == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'resourceslices.resource.k8s.io "s" already exists', "reason": "AlreadyExists",
        "code": 409, "details": {"name": "s", "group": DRA, "kind": "resourceslices"},
    }


def test_put_with_stale_resource_version_is_409_conflict(api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    first = r.create_resource_slice(slice_body("s", "node-a"))
    body = slice_body("s", "node-a", ("gpu-0", "gpu-1"))
    body["metadata"]["resourceVersion"] = first.metadata.resource_version
    second = r.replace_resource_slice("s", body)
    assert second.metadata.generation == 2  # spec changed
    with pytest.raises(client.ApiException) as err:
        r.replace_resource_slice("s", body)  # still carries the first resourceVersion
    assert err.value.status == 409
    assert json.loads(err.value.body)["reason"] == "Conflict"
    assert "the object has been modified" in json.loads(err.value.body)["message"]


def test_create_carrying_resource_version_is_rejected(api: client.ApiClient) -> None:
    body = slice_body("s", "node-a")
    body["metadata"]["resourceVersion"] = "5"
    status, reply = call_json(api, "POST", "/apis/resource.k8s.io/v1/resourceslices", body=body)
    assert status == 500 and reply["reason"] == "InternalError"


def test_validation_errors_are_422_invalid(api: client.ApiClient) -> None:
    body = slice_body("s", "node-a")
    del body["spec"]["driver"]
    body["spec"]["allNodes"] = True
    status, reply = call_json(api, "POST", "/apis/resource.k8s.io/v1/resourceslices", body=body)
    assert status == 422 and reply["reason"] == "Invalid"
    fields = {c["field"] for c in reply["details"]["causes"]}
    assert fields == {"spec.driver", "spec"}


def test_generate_name_and_get(api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    body = slice_body("", "node-a")
    body["metadata"] = {"generateName": "node-a-gpu-"}
    made = r.create_resource_slice(body)
    assert made.metadata.name.startswith("node-a-gpu-") and len(made.metadata.name) == len("node-a-gpu-") + 5
    assert r.read_resource_slice(made.metadata.name).metadata.uid == made.metadata.uid
    with pytest.raises(client.ApiException) as err:
        r.read_resource_slice("missing")
    assert err.value.status == 404 and json.loads(err.value.body)["reason"] == "NotFound"


def test_limit_and_continue(api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    for i in range(5):
        r.create_resource_slice(slice_body(f"s{i}", "node-a"))
    names: list[str] = []
    page = r.list_resource_slice(limit=2)
    pages = 1
    while True:
        names += [s.metadata.name for s in page.items]
        if not page.metadata._continue:
            break
        page = r.list_resource_slice(limit=2, _continue=page.metadata._continue)
        pages += 1
    assert names == [f"s{i}" for i in range(5)] and pages == 3


# ---------------------------------------------------------------- patch, delete, status, dry run


def test_merge_json_and_strategic_patches(api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    r.create_resource_slice(slice_body("s", "node-a"))
    labelled = r.patch_resource_slice("s", {"metadata": {"labels": {"tier": "a"}}},
                                      _content_type="application/merge-patch+json")
    assert labelled.metadata.labels == {"tier": "a"} and labelled.metadata.generation == 1
    # The generated method's default content type for a dict body is strategic merge.
    grown = r.patch_resource_slice("s", {"spec": {"devices": [{"name": "gpu-0"}, {"name": "gpu-1"}]}})
    assert [d.name for d in grown.spec.devices] == ["gpu-0", "gpu-1"]
    assert grown.metadata.generation == 2
    ops = [{"op": "replace", "path": "/metadata/labels/tier", "value": "b"},
           {"op": "add", "path": "/spec/devices/-", "value": {"name": "gpu-2"}}]
    patched = r.patch_resource_slice("s", ops, _content_type="application/json-patch+json")
    assert patched.metadata.labels == {"tier": "b"} and len(patched.spec.devices) == 3
    failing = [{"op": "test", "path": "/metadata/labels/tier", "value": "zzz"}]
    status, reply = call_json(api, "PATCH", "/apis/resource.k8s.io/v1/resourceslices/s", body=failing,
                              content_type="application/json-patch+json")
    assert status == 422 and reply["kind"] == "Status"
    stale = {"metadata": {"resourceVersion": labelled.metadata.resource_version, "labels": {"x": "y"}}}
    status, reply = call_json(api, "PATCH", "/apis/resource.k8s.io/v1/resourceslices/s", body=stale,
                              content_type="application/merge-patch+json")
    assert status == 409 and reply["reason"] == "Conflict"


def test_delete_returns_the_object_then_404(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    r.create_resource_slice(slice_body("s", "node-a"))
    status, gone = call_json(api, "DELETE", "/apis/resource.k8s.io/v1/resourceslices/s")
    assert status == 200 and gone["kind"] == "ResourceSlice" and gone["metadata"]["name"] == "s"
    with pytest.raises(client.ApiException) as err:
        r.delete_resource_slice("s")
    assert err.value.status == 404
    assert json.loads(err.value.body)["message"] == 'resourceslices.resource.k8s.io "s" not found'
    assert server.get(DRA, "resourceslices", "s") is None


def test_claim_status_subresource_and_finalizers(server: FakeApiServer, api: client.ApiClient) -> None:
    path = "/apis/resource.k8s.io/v1/namespaces/ns1/resourceclaims"
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "c", "finalizers": ["resource.kubernetes.io/delete-protection"]},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
             "status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u1"}]}}
    status, made = call_json(api, "POST", path, body=claim)
    assert status == 201 and "status" not in made  # create drops status, like the real strategy
    allocation = {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com",
                                           "pool": "node-a", "device": "gpu-0"}]}}
    status, updated = call_json(api, "PATCH", f"{path}/c/status", body={"status": {"allocation": allocation}},
                                content_type="application/merge-patch+json")
    assert status == 200 and updated["status"]["allocation"] == allocation
    # A main-resource update cannot touch the status.
    status, same = call_json(api, "PATCH", f"{path}/c", body={"status": None},
                             content_type="application/merge-patch+json")
    assert status == 200 and same["status"]["allocation"] == allocation
    typed = client.ResourceV1Api(api).read_namespaced_resource_claim("c", "ns1")
    assert typed.status.allocation.devices.results[0].device == "gpu-0"
    # With a finalizer, delete only marks it; dropping the finalizer removes it.
    status, marked = call_json(api, "DELETE", f"{path}/c")
    assert status == 200 and marked["metadata"]["deletionTimestamp"]
    assert server.get(DRA, "resourceclaims", "c", namespace="ns1") is not None
    status, _ = call_json(api, "PATCH", f"{path}/c", body={"metadata": {"finalizers": None}},
                          content_type="application/merge-patch+json")
    assert status == 200 and server.get(DRA, "resourceclaims", "c", namespace="ns1") is None


def test_dry_run_stores_nothing(server: FakeApiServer, api: client.ApiClient) -> None:
    made = client.ResourceV1Api(api).create_resource_slice(slice_body("s", "node-a"), dry_run="All")
    assert made.metadata.name == "s"
    assert server.list(DRA, "resourceslices") == []


# ---------------------------------------------------------------- watch


def test_watch_with_field_selector_sees_selector_transitions(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    r.create_resource_slice(slice_body("a", "node-a"))
    r.create_resource_slice(slice_body("b", "node-b"))
    listed = r.list_resource_slice(field_selector="spec.nodeName=node-a")
    got = Collector(r.list_resource_slice, field_selector="spec.nodeName=node-a",
                    resource_version=listed.metadata.resource_version)
    wait_until(lambda: server.open_watches == 1, message="watch open")
    r.patch_resource_slice("a", {"spec": {"devices": [{"name": "gpu-7"}]}})  # MODIFIED
    r.patch_resource_slice("b", {"spec": {"nodeName": "node-a"}})  # starts matching: ADDED
    r.patch_resource_slice("a", {"spec": {"nodeName": "node-c"}})  # stops matching: DELETED
    r.create_resource_slice(slice_body("c", "node-c"))  # never matches: nothing
    r.delete_resource_slice("b")  # DELETED
    expected = [("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "a"), ("DELETED", "b")]
    wait_until(lambda: len(got.summary()) >= 4, message="4 watch events")
    got.stop()
    assert got.summary() == expected
    assert all(isinstance(e["object"], client.V1ResourceSlice) for e in got.events)
    # The DELETED for "a" carries its last matching content at the rv of the change.
    gone_a = got.events[2]["raw_object"]
    assert gone_a["spec"]["nodeName"] == "node-a" and gone_a["apiVersion"] == "resource.k8s.io/v1"
    rvs = [int(e["raw_object"]["metadata"]["resourceVersion"]) for e in got.events]
    assert rvs == sorted(rvs) and len(set(rvs)) == 4


def test_watch_without_resource_version_starts_with_current_state(server: FakeApiServer,
                                                                 api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    r.create_resource_slice(slice_body("a", "node-a"))
    r.create_resource_slice(slice_body("b", "node-b"))
    got = Collector(r.list_resource_slice, field_selector="spec.nodeName=node-b")
    wait_until(lambda: got.summary() == [("ADDED", "b")], message="initial ADDED")
    got.stop()


def test_bookmarks_carry_only_the_resource_version(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    r.create_resource_slice(slice_body("a", "node-a"))
    got = Collector(r.list_resource_slice, resource_version=server.resource_version,
                    allow_watch_bookmarks=True)
    wait_until(lambda: any(e["type"] == "BOOKMARK" for e in got.events), message="a bookmark")
    got.stop()
    bookmark = next(e for e in got.events if e["type"] == "BOOKMARK")["raw_object"]
    assert bookmark == {"kind": "ResourceSlice", "apiVersion": "resource.k8s.io/v1",
                        "metadata": {"resourceVersion": server.resource_version}}


def test_no_bookmarks_unless_asked() -> None:
    with running_apiserver("1.37", bookmark_interval=0.01) as srv, api_client(srv.url) as c:
        r = client.ResourceV1Api(c)
        # The stream ends by the server-side timeout; dozens of bookmark periods pass meanwhile.
        events = list(watch.Watch().stream(r.list_resource_slice, resource_version=srv.resource_version,
                                           timeout_seconds=1))
        assert events == []


def test_compacted_resource_version_gives_410_gone(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    old = r.create_resource_slice(slice_body("a", "node-a")).metadata.resource_version
    r.patch_resource_slice("a", {"metadata": {"labels": {"x": "y"}}})
    server.compact()
    status, raw = _raw_watch(api, "/apis/resource.k8s.io/v1/resourceslices", old)
    assert status == 200  # like kube-apiserver: the 410 arrives as an ERROR event in the stream
    assert len(raw) == 1 and raw[0]["type"] == "ERROR"
    assert raw[0]["object"]["code"] == 410 and raw[0]["object"]["reason"] == "Expired"
    # The official Watch turns it into ApiException(410) (no retry when timeout_seconds is set).
    with pytest.raises(client.ApiException) as err:
        list(watch.Watch().stream(r.list_resource_slice, resource_version=old, timeout_seconds=5))
    assert err.value.status == 410
    # The current resourceVersion is still fine.
    current = server.resource_version
    got = Collector(r.list_resource_slice, resource_version=current)
    wait_until(lambda: server.open_watches == 1)
    r.delete_resource_slice("a")
    wait_until(lambda: got.summary() == [("DELETED", "a")])
    got.stop()


def test_history_window_is_bounded() -> None:
    with running_apiserver("1.37", history_size=3) as srv, api_client(srv.url) as c:
        r = client.ResourceV1Api(c)
        first = r.create_resource_slice(slice_body("a", "node-a")).metadata.resource_version
        for i in range(4):
            r.patch_resource_slice("a", {"metadata": {"labels": {"i": str(i)}}})
        assert _raw_watch(c, "/apis/resource.k8s.io/v1/resourceslices", first)[1][0]["object"]["code"] == 410
        recent = str(int(srv.resource_version) - 2)
        events = _raw_watch(c, "/apis/resource.k8s.io/v1/resourceslices", recent)[1]
        assert [e["type"] for e in events] == ["MODIFIED", "MODIFIED"]


def test_close_watches_ends_streams(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    ended = Collector(r.list_resource_slice, resource_version=server.resource_version)
    wait_until(lambda: server.open_watches == 1)
    server.close_watches()
    assert ended.done.wait(10) and ended.error is None
    wait_until(lambda: server.open_watches == 0, message="first watch gone server-side")
    reset = Collector(r.list_resource_slice, resource_version=server.resource_version)
    wait_until(lambda: server.open_watches == 1)
    server.close_watches(mode="reset")
    assert reset.done.wait(10)
    assert isinstance(reset.error, (urllib3.exceptions.ProtocolError, ConnectionError))
    assert sum(1 for q in server.requests if q.watch) == 2


def test_send_initial_events_ends_with_an_annotated_bookmark(server: FakeApiServer, api: client.ApiClient) -> None:
    client.ResourceV1Api(api).create_resource_slice(slice_body("a", "node-a"))
    _status, events = _raw_watch(api, "/apis/resource.k8s.io/v1/resourceslices", None,
                                sendInitialEvents="true", resourceVersionMatch="NotOlderThan",
                                allowWatchBookmarks="true", timeoutSeconds="1")
    assert [e["type"] for e in events[:2]] == ["ADDED", "BOOKMARK"]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def _raw_watch(api: client.ApiClient, path: str, rv: str | None, **extra: str) -> tuple[int, list[dict]]:
    query = [("watch", "true"), ("timeoutSeconds", "1")]
    if rv is not None:
        query.append(("resourceVersion", rv))
    query = [q for q in query if q[0] not in extra] + list(extra.items())
    resp = api.call_api(*api.param_serialize("GET", path, query_params=query))
    lines = [ln for ln in resp.read().decode().splitlines() if ln]
    return resp.status, [json.loads(ln) for ln in lines]


# ---------------------------------------------------------------- DeviceTaintRules


def test_label_selectors_on_device_taint_rules(api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    r.create_device_taint_rule(rule_body("r1", "resource.k8s.io/v1", labels={"owner": "agent", "tier": "1"}))
    r.create_device_taint_rule(rule_body("r2", "resource.k8s.io/v1", labels={"owner": "agent", "tier": "2"}))
    r.create_device_taint_rule(rule_body("r3", "resource.k8s.io/v1", labels={"owner": "admin"}))
    r.create_device_taint_rule(rule_body("r4", "resource.k8s.io/v1"))

    def names(selector: str) -> list[str]:
        return sorted(x.metadata.name for x in r.list_device_taint_rule(label_selector=selector).items)

    assert names("owner=agent") == ["r1", "r2"]
    assert names("owner==agent,tier=2") == ["r2"]
    assert names("owner!=agent") == ["r3", "r4"]  # != matches rules without the label
    assert names("tier") == ["r1", "r2"]
    assert names("!tier") == ["r3", "r4"]
    assert names("owner in (admin, nobody)") == ["r3"]
    assert names("tier notin (1),owner") == ["r2", "r3"]
    assert names("tier>1") == ["r2"]
    status, reply = call_json(api, "GET", "/apis/resource.k8s.io/v1/devicetaintrules",
                              query={"labelSelector": "owner in (a"})
    assert status == 400 and reply["reason"] == "BadRequest"


def test_effect_none_is_rejected_before_1_35() -> None:
    with running_apiserver("1.34") as srv, api_client(srv.url) as c:
        r = client.ResourceV1alpha3Api(c)
        with pytest.raises(client.ApiException) as err:
            r.create_device_taint_rule(rule_body("r", "resource.k8s.io/v1alpha3", effect="None"))
        assert err.value.status == 422
        status = json.loads(err.value.body)
        assert status["reason"] == "Invalid"
        assert status["details"]["causes"][0]["field"] == "spec.taint.effect"
        made = r.create_device_taint_rule(rule_body("r", "resource.k8s.io/v1alpha3", effect="NoSchedule"))
        assert made.spec.taint.time_added is not None  # stamped by the server
    with running_apiserver("1.35") as srv, api_client(srv.url) as c:
        r = client.ResourceV1alpha3Api(c)
        assert r.create_device_taint_rule(rule_body("r", "resource.k8s.io/v1alpha3", effect="None")).spec.taint.effect == "None"
        status, _reply = call_json(c, "POST", "/apis/resource.k8s.io/v1alpha3/devicetaintrules",
                                  body=rule_body("bad", "resource.k8s.io/v1alpha3", effect="PreferNoSchedule"))
        assert status == 422


def test_time_added_is_restamped_when_the_effect_changes(server: FakeApiServer, api: client.ApiClient) -> None:
    path = "/apis/resource.k8s.io/v1/devicetaintrules"
    body = rule_body("r", "resource.k8s.io/v1", effect="None")
    body["spec"]["taint"]["timeAdded"] = "2020-01-01T00:00:00Z"
    status, made = call_json(api, "POST", path, body=body)
    assert status == 201 and made["spec"]["taint"]["timeAdded"] == "2020-01-01T00:00:00Z"
    status, same = call_json(api, "PATCH", f"{path}/r", body={"spec": {"taint": {"value": "v2"}}},
                             content_type="application/merge-patch+json")
    assert same["spec"]["taint"]["timeAdded"] == "2020-01-01T00:00:00Z"
    status, flipped = call_json(api, "PATCH", f"{path}/r", body={"spec": {"taint": {"effect": "NoExecute"}}},
                                content_type="application/merge-patch+json")
    assert status == 200 and flipped["spec"]["taint"]["timeAdded"] > "2020-01-01T00:00:00Z"


def test_an_unconditional_update_of_a_v1_device_taint_rule_is_422_as_in_1_37() -> None:
    """Kubernetes 1.37 (kubernetes/kubernetes#138676): the v1 DeviceTaintRule strategy does not
    allow unconditional updates, so a PUT without metadata.resourceVersion is 422 Invalid; the
    same PUT in v1beta2 (and of a ConfigMap) is accepted, a PUT with the current resourceVersion
    and a merge patch (applied to the stored object) are accepted in v1."""
    with running_apiserver("1.37") as srv, api_client(srv.url) as c:
        path = "/apis/resource.k8s.io/v1/devicetaintrules"
        status, made = call_json(c, "POST", path, body=rule_body("r", "resource.k8s.io/v1", effect="NoSchedule"))
        assert status == 201
        unconditional = rule_body("r", "resource.k8s.io/v1", effect="NoExecute")
        status, reply = call_json(c, "PUT", f"{path}/r", body=unconditional)
        assert status == 422 and reply["reason"] == "Invalid"
        assert reply["message"] == 'devicetaintrules.resource.k8s.io "r" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update'
        assert reply["details"]["causes"][0]["field"] == "metadata.resourceVersion"
        assert srv.get("resource.k8s.io", "devicetaintrules", "r")["spec"]["taint"]["effect"] == "NoSchedule"  # unchanged
        conditional = {**unconditional, "metadata": {**unconditional["metadata"], "resourceVersion": made["metadata"]["resourceVersion"]}}
        status, updated = call_json(c, "PUT", f"{path}/r", body=conditional)
        assert status == 200 and updated["spec"]["taint"]["effect"] == "NoExecute"
        status, _ = call_json(c, "PATCH", f"{path}/r", body={"spec": {"taint": {"effect": "NoSchedule"}}},
                              content_type="application/merge-patch+json")
        assert status == 200
        # the versions that shipped before keep their historic unconditional updates
        status, _ = call_json(c, "PUT", "/apis/resource.k8s.io/v1beta2/devicetaintrules/r", body=rule_body("r", "resource.k8s.io/v1beta2", effect="None"))
        assert status == 200
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "default"}, "data": {"a": "1"}}
        assert call_json(c, "POST", "/api/v1/namespaces/default/configmaps", body=cm)[0] == 201
        assert call_json(c, "PUT", "/api/v1/namespaces/default/configmaps/c", body={**cm, "data": {"a": "2"}})[0] == 200


def test_the_request_log_says_who_asked(tmp_path: Any) -> None:
    from exporter.k8s.connection import connect, get_json  # (the agent's client sends its kubeconfig's token)

    with running_apiserver("1.37") as srv:
        get_json(connect(str(write_kubeconfig(tmp_path / "kubeconfig", srv.url, token="agent-7"))), "/api/v1/namespaces/default/configmaps")
        with api_client(srv.url) as anon:
            call_json(anon, "GET", "/version")
        assert [(r.path, r.user) for r in srv.requests] == [("/api/v1/namespaces/default/configmaps", "agent-7"), ("/version", "")]


# ---------------------------------------------------------------- v1beta1 conversion


def test_v1beta1_nests_device_fields_under_basic() -> None:
    served = {"v1", "resource.k8s.io/v1", "resource.k8s.io/v1beta1"}
    with running_apiserver("1.34", served_versions=served) as srv, api_client(srv.url) as c:
        beta = client.ResourceV1beta1Api(c)
        ga = client.ResourceV1Api(c)
        old_style = slice_body("old", "node-a")
        old_style["apiVersion"] = "resource.k8s.io/v1beta1"
        old_style["spec"]["devices"] = [{"name": "gpu-0", "basic": {
            "attributes": {"uuid": {"string": "GPU-0"}}, "capacity": {"memory": {"value": "40Gi"}}}}]
        beta.create_resource_slice(old_style)
        flat = ga.read_resource_slice("old")
        assert flat.spec.devices[0].attributes["uuid"].string == "GPU-0"
        assert flat.spec.devices[0].capacity["memory"].value == "40Gi"

        ga.create_resource_slice(slice_body("new", "node-a"))
        nested = beta.read_resource_slice("new")
        assert isinstance(nested, client.V1beta1ResourceSlice)
        assert nested.spec.devices[0].basic.attributes["uuid"].string == "GPU-node-a-gpu-0"
        _status, raw = call_json(c, "GET", "/apis/resource.k8s.io/v1beta1/resourceslices/new")
        assert set(raw["spec"]["devices"][0]) == {"name", "basic"}
        # The server's own accessors read the storage (v1) shape by default.
        assert srv.get(DRA, "resourceslices", "old")["spec"]["devices"][0]["attributes"]["uuid"] == {"string": "GPU-0"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.fixed_dictionaries(
    {"name": st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True)},
    optional={"attributes": st.dictionaries(st.sampled_from(["uuid", "model", "index"]),
                                            st.fixed_dictionaries({"string": st.text(max_size=5)})),
              "capacity": st.dictionaries(st.sampled_from(["memory"]),
                                          st.fixed_dictionaries({"value": st.sampled_from(["1Gi", "80Gi"])})),
              "allowMultipleAllocations": st.booleans()}), max_size=4))
def test_v1beta1_conversion_round_trips(devices: list[dict[str, Any]]) -> None:
    rt = ResourceType(DRA, "resourceslices", "ResourceSlice", "resourceslice", False)
    stored = {"metadata": {"name": "x"}, "spec": {"driver": "d", "devices": devices}}
    wire = to_version(rt, "v1beta1", stored)
    assert all(set(d) <= {"name", "basic"} for d in wire["spec"]["devices"])
    assert from_version(rt, "v1beta1", wire) == stored
    assert to_version(rt, "v1", stored) == stored


def test_v1beta1_claim_requests_are_inline() -> None:
    rt = ResourceType(DRA, "resourceclaims", "ResourceClaim", "resourceclaim", True)
    stored = {"spec": {"devices": {"requests": [
        {"name": "a", "exactly": {"deviceClassName": "gpu", "count": 2}},
        {"name": "b", "firstAvailable": [{"name": "x", "deviceClassName": "gpu"}]}]}}}
    wire = to_version(rt, "v1beta1", stored)
    assert wire["spec"]["devices"]["requests"][0] == {"name": "a", "deviceClassName": "gpu", "count": 2}
    assert from_version(rt, "v1beta1", wire) == stored


# ---------------------------------------------------------------- faults, auth, request log


def test_outage_503_and_reset_then_recovery(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    server.outage(True)
    with pytest.raises(client.ApiException) as err:
        r.list_resource_slice()
    assert err.value.status == 503 and json.loads(err.value.body)["reason"] == "ServiceUnavailable"
    server.outage(True, mode="reset")
    with pytest.raises(urllib3.exceptions.MaxRetryError) as reset:
        r.list_resource_slice(_request_timeout=5)
    assert isinstance(reset.value.reason, urllib3.exceptions.ProtocolError)
    assert any(q.status == 0 for q in server.requests)  # reset requests got no response
    server.outage(False)
    assert r.list_resource_slice().items == []


def test_outage_drops_open_watches(server: FakeApiServer, api: client.ApiClient) -> None:
    got = Collector(client.ResourceV1Api(api).list_resource_slice, resource_version=server.resource_version)
    wait_until(lambda: server.open_watches == 1)
    server.outage(True, mode="reset")
    assert got.done.wait(10) and got.error is not None


def test_fail_next_with_retry_after_then_succeeds(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    server.fail_next("POST", r"/resourceslices$", 429, count=2, retry_after=3)
    for _ in range(2):
        with pytest.raises(client.ApiException) as err:
            r.create_resource_slice(slice_body("s", "node-a"))
        assert err.value.status == 429 and err.value.headers["Retry-After"] == "3"
        assert json.loads(err.value.body)["details"]["retryAfterSeconds"] == 3
    r.create_resource_slice(slice_body("s", "node-a"))
    server.fail_next("*", "devicetaintrules", 500)
    assert r.list_resource_slice().items  # other paths are unaffected
    with pytest.raises(client.ApiException) as err:
        r.list_device_taint_rule()
    assert err.value.status == 500 and json.loads(err.value.body)["reason"] == "InternalError"
    posts = [q for q in server.requests if q.method == "POST"]
    assert [q.status for q in posts] == [429, 429, 201]
    assert posts[-1].body["metadata"]["name"] == "s"


def test_fail_next_can_target_only_watches(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    server.fail_next("GET", "resourceslices", 500, watch=True)
    assert r.list_resource_slice().items == []
    with pytest.raises(client.ApiException) as err:
        list(watch.Watch().stream(r.list_resource_slice, timeout_seconds=5))
    assert err.value.status == 500


def test_delay_next_trips_a_client_timeout(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    # urllib3 (under the official client) retries a GET three times after a read timeout,
    # so all four attempts must be slow for the caller to see the timeout.
    server.delay_next("resourceslices", seconds=30, count=4)
    with pytest.raises(urllib3.exceptions.MaxRetryError) as err:
        r.list_resource_slice(_request_timeout=(5, 0.2))
    assert isinstance(err.value.reason, urllib3.exceptions.ReadTimeoutError)
    assert len([q for q in server.requests if q.path.endswith("/resourceslices")]) == 4
    assert r.list_resource_slice().items == []  # the delays are used up


def test_bearer_token_and_kubeconfig(tmp_path: Any) -> None:
    with running_apiserver("1.37", require_token="s3cret") as srv:
        with api_client(srv.url) as anon:
            status, reply = call_json(anon, "GET", "/apis/resource.k8s.io/v1/resourceslices")
            assert status == 401 and reply["reason"] == "Unauthorized"
            assert call_json(anon, "GET", "/version")[0] == 200
        path = write_kubeconfig(tmp_path / "kubeconfig", srv.url, token="s3cret")
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(path), client_configuration=cfg)
        with client.ApiClient(cfg) as c:
            assert client.ResourceV1Api(c).list_resource_slice().items == []


# ---------------------------------------------------------------- events.k8s.io/v1


def test_events_v1_rules(server: FakeApiServer, api: client.ApiClient) -> None:
    ev = client.EventsV1Api(api)
    event = {"apiVersion": "events.k8s.io/v1", "kind": "Event",
             "metadata": {"generateName": "node-a."},
             "eventTime": "2026-01-01T00:00:00.000000Z",
             "reportingController": "example.com/gpu-agent", "reportingInstance": "gpu-agent-node-a",
             "action": "Taint", "reason": "DeviceTainted", "type": "Warning", "note": "gpu-0 is failing",
             "regarding": {"kind": "Node", "name": "node-a", "apiVersion": "v1"}}
    made = ev.create_namespaced_event("default", event)
    assert made.reason == "DeviceTainted" and made.metadata.name.startswith("node-a.")
    status, reply = call_json(api, "POST", "/apis/events.k8s.io/v1/namespaces/gpu/events", body=event)
    assert status == 422  # cluster-scoped regarding object: the event belongs in default
    missing = {k: v for k, v in event.items() if k != "reportingController"}
    status, reply = call_json(api, "POST", "/apis/events.k8s.io/v1/namespaces/default/events", body=missing)
    assert status == 422 and reply["details"]["causes"][0]["field"] == "reportingController"
    path = f"/apis/events.k8s.io/v1/namespaces/default/events/{made.metadata.name}"
    series = {"series": {"count": 2, "lastObservedTime": "2026-01-01T00:00:05.000000Z"}}
    assert call_json(api, "PATCH", path, body=series, content_type="application/merge-patch+json")[0] == 200
    status, _ = call_json(api, "PATCH", path, body={"note": "changed"}, content_type="application/merge-patch+json")
    assert status == 422  # note is immutable


# ---------------------------------------------------------------- schema validation hook


def test_kubernetes_validate_hook_rejects_invalid_objects() -> None:
    seen: list[tuple[str, str]] = []

    def strict_1_34(api_version: str, kind: str, body: dict[str, Any]) -> None:
        seen.append((api_version, kind))
        kubernetes_validate.validate(body, "1.34", strict=True)

    with running_apiserver("1.34", validator=strict_1_34) as srv, api_client(srv.url) as c:
        r = client.ResourceV1Api(c)
        assert r.create_resource_slice(slice_body("good", "node-a")).metadata.name == "good"
        bad = slice_body("bad", "node-a")
        bad["spec"]["devices"][0]["colour"] = "red"  # not in the 1.34 schema
        status, reply = call_json(c, "POST", "/apis/resource.k8s.io/v1/resourceslices", body=bad)
        assert status == 422 and reply["reason"] == "Invalid"
        assert "'colour' was unexpected" in reply["message"]
        assert srv.get(DRA, "resourceslices", "bad") is None
        # Patches are validated on their result too.
        status, reply = call_json(c, "PATCH", "/apis/resource.k8s.io/v1/resourceslices/good",
                                  body={"spec": {"pool": {"generation": "one"}}},
                                  content_type="application/merge-patch+json")
        assert status == 422
        assert seen[0] == ("resource.k8s.io/v1", "ResourceSlice")


def test_apply_backdoor_emits_watch_events(server: FakeApiServer, api: client.ApiClient) -> None:
    r = client.ResourceV1Api(api)
    got = Collector(r.list_resource_slice, resource_version=server.resource_version)
    wait_until(lambda: server.open_watches == 1)
    server.apply(slice_body("s", "node-a"))
    again = server.apply(slice_body("s", "node-a", ("gpu-0", "gpu-1")))
    assert again["metadata"]["generation"] == 2
    claim = server.apply({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                          "metadata": {"name": "c", "namespace": "ns"},
                          "spec": {"devices": {"requests": []}},
                          "status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}})
    assert claim["status"]["reservedFor"][0]["name"] == "p"  # status kept, unlike a POST
    assert server.delete(DRA, "resourceslices", "s") is True
    wait_until(lambda: len(got.summary()) == 3)
    got.stop()
    assert got.summary() == [("ADDED", "s"), ("MODIFIED", "s"), ("DELETED", "s")]
    assert [i["metadata"]["name"] for i in server.list(DRA, "resourceclaims")] == ["c"]


# ---------------------------------------------------------------- pure parts


def test_label_selector_parser() -> None:
    reqs = parse_label_selector("a=b, c in (d,e),!f,g,h!=i")
    assert [(r.key, r.op, r.values) for r in reqs] == [
        ("a", "=", ("b",)), ("c", "in", ("d", "e")), ("f", "!", ()), ("g", "exists", ()), ("h", "!=", ("i",))]
    for bad in ("a=(", "a in (b", "=b", "a=b c"):
        with pytest.raises(ValueError):
            parse_label_selector(bad)


def test_field_selector_escapes() -> None:
    sel = Selector.parse(None, r"metadata.name=a\,b,spec.allNodes=true")
    assert sel.matches({"metadata": {"name": "a,b"}, "spec": {"allNodes": True}})
    assert not sel.matches({"metadata": {"name": "a"}, "spec": {"allNodes": True}})
    assert Selector.parse(None, "spec.nodeName=").matches({"spec": {}})  # missing reads as ""
    with pytest.raises(ValueError):
        Selector.parse(None, "spec.nodeName")


def test_patch_functions() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": None, "e": 3}, "d": [2]}) == \
        {"a": {"c": 2, "e": 3}, "d": [2]}
    doc = {"a": [1, 2], "b": {"c": "x"}}
    assert json_patch(doc, [{"op": "move", "from": "/b/c", "path": "/a/0"},
                            {"op": "copy", "from": "/a/1", "path": "/z"}]) == {"a": ["x", 1, 2], "b": {}, "z": 1}
    assert doc == {"a": [1, 2], "b": {"c": "x"}}  # input untouched
    with pytest.raises(PatchError) as err:
        json_patch(doc, [{"op": "remove", "path": "/nope"}])
    assert err.value.code == 422


def test_the_request_log_keeps_only_the_newest_requests():
    """The demo runs for days under scrapes: its emulation must not remember every request."""
    with running_apiserver("1.37", request_log_size=3) as srv, api_client(srv.url) as c:
        for i in range(6):
            assert call_json(c, "GET", f"/api/v1/namespaces/ns{i}")[0] == 404
        assert [r.path for r in srv.requests] == [f"/api/v1/namespaces/ns{i}" for i in (3, 4, 5)]
