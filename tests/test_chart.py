"""The Helm chart deploy/helm/dra-gpu-exporter, with the real Helm engine (helm-python-sdk: Helm v4
as a library).

* daemonset.yaml and deploy/prometheus-operator.yaml are the chart's render (and the chart's
  copies of alerts/ and dashboards/ equal their sources): tools/render_manifest.py --check.
* `helm lint --strict` is clean for the defaults and for every toggle.
* Every render (defaults and each toggle) validates strictly with kubernetes-validate for every
  supported release, 1.34 to 1.37; Prometheus Operator kinds, which have no official schema
  there, get the field whitelist of test_manifests.py.
* The documented rollout commands (`kubectl set env ... DRA_GPU_EXPORTER_TAINT_MODE=...`),
  applied to the rendered DaemonSet, change the mode the agent resolves (exporter/config.py).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from chart_render import CHART, render, render_docs, render_manifest  # tools/render_manifest.py, put on sys.path by chart_render

from exporter import config

kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate.utils import SchemaNotFoundError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VERSIONS = ["1.34", "1.35", "1.36", "1.37"]
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

# Each toggle of values.yaml, alone; every one must lint, render and validate.
TOGGLES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespace": {"namespace": {"create": True}},
    "service-monitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}},
    "pod-monitor": {"podMonitor": {"enabled": True}, "service": {"enabled": False}},
    "prometheus-rule": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}},
    "dcgm-compat-4.8": {"dcgmCompat": {"generation": "4.8"}},
    "dcgm-compat-4.9": {"dcgmCompat": {"generation": 4.9}, "prometheusRule": {"labels": {"release": "kps"}}},
    "dcgm-compat-both": {"dcgmCompat": {"generation": "both"}, "prometheusRule": {"enabled": True}},
    "dashboards": {"dashboards": {"enabled": True, "namespace": "monitoring"}},
    "kube-rbac-proxy": {"kubeRbacProxy": {"enabled": True, "tlsSecretName": "metrics-tls"},
                        "serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
    "web-config": {"webConfig": {"enabled": True, "secretName": "dra-gpu-exporter-web"}, "serviceMonitor": {"enabled": True}},
    "no-admission-policy": {"admissionPolicy": {"enabled": False}},
    "gpu-drivers": {"admissionPolicy": {"gpuDrivers": ["gpu.nvidia.com"]}},
    "amd": {"deviceAccess": {"nvidiaRuntime": {"enabled": False},
                             "adminAccessClaim": {"enabled": True, "deviceClassName": "gpu.amd.com"},
                             "amdRocm": {"enabled": True}},
            "namespace": {"create": True}},
    "nvidia-default-runtime": {"deviceAccess": {"nvidiaRuntime": {"runtimeClassName": ""}}},
    "scheduling": {"nodeSelector": {"node-role.kubernetes.io/gpu": ""}, "affinity": {},
                   "tolerations": [{"operator": "Exists"}]},
    "resources-and-priority": {"resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
                               "priorityClass": {"create": False, "name": "system-node-critical"}},
    "image-digest": {"image": {"repository": "registry.example.com/dge", "digest": "sha256:" + "a" * 64},
                     "imagePullSecrets": [{"name": "pull"}]},
    "taint-mode": {"taintMode": "shadow"},
    "per-process": {"perProcess": True, "podLabelAllowlist": ["app.kubernetes.io/name", "team"]},
    "extra": {"extraArgs": ["--interval", "5"], "extraEnv": [{"name": "DRA_GPU_EXPORTER_LOG_LEVEL", "value": "debug"}],
              "podAnnotations": {"example.com/a": "b"}, "podLabels": {"team": "gpu"}, "scrapeAnnotations": False},
    "budget": {"budget": {"maxDomains": 8, "fraction": 0.1, "clusterGPUs": 4000}},
    "network-policy": {"networkPolicy": {"enabled": True}},
    "network-policy-selectors": {"networkPolicy": {
        "enabled": True, "metrics": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                                     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
        "apiServer": {"cidrs": ["10.0.0.10/32", "fd00::10/128"], "port": 443},
        "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.1.0.0/16"}}], "ports": [{"port": 4317, "protocol": "TCP"}]}]},
        "kubeRbacProxy": {"enabled": True}},
}


def _validate(doc: dict[str, Any]) -> list[str]:
    done = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except SchemaNotFoundError:
            continue
        done.append(version)
    return done


def _check_operator_fields(doc: dict[str, Any]) -> None:
    """The field whitelist taken from the Prometheus Operator's CRDs (test_manifests.py)."""
    from test_manifests import SERVICE_MONITOR_FIELDS as F

    spec = doc["spec"]
    if doc["kind"] == "PrometheusRule":
        assert set(spec) == {"groups"} and spec["groups"]
        return
    assert set(spec) <= F["spec"] | {"podMetricsEndpoints"}, doc["kind"]
    endpoints = spec["endpoints"] if doc["kind"] == "ServiceMonitor" else spec["podMetricsEndpoints"]
    allowed = F["endpoint"] if doc["kind"] == "ServiceMonitor" else (F["endpoint"] - {"bearerTokenFile", "targetPort"}) | {"portNumber"}
    for endpoint in endpoints:
        assert set(endpoint) <= allowed, set(endpoint) - allowed
        for relabel in endpoint.get("relabelings", []):
            assert set(relabel) <= F["relabeling"]


