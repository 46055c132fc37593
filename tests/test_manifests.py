"""Every manifest we ship, against the official Kubernetes schemas and against our own contract.

daemonset.yaml and deploy/prometheus-operator.yaml are generated from the Helm chart
(tools/render_manifest.py); tests/test_chart.py checks the chart itself and keeps them equal to
its render. What the agent's RBAC must hold is derived from its own requests in
tests/test_rbac_derived.py.

Built-in kinds are validated strictly (unknown fields rejected) with kubernetes-validate for every
supported release, 1.34 to 1.37. Prometheus Operator kinds (ServiceMonitor, PrometheusRule) have no
official schema there; they get a field whitelist taken from the operator's CRDs, and the rules
inside the PrometheusRule are checked by promtool in test_alerts.py.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate.utils import SchemaNotFoundError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VERSIONS = ["1.34", "1.35", "1.36", "1.37"]
NAMESPACE = "dra-gpu-exporter"
SA = "dra-gpu-exporter"
# Kinds that come from CRDs and so have no schema in kubernetes-validate.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifest_files() -> list[Path]:
    files = [REPO / "daemonset.yaml", REPO / "alerts" / "prometheusrule.yaml"]
    # the dcgm-exporter compatibility rules of both generations (tests/test_dcgm_compat.py checks their rules)
    files += sorted((REPO / "alerts").glob("dcgm-compat*.prometheusrule.yaml"))
    # deploy/helm holds Go templates, not manifests: test_chart.py validates its renders.
    files += sorted(
        p for p in (REPO / "deploy").rglob("*.yaml") if "patch" not in p.name and "helm" not in p.relative_to(REPO).parts
    )
    return files


def all_docs() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in manifest_files():
        for doc in load_docs(path):
            yield f"{path.relative_to(REPO)}:{doc['kind']}/{doc['metadata']['name']}", doc


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected exactly one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return load_docs(REPO / "daemonset.yaml")


@pytest.fixture(scope="module")
def daemonset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "DaemonSet", "dra-gpu-exporter")


@pytest.fixture(scope="module")
def container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (c,) = daemonset["spec"]["template"]["spec"]["containers"]
    return c


# --- official schemas -------------------------------------------------------------------------


def _validate_everywhere(doc: dict[str, Any]) -> list[str]:
    """Validate in every release; return the releases whose schema had the kind."""
    validated = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except SchemaNotFoundError:
            continue
        validated.append(version)
    return validated


@pytest.mark.parametrize("ident,doc", list(all_docs()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_document_validates_strictly(ident: str, doc: dict[str, Any]) -> None:
    validated = _validate_everywhere(doc)
    if doc["kind"] in CRD_KINDS:
        assert not validated
        return
    # Every built-in kind we ship exists in all supported releases.
    assert validated == VERSIONS, f"{ident} has no schema in {sorted(set(VERSIONS) - set(validated))}"


def test_strict_validation_rejects_a_misspelled_field(daemonset: dict[str, Any]) -> None:
    broken = copy.deepcopy(daemonset)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37", strict=True)


def test_manifest_holds_the_whole_install(docs: list[dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "Namespace",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",  # the budget and state ConfigMaps in the agent's namespace
            "RoleBinding",
            "ValidatingAdmissionPolicy",  # DeviceTaintRules
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicy",  # Events (any namespace: an Event about a pod is in its namespace)
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicy",  # ConfigMaps
            "ValidatingAdmissionPolicyBinding",
            "PriorityClass",
            "ConfigMap",  # the cluster budget
            "DaemonSet",
            "Service",
        ]
    )
    for doc in docs:
        if doc["kind"] in {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"} or doc[
            "kind"
        ].startswith("ValidatingAdmissionPolicy"):
            assert "namespace" not in doc["metadata"], doc["kind"]
        else:
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["kind"]


def test_the_dcgm_compat_wrappers_are_one_prometheusrule_each() -> None:
    wrappers = sorted((REPO / "alerts").glob("dcgm-compat*.prometheusrule.yaml"))
    assert [p.name for p in wrappers] == ["dcgm-compat-4.9.prometheusrule.yaml", "dcgm-compat.prometheusrule.yaml"]
    names = set()
    for path in wrappers:
        (doc,) = load_docs(path)
        assert doc["kind"] == "PrometheusRule" and doc["metadata"]["namespace"] == NAMESPACE
        assert set(doc["spec"]) == {"groups"} and doc["spec"]["groups"]
        names.add(doc["metadata"]["name"])
    assert len(names) == len(wrappers)  # applying both must not make one replace the other


def test_the_core_manifest_needs_no_crd(docs: list[dict[str, Any]]) -> None:
    # `kubectl apply -f daemonset.yaml` must work on a bare cluster (and in GitOps syncs).
    assert not [d["kind"] for d in docs if d["kind"] in CRD_KINDS]
    operator = load_docs(REPO / "deploy" / "prometheus-operator.yaml")
    assert sorted(d["kind"] for d in operator) == ["PrometheusRule", "ServiceMonitor"]


# --- RBAC: least privilege --------------------------------------------------------------------

READ = ["get", "list", "watch"]


def _rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_cluster_role_is_least_privilege(docs: list[dict[str, Any]]) -> None:
    # What the agent's requests need (derived and compared both ways in test_rbac_derived.py);
    # issue 16 trimmed claims to get, slices to list/watch, and dropped cluster-wide pod lists
    # (only --per-process / --pod-label-allowlist list this node's pods). Issue 23: a pod that
    # outstays a NoExecute taint is read by name (get, never list), and told in an Event in its
    # own namespace (create, confined by the own-node-events admission policy).
    rules = _rules(one(docs, "ClusterRole", "dra-gpu-exporter"))
    assert rules == {
        ("resource.k8s.io", "resourceslices"): {"list", "watch"},
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("", "pods"): {"get"},
        ("events.k8s.io", "events"): {"create"},
        ("", "nodes"): {"list", "watch"},  # this node only, by fieldSelector (NodeWatch)
        # get: adopting our own rule after a 409 on create
        ("resource.k8s.io", "devicetaintrules"): {"get", "list", "watch", "create", "patch", "delete"},
    }


def test_namespaced_grants(docs: list[dict[str, Any]]) -> None:
    """ConfigMaps only in the agent's namespace: the budget and the node state (whose names RBAC
    cannot pin for create; the state policy does); only the budget object, by name, is listed and
    watched (while an agent waits for a slot). No other Role: Events are created in the
    namespace of what they are about (the ClusterRole; the own-node-events policy confines them)."""
    assert [d["metadata"]["name"] for d in docs if d["kind"] in ("Role", "RoleBinding")] == ["dra-gpu-exporter", "dra-gpu-exporter"]
    own = one(docs, "Role", "dra-gpu-exporter")
    assert own["metadata"]["namespace"] == NAMESPACE
    assert own["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "update"]},
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["dra-gpu-exporter-budget"], "verbs": ["list", "watch"]},
    ]
    budget = one(docs, "ConfigMap", "dra-gpu-exporter-budget")
    assert budget["metadata"]["namespace"] == NAMESPACE
    assert set(budget["data"]) == {"max_domains", "fraction", "cluster_gpus"}


@pytest.mark.parametrize("kind,role_kind,name", [
    ("ClusterRoleBinding", "ClusterRole", "dra-gpu-exporter"),
    ("RoleBinding", "Role", "dra-gpu-exporter"),
])
def test_bindings_grant_only_the_agent(docs: list[dict[str, Any]], kind: str, role_kind: str, name: str) -> None:
    binding = one(docs, kind, name)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SA, "namespace": NAMESPACE}]
    one(docs, role_kind, name)


@pytest.mark.parametrize("name", ["dra-gpu-exporter-own-node-taints", "dra-gpu-exporter-own-node-state", "dra-gpu-exporter-own-node-events"])
def test_admission_policy_is_bound_and_targets_the_agent(docs: list[dict[str, Any]], name: str) -> None:
    policy = one(docs, "ValidatingAdmissionPolicy", name)
    binding = one(docs, "ValidatingAdmissionPolicyBinding", name)
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    (condition,) = policy["spec"]["matchConditions"]
    assert f"system:serviceaccount:{NAMESPACE}:{SA}" in condition["expression"]


# --- the DaemonSet ----------------------------------------------------------------------------


def test_pod_runs_as_the_agent_with_our_priority_class(docs: list[dict[str, Any]], daemonset: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == SA
    one(docs, "ServiceAccount", SA)
    one(docs, "PriorityClass", pod["priorityClassName"])
    selector = daemonset["spec"]["selector"]["matchLabels"]
    assert selector.items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()


def test_node_name_comes_from_the_downward_api(container: dict[str, Any]) -> None:
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_container_image_args_and_port(container: dict[str, Any]) -> None:
    assert container["image"] == "ghcr.io/dra-gpu-exporter/dra-gpu-exporter:0.1.0"
    args = container["args"]
    assert args[args.index("--listen") + 1] == "0.0.0.0:9402"
    # The mode is an environment variable, so `kubectl set env` can change it (issue 15): a
    # --taint-mode flag would silently win over it.
    assert "--taint-mode" not in args
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DRA_GPU_EXPORTER_TAINT_MODE"] == "enforce"
    assert {"name": "metrics", "containerPort": 9402, "protocol": "TCP"} in container["ports"]


def test_probes_use_healthz_and_readyz_on_the_metrics_port(container: dict[str, Any]) -> None:
    port_names = {p["name"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in port_names


def test_resources_have_requests_and_limits(container: dict[str, Any]) -> None:
    resources = container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert set(resources["limits"]) == {"cpu", "memory"}
    # Memory target is 80 MB RSS; the request must cover it, the limit must leave headroom.
    assert resources["requests"]["memory"] == "96Mi"
    assert resources["limits"]["memory"] == "256Mi"


def test_security_context_is_as_tight_as_the_socket_allows(daemonset: dict[str, Any], container: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "add" not in sc["capabilities"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # hostPID only for per-process attribution, which is off by default.
    assert pod.get("hostPID", False) is False
    assert pod.get("hostNetwork", False) is False
    assert pod.get("hostIPC", False) is False


def test_only_the_pod_resources_directory_comes_from_the_host(daemonset: dict[str, Any], container: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"pod-resources": {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["pod-resources"]["mountPath"] == "/var/lib/kubelet/pod-resources"
    assert mounts["pod-resources"]["readOnly"] is True


def test_tolerations_cover_gpu_nodes(daemonset: dict[str, Any]) -> None:
    tolerations = daemonset["spec"]["template"]["spec"]["tolerations"]
    for key in ("nvidia.com/gpu", "amd.com/gpu"):
        for effect in ("NoSchedule", "NoExecute"):
            assert any(
                t.get("effect") == effect and t["operator"] == "Exists" and t.get("key") in (None, key)
                for t in tolerations
            ), (key, effect)


def test_namespace_pod_security_admits_the_pod(docs: list[dict[str, Any]]) -> None:
    # hostPath volumes are forbidden by the baseline level.
    labels = one(docs, "Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


# --- Service and ServiceMonitor ---------------------------------------------------------------

SERVICE_MONITOR_FIELDS = {
    "spec": {"attachMetadata", "bodySizeLimit", "endpoints", "fallbackScrapeProtocol", "jobLabel",
             "keepDroppedTargets", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit",
             "namespaceSelector", "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor",
             "podTargetLabels", "sampleLimit", "scrapeClass", "scrapeClassicHistograms",
             "scrapeProtocols", "selector", "selectorMechanism", "targetLabels", "targetLimit"},
    "endpoint": {"authorization", "basicAuth", "bearerTokenFile", "bearerTokenSecret", "enableHttp2",
                 "filterRunning", "followRedirects", "honorLabels", "honorTimestamps", "interval",
                 "metricRelabelings", "oauth2", "params", "path", "port", "proxyUrl", "relabelings",
                 "scheme", "scrapeTimeout", "targetPort", "tlsConfig", "trackTimestampsStaleness"},
    "relabeling": {"action", "modulus", "regex", "replacement", "separator", "sourceLabels", "targetLabel"},
    "namespaceSelector": {"any", "matchNames"},
}


@pytest.fixture(scope="module")
def operator_docs() -> list[dict[str, Any]]:
    return load_docs(REPO / "deploy" / "prometheus-operator.yaml")


def test_service_selects_the_agent_pods(docs: list[dict[str, Any]], daemonset: dict[str, Any]) -> None:
    service = one(docs, "Service")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port == {"name": "metrics", "port": 9402, "targetPort": "metrics", "protocol": "TCP"}


def test_service_monitor_scrapes_the_service_with_honor_labels(
    docs: list[dict[str, Any]], operator_docs: list[dict[str, Any]]
) -> None:
    service = one(docs, "Service")
    monitor = one(operator_docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= SERVICE_MONITOR_FIELDS["spec"]
    assert set(spec["namespaceSelector"]) <= SERVICE_MONITOR_FIELDS["namespaceSelector"]
    assert spec["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = spec["endpoints"]
    assert set(endpoint) <= SERVICE_MONITOR_FIELDS["endpoint"]
    assert endpoint["honorLabels"] is True
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    for relabel in endpoint.get("relabelings", []):
        assert set(relabel) <= SERVICE_MONITOR_FIELDS["relabeling"]


# --- the admin-access variant (deploy/admin-access) -------------------------------------------


def _pointer(doc: Any, path: str) -> tuple[Any, str]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc, parts[-1]


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The RFC 6902 subset kubectl users need here: add, remove, replace, test."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parent, key = _pointer(doc, op["path"])
        if op["op"] == "test":
            actual = parent[int(key)] if isinstance(parent, list) else parent[key]
            assert actual == op["value"], f"patch test failed at {op['path']}: {actual!r}"
        elif op["op"] == "remove":
            del parent[int(key) if isinstance(parent, list) else key]
        elif op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                if key == "-":
                    parent.append(op["value"])
                elif op["op"] == "replace":
                    parent[int(key)] = op["value"]
                else:
                    parent.insert(int(key), op["value"])
            else:
                if op["op"] == "replace":
                    assert key in parent
                parent[key] = op["value"]
        else:
            raise AssertionError(f"unsupported patch op {op['op']}")
    return doc


@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_admin_access_variant_is_a_valid_daemonset(daemonset: dict[str, Any], vendor: str) -> None:
    patch = yaml.safe_load((REPO / "deploy" / "admin-access" / f"daemonset-patch-{vendor}.yaml").read_text())
    patched = apply_json_patch(daemonset, patch)
    assert _validate_everywhere(patched) == VERSIONS
    pod = patched["spec"]["template"]["spec"]
    assert "runtimeClassName" not in pod
    env_names = {e["name"] for e in pod["containers"][0]["env"]}
    assert not any(n.startswith("NVIDIA_") for n in env_names)
    assert "NODE_NAME" in env_names
    (claim,) = pod["resourceClaims"]
    assert pod["containers"][0]["resources"]["claims"] == [{"name": claim["name"]}]
    templates = load_docs(REPO / "deploy" / "admin-access" / "claim-templates.yaml")
    template = one(templates, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    assert template["metadata"]["namespace"] == NAMESPACE
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    exactly = request["exactly"]
    assert exactly["adminAccess"] is True and exactly["allocationMode"] == "All"
    assert exactly["deviceClassName"] == f"gpu.{vendor}.com"
    # The agent's own NoExecute taints must not evict the agent.
    assert {"operator": "Exists"} in exactly["tolerations"]


# --- the DaemonSet's flags exist in the CLI ---------------------------------------------------


def test_daemonset_flags_are_accepted_by_the_cli(container: dict[str, Any]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in (a for a in container["args"] if a.startswith("--")):
        assert flag in result.stdout, f"{flag} not in `dra-gpu-exporter --help`"


# --- the kube-rbac-proxy variant (deploy/kube-rbac-proxy) -------------------------------------


def _patch(name: str) -> list[dict[str, Any]]:
    return yaml.safe_load((REPO / "deploy" / "kube-rbac-proxy" / name).read_text())


def test_kube_rbac_proxy_variant_is_valid_and_consistent(
    docs: list[dict[str, Any]], operator_docs: list[dict[str, Any]], daemonset: dict[str, Any]
) -> None:
    patched = apply_json_patch(daemonset, _patch("daemonset-patch.yaml"))
    assert _validate_everywhere(patched) == VERSIONS
    agent, proxy = patched["spec"]["template"]["spec"]["containers"]
    # The agent is reachable only through the proxy.
    assert agent["args"][agent["args"].index("--listen") + 1] == "127.0.0.1:9402"
    assert "ports" not in agent or not agent["ports"]
    assert "--upstream=http://127.0.0.1:9402/" in proxy["args"]
    proxy_ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = agent[probe]["httpGet"]
        assert get["port"] in proxy_ports and get["scheme"] == "HTTPS"
        assert get["path"] in next(a for a in proxy["args"] if a.startswith("--ignore-paths=")), probe
    assert proxy["securityContext"]["runAsNonRoot"] is True
    assert proxy["securityContext"]["readOnlyRootFilesystem"] is True

    service = apply_json_patch(one(docs, "Service"), _patch("service-patch.yaml"))
    assert _validate_everywhere(service) == VERSIONS
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in proxy_ports and port["port"] == proxy_ports[port["targetPort"]]

    monitor = apply_json_patch(one(operator_docs, "ServiceMonitor"), _patch("servicemonitor-patch.yaml"))
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= SERVICE_MONITOR_FIELDS["endpoint"]
    assert endpoint["port"] == port["name"] and endpoint["scheme"] == "https"
    assert endpoint["honorLabels"] is True

    rbac = load_docs(REPO / "deploy" / "kube-rbac-proxy" / "rbac.yaml")
    reviews = _rules(one(rbac, "ClusterRole", "dra-gpu-exporter-kube-rbac-proxy"))
    assert reviews == {
        ("authentication.k8s.io", "tokenreviews"): {"create"},
        ("authorization.k8s.io", "subjectaccessreviews"): {"create"},
    }
    reader = one(rbac, "ClusterRole", "dra-gpu-exporter-metrics-reader")
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
