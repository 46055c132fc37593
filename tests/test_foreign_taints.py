"""Foreign taints are not health (issue 24, Deliver 4).

AMD's DRA driver (ROCm/k8s-gpu-dra-driver v1.x, AutoPartition) puts NoExecute taints
``gpu.amd.com/memory-partition-conflict`` on its virtual partition devices to steer scheduling
once a memory mode is in use (tests/fakes/amd_autopartition_slices.py, from the driver's source).
NVIDIA's DRA driver taints devices in its slice on XIDs (``gpu.nvidia.com/xid``, NoSchedule or
None), lost GPUs and unmonitored devices; those taints are sticky (only a restart of its kubelet
plugin clears them), so a healthy GPU can carry one for days.
Other parties write DeviceTaintRules of their own. None of that is this agent's business: the
whole agent (production wiring, amdsmi's real Python layer over the fake library, the kubelet's
real gRPC server, the HTTP API emulation with the strict schema check) runs in enforce mode on a
node whose slices carry those taints, with two foreign DeviceTaintRules on its devices and pods
on the tainted devices, and must show no health change, take no budget slot, adopt, change or
delete no rule, count no pod as pending eviction and write nothing at all. Every taint shows in
``dra_device_taint_info`` once, with its source, beside this agent's own rules.
"""

from __future__ import annotations

import copy

import pytest
from fakes import fake_amdsmi as fake
from fakes.amd_autopartition_slices import TAINT_KEY, autopartition_slices
from fakes.fake_amdsmi import FakeAmdGpu, FakeAmdSmiNode, mi300x_cpx_amdsmi_7_0
from k8s_helpers import running_apiserver, wait_until, write_kubeconfig
from kit_helpers import fetch, scrape_samples
from prometheus_client.parser import text_string_to_metric_families
from validation import StrictValidator

from drasim import kubelet as kb
from drasim import objects
from drasim.kubelet import FakeKubelet
from exporter.config import Config, TaintMode
from exporter.devices.amd import AmdSmiBackend
from exporter.wiring import build_agent

NODE = "mi300x-node"
AMD = "gpu.amd.com"
GiB = 1024**3


def foreign_rules() -> list[dict]:
    return [
        # a maintenance operator's rule on a device that resolves to a local GPU (GPU 1, in SPX);
        # it even carries this agent's node label, but not its managed-by label
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
         "metadata": {"name": f"maintenance-{NODE}-gpu-1", "labels": {"app.kubernetes.io/managed-by": "gpu-maintenance-operator",
                                                                       "dra-gpu-exporter.io/node": NODE}},
         "spec": {"deviceSelector": {"driver": AMD, "pool": NODE, "device": "gpu-1-spx-nps1"},
                  "taint": {"key": "example.com/maintenance", "value": "firmware", "effect": "NoExecute"}}},
        # someone's rule with the AMD driver's own key, unlabelled
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
         "metadata": {"name": f"{NODE}-memory-mode-lock"},
         "spec": {"deviceSelector": {"driver": AMD, "pool": NODE, "device": "gpu-0-cpx-nps4"},
                  "taint": {"key": TAINT_KEY, "value": "nps1", "effect": "NoExecute"}}},
    ]


@pytest.fixture(scope="module")
def amdsmi_module():
    return fake.import_amdsmi()


@pytest.fixture
def amd_node(amdsmi_module):
    # GPU 0 in CPX + NPS1 as amdsmi 7.0.x reports it (the allocation that locked the memory mode
    # to nps1), GPU 1 a full GPU in SPX
    gpus = [*mi300x_cpx_amdsmi_7_0("5a1b7e3c-0000-1000-8000-0c42a1b2c3d4", "0000:05:00.0", card=1, render=128),
            FakeAmdGpu(uuid="9d2c4f6a-0000-1000-8000-0c42a1b2c3e5", bdf="0000:83:00.0", card=9, render=136, vram_total=192 * GiB)]
    fake.FAKE_LIB.node = FakeAmdSmiNode(gpus)
    yield gpus
    fake.detach_node()