# --- one source of truth ----------------------------------------------------------------------


def test_manifests_are_the_charts_render() -> None:
    diffs = render_manifest.differences()
    assert diffs == [], "run `.venv/bin/python tools/render_manifest.py`:\n" + "\n".join(diffs)


def test_the_check_notices_a_drifted_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drifted = tmp_path / "daemonset.yaml"
    drifted.write_text((REPO / "daemonset.yaml").read_text().replace("cpu: 25m", "cpu: 30m"))
    monkeypatch.setattr(render_manifest, "MANIFEST", drifted)
    diffs = render_manifest.differences()
    assert len(diffs) == 1 and "cpu: 25m" in diffs[0]


def test_chart_versions_follow_the_package() -> None:
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    with helm_python.Chart.load(CHART) as chart:
        assert chart.metadata["appVersion"] == version
        assert chart.version == version


# --- helm lint --------------------------------------------------------------------------------


@pytest.mark.parametrize("toggle", sorted(TOGGLES))
def test_helm_lint_is_clean(toggle: str) -> None:
    report = helm_python.lint(CHART, TOGGLES[toggle], strict=True, namespace="dra-gpu-exporter", kube_version="v1.34.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


# --- every render validates -------------------------------------------------------------------


@pytest.mark.parametrize("toggle", sorted(TOGGLES))
def test_every_render_validates_strictly(toggle: str) -> None:
    docs = render_docs(TOGGLES[toggle])
    assert docs
    for doc in docs:
        ident = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in CRD_KINDS:
            assert _validate(doc) == [], ident
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            _check_operator_fields(doc)
        else:
            assert _validate(doc) == VERSIONS, ident


@pytest.mark.parametrize(
    "values",
    [
        {"taintMode": "on"},
        {"colour": "blue"},
        {"image": {"repository": "x", "tagg": "1"}},
        {"admissionPolicy": {"gpuDrivers": []}},
        {"budget": {"fraction": 2}},
        {"serviceMonitor": {"enabled": True, "interval": "soon"}},
        {"dcgmCompat": {"generation": "4.7"}},
        {"dcgmCompat": {"generation": 4.7}},
        {"dcgmCompat": {"enabled": True}},
        {"networkPolicy": {"enabled": True, "apiServer": {"cidrs": ["10.0.0.10"]}}},
        {"networkPolicy": {"enabled": True, "ingressFrom": []}},
    ],
    ids=["mode", "unknown-key", "unknown-image-key", "no-drivers", "fraction", "interval", "dcgm-generation",
         "dcgm-generation-number", "dcgm-unknown-key", "network-policy-cidr", "network-policy-unknown-key"],
)
def test_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmError):
        render(values)


def test_web_config_and_kube_rbac_proxy_exclude_each_other() -> None:
    with pytest.raises(helm_python.HelmError, match="enable one of them"):
        render({"webConfig": {"enabled": True, "secretName": "s"}, "kubeRbacProxy": {"enabled": True}})
    with pytest.raises(helm_python.HelmError, match=r"webConfig.secretName"):
        render({"webConfig": {"enabled": True}})