def test_the_amd_drivers_taints_and_foreign_rules_are_no_health_no_budget_and_not_ours(amd_node, tmp_path):
    physical = [amd_node[0], amd_node[-1]]  # partition 0 stands for GPU 0 in the driver's numbering
    slices = autopartition_slices(NODE, physical, active_memory="nps1")
    tainted = {d["name"] for d in slices[1]["spec"]["devices"] if d.get("taints")}
    assert tainted == {"gpu-0-dpx-nps2", "gpu-0-cpx-nps4", "gpu-1-dpx-nps2", "gpu-1-cpx-nps4"}
    kubelet = FakeKubelet(str(tmp_path / "kubelet.sock"))
    # a pod on the partition that locked the mode, one on a device the AMD driver tainted (nothing
    # evicts it here), one on the device a foreign rule taints NoExecute
    kubelet.set_pods([
        kb.pod("ml", name, [kb.container("main", claims=[kb.claim("ml", f"{name}-gpu", [(AMD, NODE, device, None)])])])
        for name, device in (("cpx-job", "gpu-0-cpx-nps1"), ("conflicted", "gpu-0-cpx-nps4"), ("maintained", "gpu-1-spx-nps1"))
    ])
    kubelet.start()
    try:
        with running_apiserver("1.37", bookmark_interval=0.2) as api:
            validator = StrictValidator("1.37")
            api.set_validator(validator)
            for obj in objects.agent_namespace_objects():
                api.apply(obj)
            api.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}})
            for obj in [*slices, *foreign_rules()]:
                api.apply(obj)
            before = {r["metadata"]["name"]: copy.deepcopy(r) for r in api.list("resource.k8s.io", "devicetaintrules")}
            budget_before = api.get("", "configmaps", "dra-gpu-exporter-budget", "dra-gpu-exporter")
            api.clear_requests()
            cfg = Config(listen_host="127.0.0.1", listen_port=0, node_name=NODE, kubelet_socket=kubelet.socket_path,
                         kubeconfig=str(write_kubeconfig(tmp_path / "kubeconfig", api.url)), backend="amdsmi", interval=0.2,
                         call_timeout=2.0, taint_mode=TaintMode.ENFORCE)
            agent = build_agent(cfg, backend=AmdSmiBackend(), remediation_resync=0.2)
            agent.start(serve=True)
            try:
                rem = agent.out.remediation
                assert rem is not None
                wait_until(lambda: agent.src.get("slices").watcher.synced and rem.passes >= 1 and agent.cycles >= 3, timeout=60, message="the agent settled")
                for _ in range(3):  # passes on purpose: a quiet node's remediator does not run one per cycle
                    n = rem.passes
                    rem.poke()
                    wait_until(lambda n=n: rem.passes > n, timeout=30, message="a remediation pass")
                agent.run_cycle()
                status, body = fetch(agent.server.url + "/metrics")
                assert status == 200
                samples = [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]
                report, health = rem.report(), agent.health.all_health()
            finally:
                agent.stop()
            # no health change: every GPU and partition healthy, no condition at all
            assert agent.snapshot is not None and len(agent.snapshot.devices) == 9
            assert [h for h in health.values() if h.conditions] == []
            assert {s.value for s in samples if s.name == "gpu_healthy"} == {1.0}
            assert [s for s in samples if s.name == "gpu_health_condition"] == []
            # the devices are known, and so is who holds them (the resolved ones at least)
            rows = {s.labels["pod"]: s.labels for s in samples if s.name == "dra_device_allocation_info"}
            assert set(rows) == {"cpx-job", "conflicted", "maintained"} and rows["maintained"]["uuid"] == amd_node[-1].uuid
            # nothing adopted, nothing counted, nothing pending, no budget slot
            assert report.rules == () and report.pending_eviction == () and dict(report.actions) == {} and dict(report.suppressed) == {}
            assert [s for s in samples if s.name in ("dra_device_taint_rule", "dra_taint_pods_pending_eviction")] == []
            # every taint the driver published shows once, with the driver as its source (the foreign
            # rules are not read: the agent watches only its own); none is this agent's
            shown = sorted((s.labels["device"], s.labels["key"], s.labels["value"], s.labels["effect"], s.labels["source"])
                           for s in samples if s.name == "dra_device_taint_info")
            assert shown == sorted((d, TAINT_KEY, "nps1", "NoExecute", AMD) for d in tainted)
            # both GPUs published (GPU 0 through its partition devices)
            assert [(s.labels["driver"], s.value) for s in samples if s.name == "dra_unpublished_devices"] == [(AMD, 0)]
            assert not rem.rails.raised and not rem.record.noexecute_domains()
            assert api.get("", "configmaps", "dra-gpu-exporter-budget", "dra-gpu-exporter")["data"] == budget_before["data"]
            # the foreign rules untouched (same object, same resourceVersion), none deleted, none added
            after = {r["metadata"]["name"]: r for r in api.list("resource.k8s.io", "devicetaintrules")}
            assert after == before
            # and the agent wrote nothing at all: no rule, no budget, no Event
            writes = [f"{q.method} {q.path}" for q in api.requests if q.method in ("POST", "PUT", "PATCH", "DELETE")]
            assert writes == []
            assert not [q for q in api.requests if "/configmaps" in q.path and "dra-gpu-exporter-budget" in q.path + str(q.query)]
            assert validator.failures == []
    finally:
        kubelet.stop()