# --- what the toggles do ----------------------------------------------------------------------


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _agent(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    ds = _one(docs, "DaemonSet")
    return ds["spec"]["template"]["spec"], ds["spec"]["template"]["spec"]["containers"][0]


def test_prometheus_rule_holds_the_alerts_files_rules() -> None:
    rule = _one(render_docs(TOGGLES["prometheus-rule"]), "PrometheusRule")
    source = yaml.safe_load((REPO / "alerts" / "dra-gpu-exporter.rules.yml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
    assert rule["metadata"]["labels"]["release"] == "kps"


# dcgm-exporter compatibility rules (issue 24): one PrometheusRule per generation, chosen by
# dcgmCompat.generation, each holding its alerts/ file's groups unchanged.
DCGM_SETS = {"4.8": ("dra-gpu-exporter-dcgm-compat", "dcgm-compat.rules.yml"),
             "4.9": ("dra-gpu-exporter-dcgm-compat-4-9", "dcgm-compat-4.9.rules.yml")}


def _dcgm_rules(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "PrometheusRule" and "dcgm-compat" in d["metadata"]["name"]}


@pytest.mark.parametrize("toggle,generations", [("defaults", []), ("prometheus-rule", []), ("dcgm-compat-4.8", ["4.8"]),
                                                ("dcgm-compat-4.9", ["4.9"]), ("dcgm-compat-both", ["4.8", "4.9"])])
def test_dcgm_compat_generation_selects_the_rule_sets(toggle: str, generations: list[str]) -> None:
    docs = render_docs(TOGGLES[toggle])
    found = _dcgm_rules(docs)
    assert sorted(found) == sorted(DCGM_SETS[g][0] for g in generations)
    for g in generations:
        name, file = DCGM_SETS[g]
        source = yaml.safe_load((REPO / "alerts" / file).read_text())
        assert found[name]["spec"]["groups"] == source["groups"]
        assert found[name]["metadata"]["namespace"] == "dra-gpu-exporter"
        assert found[name]["metadata"]["labels"].get("release") == TOGGLES[toggle].get("prometheusRule", {}).get("labels", {}).get("release")
    # the agent's own rules stay in their own object, whatever the generation
    main = [d for d in docs if d["kind"] == "PrometheusRule" and d["metadata"]["name"] == "dra-gpu-exporter"]
    assert len(main) == int(TOGGLES[toggle].get("prometheusRule", {}).get("enabled", False))
    assert all("dcgm" not in g["name"] for d in main for g in d["spec"]["groups"])


def test_dcgm_compat_refuses_the_same_rules_twice() -> None:
    # Before dcgmCompat, the docs had users add dcgm-compat.rules.yml to prometheusRule.files.
    old_way = {"prometheusRule": {"enabled": True, "files": ["dra-gpu-exporter.rules.yml", "dcgm-compat.rules.yml"]}}
    assert "dra-gpu-exporter.dcgm-compat" in [g["name"] for g in _one(render_docs(old_way), "PrometheusRule")["spec"]["groups"]]
    with pytest.raises(helm_python.HelmError, match="record the same series twice"):
        render({**old_way, "dcgmCompat": {"generation": "4.9"}})


def test_network_policy_is_off_by_default() -> None:
    assert not [d for d in render_docs() if d["kind"] == "NetworkPolicy"]
    assert not [d for d in render_docs({"serviceMonitor": {"enabled": True}}) if d["kind"] == "NetworkPolicy"]


def test_network_policy_admits_scrapes_and_opens_the_api_server_and_dns() -> None:
    policy = _one(render_docs(TOGGLES["network-policy"]), "NetworkPolicy")
    daemonset = _one(render_docs(TOGGLES["network-policy"]), "DaemonSet")
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    # no selector set: the metrics port from anywhere, nothing else
    assert spec["ingress"] == [{"ports": [{"port": 9402, "protocol": "TCP"}]}]
    api, dns = spec["egress"]
    assert api == {"ports": [{"port": 6443, "protocol": "TCP"}]}  # no CIDR set: the port to any address
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                          "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    assert sorted(p["protocol"] for p in dns["ports"]) == ["TCP", "UDP"] and {p["port"] for p in dns["ports"]} == {53}


def test_network_policy_selectors_cidrs_and_extra_rules() -> None:
    spec = _one(render_docs(TOGGLES["network-policy-selectors"]), "NetworkPolicy")["spec"]
    # kube-rbac-proxy serves the metrics: its port is the one opened; both selectors in ONE peer (AND)
    assert spec["ingress"] == [{
        "ports": [{"port": 9443, "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
    }]
    api, _dns, extra = spec["egress"]
    assert api == {"ports": [{"port": 443, "protocol": "TCP"}],
                   "to": [{"ipBlock": {"cidr": "10.0.0.10/32"}}, {"ipBlock": {"cidr": "fd00::10/128"}}]}
    assert extra == {"to": [{"ipBlock": {"cidr": "10.1.0.0/16"}}], "ports": [{"port": 4317, "protocol": "TCP"}]}
    # one selector alone, DNS off
    values = {"networkPolicy": {"enabled": True, "metrics": {"podSelector": {"matchLabels": {"app": "vmagent"}}},
                                "dns": {"enabled": False}}}
    spec = _one(render_docs(values), "NetworkPolicy")["spec"]
    assert spec["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"app": "vmagent"}}}]
    assert [r["ports"][0]["port"] for r in spec["egress"]] == [6443]


def test_dashboards_are_configmaps_for_the_grafana_sidecar() -> None:
    maps = [d for d in render_docs(TOGGLES["dashboards"]) if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    sources = sorted((REPO / "dashboards").glob("*.json"))
    assert len(maps) == len(sources) >= 3
    for cm, src in zip(sorted(maps, key=lambda d: d["metadata"]["name"]), sources, strict=True):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "monitoring"
        assert json.loads(cm["data"][src.name]) == json.loads(src.read_text())


def test_scrape_objects_keep_device_series_clean_and_the_job_label() -> None:
    docs = render_docs({**TOGGLES["service-monitor"], **TOGGLES["pod-monitor"]})
    for kind, key in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        spec = _one(docs, kind)["spec"]
        # job = the objects' app.kubernetes.io/name label = "dra-gpu-exporter", what the
        # exporter-down alerts select, whatever the release is called.
        assert spec["jobLabel"] == "app.kubernetes.io/name"
        (endpoint,) = spec[key]
        assert endpoint["honorLabels"] is True
        drop = [r for r in endpoint["relabelings"] if r["action"] == "labeldrop"]
        assert drop and {"pod", "namespace", "container"} <= set(drop[0]["regex"].split("|"))
    _pod, _ = _agent(docs)
    ds = _one(docs, "DaemonSet")
    assert ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "dra-gpu-exporter"


def test_kube_rbac_proxy_fronts_the_agent() -> None:
    docs = render_docs(TOGGLES["kube-rbac-proxy"])
    pod, agent = _agent(docs)
    assert agent["args"][agent["args"].index("--listen") + 1] == "127.0.0.1:9402"
    assert "ports" not in agent
    proxy = pod["containers"][1]
    assert proxy["name"] == "kube-rbac-proxy" and "--upstream=http://127.0.0.1:9402/" in proxy["args"]
    assert "--tls-cert-file=/etc/kube-rbac-proxy/tls/tls.crt" in proxy["args"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert agent[probe]["httpGet"]["port"] == "https" and agent[probe]["httpGet"]["scheme"] == "HTTPS"
    assert _one(docs, "Service")["spec"]["ports"][0]["targetPort"] == "https"
    assert _one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["scheme"] == "https"
    assert _one(docs, "ClusterRole", "dra-gpu-exporter-metrics-reader")["rules"] == [
        {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}
    ]


def test_web_config_comes_from_a_secret() -> None:
    docs = render_docs(TOGGLES["web-config"])
    pod, agent = _agent(docs)
    args = agent["args"]
    path = args[args.index("--web-config-file") + 1]
    (mount,) = [m for m in agent["volumeMounts"] if m["name"] == "web-config"]
    assert path.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == "web-config"]
    assert volume["secret"]["secretName"] == "dra-gpu-exporter-web"
    assert agent["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert _one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["scheme"] == "https"


def test_amd_device_access() -> None:
    docs = render_docs(TOGGLES["amd"])
    pod, agent = _agent(docs)
    assert "runtimeClassName" not in pod
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert "NVIDIA_VISIBLE_DEVICES" not in env and env["ROCM_PATH"] == "/opt/rocm"
    (claim,) = pod["resourceClaims"]
    assert agent["resources"]["claims"] == [{"name": claim["name"]}]
    template = _one(docs, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    exactly = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["deviceClassName"] == "gpu.amd.com" and exactly["adminAccess"] is True
    assert {"operator": "Exists"} in exactly["tolerations"]
    labels = _one(docs, "Namespace")["metadata"]["labels"]
    assert labels["resource.kubernetes.io/admin-access"] == "true"


def test_per_process_turns_on_host_pid_and_the_pod_list() -> None:
    docs = render_docs(TOGGLES["per-process"])
    pod, agent = _agent(docs)
    assert pod["hostPID"] is True
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["DRA_GPU_EXPORTER_PER_PROCESS"] == "true"
    assert env["DRA_GPU_EXPORTER_POD_LABEL_ALLOWLIST"] == "app.kubernetes.io/name,team"
    assert _agent(render_docs())[0]["hostPID"] is False


def test_another_release_name_keeps_names_consistent() -> None:
    docs = render_docs({}, release="gpu-mon", namespace="monitoring")
    sa = _one(docs, "ServiceAccount")["metadata"]
    assert sa["name"] == "gpu-mon-dra-gpu-exporter"
    user = f"system:serviceaccount:monitoring:{sa['name']}"
    for policy in (d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"):
        assert user in policy["spec"]["matchConditions"][0]["expression"]
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": "monitoring"}]
    pod, _ = _agent(docs)
    assert pod["serviceAccountName"] == sa["name"]
    # The budget's name is the agent's constant, not the release's.
    assert _one(docs, "ConfigMap", "dra-gpu-exporter-budget")["metadata"]["namespace"] == "monitoring"


# --- the documented rollout: kubectl set env ----------------------------------------------------


def kubectl_set_env(daemonset: dict[str, Any], assignment: str) -> dict[str, Any]:
    """What `kubectl set env ds/<name> NAME=VALUE` does to the object: in every container, the
    variable's entry is replaced by a plain value (or appended when absent)."""
    name, _, value = assignment.partition("=")
    out = copy.deepcopy(daemonset)
    for c in out["spec"]["template"]["spec"]["containers"]:
        env = c.setdefault("env", [])
        for i, e in enumerate(env):
            if e["name"] == name:
                env[i] = {"name": name, "value": value}
                break
        else:
            env.append({"name": name, "value": value})
    return out


def resolved_mode(daemonset: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> config.TaintMode:
    """The taint mode the agent resolves in this DaemonSet's container (its args and env)."""
    agent = daemonset["spec"]["template"]["spec"]["containers"][0]
    with monkeypatch.context() as m:
        for var in [v for v in __import__("os").environ if v.startswith(config.ENV_PREFIX)]:
            m.delenv(var)
        for e in agent.get("env", []):
            if "value" in e:
                m.setenv(e["name"], e["value"])
        m.setenv("NODE_NAME", "gpu-node-1")  # the downward API
        ns: argparse.Namespace = config.build_parser().parse_args(agent.get("args", []))
        return config.resolve(ns).taint_mode


def _daemonset_from_manifest() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    return _one(docs, "DaemonSet")


def test_documented_rollout_commands_change_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = _daemonset_from_manifest()
    assert resolved_mode(ds, monkeypatch) == config.TaintMode.ENFORCE  # the default, as before
    deploy_doc = (REPO / "docs" / "deploy.md").read_text()
    seen = []
    for mode in ("dry-run", "shadow", "enforce"):
        command = f"kubectl -n dra-gpu-exporter set env ds/dra-gpu-exporter DRA_GPU_EXPORTER_TAINT_MODE={mode}"
        assert command in deploy_doc, f"docs/deploy.md no longer documents: {command}"
        ds = kubectl_set_env(ds, f"DRA_GPU_EXPORTER_TAINT_MODE={mode}")
        seen.append(resolved_mode(ds, monkeypatch).value)
    assert seen == ["dry-run", "shadow", "enforce"]


def test_a_taint_mode_flag_would_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Why the manifest must not pass --taint-mode (issue 15): the flag silently wins.
    ds = _daemonset_from_manifest()
    ds["spec"]["template"]["spec"]["containers"][0]["args"] += ["--taint-mode", "enforce"]
    ds = kubectl_set_env(ds, "DRA_GPU_EXPORTER_TAINT_MODE=shadow")
    assert resolved_mode(ds, monkeypatch) == config.TaintMode.ENFORCE


def test_the_chart_value_sets_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = _one(render_docs(TOGGLES["taint-mode"]), "DaemonSet")
    assert resolved_mode(ds, monkeypatch) == config.TaintMode.SHADOW