def test_the_record_of_owned_rules_never_adopts_a_rule_without_the_agents_label():
    """Belt and braces behind the label-selected feeds: a foreign rule handed to the record (a
    feed misconfigured, a selector dropped) is not adopted; the agent's own is."""
    from exporter.k8s.taintrules import TaintRule
    from exporter.remediation.record import OwnedRules

    record = OwnedRules()
    theirs = TaintRule(name=f"maintenance-{NODE}-gpu-1", uid="u1", driver=AMD, pool=NODE, device="gpu-1-spx-nps1", effect="NoExecute", ours=False)
    mine = TaintRule(name=f"dra-gpu-exporter-{NODE}-gpu-1-0-abc", uid="u2", driver=AMD, pool=NODE, device="gpu-1-0", effect="NoSchedule", ours=True,
                      tier="degraded")
    sync = record.sync([theirs, mine], lags=False, now=0.0)
    assert [r.name for r in sync.adopted] == [mine.name] and [r.name for r in record.values()] == [mine.name]


NVIDIA_TAINTED = """
name: nvidia-driver-taints
node: nv-node
gpus:
  - {name: gpu0, taints: [{key: gpu.nvidia.com/xid, value: "79", effect: NoSchedule}]}
  - {name: gpu1, taints: [{key: gpu.nvidia.com/gpu-lost, effect: NoSchedule}, {key: gpu.nvidia.com/xid, value: "48", effect: NoSchedule}]}
  - {name: gpu2, taints: [{key: gpu.nvidia.com/unmonitored, effect: None}]}
  - {name: gpu3, taints: [{key: gpu.nvidia.com/xid, value: "43", effect: None}]}
  - {name: gpu4, mig: [{profile: 3g.40gb, placement_start: 0}, {profile: 3g.40gb, placement_start: 4}],
     taints: [{key: gpu.nvidia.com/xid, value: "31", effect: None}]}
  - {name: gpu5}
claims:
  - {namespace: ml, name: train, devices: [gpu0]}
pods:
  - {namespace: ml, name: trainer, containers: [{name: main, claims: [train]}]}
faults:
  - {kind: xid, gpu: gpu3, at: 2s, code: 79}
"""


def test_nvidia_driver_taints_show_by_source_beside_ours_and_are_no_health_no_budget(tmp_path):
    """NVIDIA's slice taints in its own format on healthy GPUs: shown once each with the driver
    as source, never health, never a rule, never a budget slot, never written; the one GPU our
    evidence finds failing (an XID 79 from the device) gets our rule, shown beside its driver's
    taint with our source."""
    import yaml

    from drasim.backend import SimClock
    from drasim.node import SimulatedNode
    from drasim.scenario import parse_scenario

    sc = parse_scenario(yaml.safe_load(NVIDIA_TAINTED))
    nv = "gpu.nvidia.com"
    with SimulatedNode(sc, SimClock(1.0)) as node:
        node.start()
        slices_before = copy.deepcopy(node.api.list("resource.k8s.io", "resourceslices"))
        agent = node.start_agent(interval=0.2, taint_mode=TaintMode.ENFORCE, remediation_resync=0.2)
        assert agent.server is not None and agent.out.remediation is not None
        rem = agent.out.remediation

        def taints() -> list[tuple[str, ...]]:
            return sorted((lb["device"], lb["uuid"], lb["key"], lb["value"], lb["effect"], lb["source"])
                          for lb, _ in scrape_samples(agent.server.url).get("dra_device_taint_info", []))

        def ours() -> list[tuple[str, ...]] | None:
            mine = [t for t in taints() if t[5] == "dra-gpu-exporter"]
            return mine or None

        mine = wait_until(ours, 60, message="our rule on gpu-3")
        samples = scrape_samples(agent.server.url)
        report = rem.report()
        slices_after = node.api.list("resource.k8s.io", "resourceslices")
    g = {x.name: x for x in sc.gpus}
    migs = [g["gpu4"].mig_device_name(m) for m in g["gpu4"].mig]
    mig_uuids = [m.uuid for m in g["gpu4"].mig]
    driver_rows = sorted([
        ("gpu-0", g["gpu0"].uuid, f"{nv}/xid", "79", "NoSchedule", nv),
        ("gpu-1", g["gpu1"].uuid, f"{nv}/gpu-lost", "", "NoSchedule", nv),
        ("gpu-1", g["gpu1"].uuid, f"{nv}/xid", "48", "NoSchedule", nv),
        ("gpu-2", g["gpu2"].uuid, f"{nv}/unmonitored", "", "None", nv),
        ("gpu-3", g["gpu3"].uuid, f"{nv}/xid", "43", "None", nv),
        *((d, u, f"{nv}/xid", "31", "None", nv) for d, u in zip(migs, mig_uuids, strict=True)),
    ])
    shown = sorted((lb["device"], lb["uuid"], lb["key"], lb["value"], lb["effect"], lb["source"]) for lb, _ in samples["dra_device_taint_info"])
    assert [t for t in shown if t[5] == nv] == driver_rows  # each once, with its source
    # ours: on gpu-3 only (the device our evidence found failing), under our key
    assert {t[0] for t in mine} == {"gpu-3"} and all(t[2].startswith("gpu-health.dra-gpu-exporter.io/") for t in mine)
    # (the effect may move from NoSchedule to NoExecute between the scrape and the report)
    assert [r.device for r in report.rules] == ["gpu-3"] and {t[4] for t in mine} <= {"NoSchedule", "NoExecute"}
    # the driver-tainted GPUs stay healthy to us and get no rule, no budget slot
    healthy = {lb["uuid"]: v for lb, v in samples["gpu_healthy"]}
    assert all(healthy[x.uuid] == 1.0 for x in sc.gpus if x.name != "gpu3") and healthy[g["gpu3"].uuid] == 0.0
    assert rem.rails.raised <= {g["gpu3"].uuid}
    # never removed (nor touched) by us: the slices are as the driver left them
    assert [sl["spec"] for sl in slices_after] == [sl["spec"] for sl in slices_before]
