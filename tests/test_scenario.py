"""Scenario files: the bundled ones load and mean what they say; errors name the place."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from drasim import objects
from drasim.scenario import (
    Curve,
    ScenarioError,
    bundled_scenarios,
    default_scenario,
    load_scenario,
    parse_bytes,
    parse_duration,
    parse_scenario,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "scenarios.md"


# ------------------------------------------------------------------ bundled scenarios


def test_every_bundled_scenario_loads():
    found = bundled_scenarios()
    assert {"mixed-node", "small-node", "mig-8gpu", "failure-storm"} <= set(found)
    for name, path in found.items():
        sc = load_scenario(path)
        assert sc.name == name, f"{path}: name should match the file name"
        assert sc.description
        # every claim is used by some pod (a bundled scenario has no dead entries), and every
        # reference resolves to a DRA device name
        used = {(p.namespace, cn) for p in sc.pods for c in p.containers for cn in c.claims}
        assert {(c.namespace, c.name) for c in sc.claims} <= used, name
        for c in sc.claims:
            for ref in c.devices:
                assert objects.device_name(sc, ref).startswith("gpu-")
        # the cluster view builds without error
        assert objects.resource_slice(sc)["spec"]["devices"]
        assert len(objects.kubelet_pods(sc, list(sc.pods))) == len(sc.pods)


def test_default_scenario_is_mixed_node():
    assert default_scenario().name == "mixed-node"


def test_small_node_shape():
    sc = load_scenario(bundled_scenarios()["small-node"])
    assert len(sc.gpus) == 2 and len(sc.pods) == 2
    assert not any(g.mig for g in sc.gpus)


def test_mig_8gpu_shape():
    sc = load_scenario(bundled_scenarios()["mig-8gpu"])
    assert len(sc.gpus) == 8
    mig_gpus = [g for g in sc.gpus if g.mig]
    assert len(mig_gpus) == 4
    for g in mig_gpus:
        assert [m.profile for m in g.mig] == ["1g.10gb"] * 7
        assert sorted(m.placement_start for m in g.mig) == list(range(7))
    # "pods on most": more than half of the schedulable devices are held
    refs = {ref for c in sc.claims for ref in c.devices}
    refs |= {ref for p in sc.pods for ct in p.containers for _, ref in ct.device_plugin}
    schedulable = sum(len(g.mig) or 1 for g in sc.gpus)
    assert schedulable == 32
    assert len(refs) > schedulable / 2
    assert len(refs) < schedulable  # and some are free, so unallocated devices show too
    # MIG device names follow the NVIDIA DRA driver's v25.12+ scheme
    assert objects.device_name(sc, "gpu3:1g.10gb:6") == "gpu-3-mig-1g10gb-19-6"


def test_failure_storm_is_a_node_fault():
    from exporter.health.model import Tier
    from exporter.health.xid import classify_xid

    sc = load_scenario(bundled_scenarios()["failure-storm"])
    assert len(sc.gpus) == 8
    fatal = {f.gpu for f in sc.faults if f.kind == "xid" and classify_xid(f.code) == Tier.FATAL and f.at <= 30}
    assert len(fatal) == 5
    # enough for the node-wide-fault rule at the default node_failure_fraction
    from exporter.config import Config

    assert len(fatal) >= max(2, math.ceil(Config().node_failure_fraction * len(sc.gpus)))


def test_docs_example_parses_and_covers_every_fault_kind():
    text = DOCS.read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    full = [b for b in blocks if b.startswith("name:")]
    assert full, "docs/scenarios.md should carry a complete example"
    sc = parse_scenario(yaml.safe_load(full[0]), "example")
    assert sc.name == "two-tenants"
    from drasim.scenario import FAULT_KINDS

    for kind in FAULT_KINDS:
        assert f"| `{kind}` |" in text, f"fault kind {kind} is not documented"


def test_docs_name_every_key_the_parser_reads():
    src = (Path(__file__).resolve().parent.parent / "drasim" / "scenario.py").read_text()
    keys = set(re.findall(r'\.(?:get|req|str|num|int|bool|list)\("([a-z_]+)"', src))
    assert len(keys) > 30  # the pattern still finds the parser's reads
    doc = DOCS.read_text()
    assert sorted(k for k in keys if f"`{k}`" not in doc) == []


# ------------------------------------------------------------------ values


@pytest.mark.parametrize(
    "text,want",
    [(1024, 1024), ("80Gi", 80 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1.5k", 1500), ("10", 10), ("2ti", 2 * 2**40)],
)
def test_sizes(text, want):
    assert parse_bytes(text, "x") == want


@pytest.mark.parametrize("text", ["lots", "80 Gb!", "-1", -5, True, "1e9", float("nan")])
def test_bad_sizes(text):
    with pytest.raises(ScenarioError, match=r"^where:"):
        parse_bytes(text, "where")


@pytest.mark.parametrize("text,want", [(90, 90.0), ("90s", 90.0), ("5m", 300.0), ("1.5h", 5400.0), ("250ms", 0.25), ("7", 7.0)])
def test_durations(text, want):
    assert parse_duration(text, "x") == want


@pytest.mark.parametrize("text", ["1m30s", "-5s", -1, "soon", False, float("nan"), float("inf")])
def test_bad_durations(text):
    with pytest.raises(ScenarioError, match=r"^when:"):
        parse_duration(text, "when")


def test_curves():
    assert Curve(base=0.4).at(123) == 0.4
    s = Curve("sine", base=0.5, amplitude=0.5, period=4)
    assert s.at(0) == pytest.approx(0.5) and s.at(1) == pytest.approx(1.0) and s.at(3) == pytest.approx(0.0)
    sq = Curve("square", base=0.5, amplitude=0.25, period=10)
    assert sq.at(1) == 0.75 and sq.at(6) == 0.25
    saw = Curve("sawtooth", base=0.5, amplitude=0.5, period=10)
    assert saw.at(0) == 0.0 and saw.at(5) == pytest.approx(0.5)
    ramp = Curve("ramp", base=0.0, amplitude=1.0, period=10)
    assert ramp.at(5) == 0.5 and ramp.at(50) == 1.0
    assert Curve(base=3.0).at(0) == 1.0 and Curve(base=-1.0).at(0) == 0.0  # clamped
    assert Curve("sine", base=0.5, amplitude=0.5, period=4, phase=1).at(0) == pytest.approx(1.0)


def test_defaults_and_stable_identities():
    a = parse_scenario({"gpus": [{}, {"mig": [{"profile": "1g.10gb"}, {"profile": "1g.10gb"}]}]}, "s.yaml")
    b = parse_scenario({"gpus": [{}, {"mig": [{"profile": "1g.10gb"}, {"profile": "1g.10gb"}]}]}, "s.yaml")
    assert a.name == "s" and a.node == "demo-node"
    g0, g1 = a.gpus
    assert (g0.name, g0.minor, g0.memory_bytes, g0.pci_bus_id) == ("gpu0", 0, 80 * 2**30, "0000:18:00.0")
    assert g1.pci_bus_id == "0000:19:00.0"
    assert g0.uuid.startswith("GPU-") and g0.uuid == b.gpus[0].uuid  # stable across loads
    assert [m.placement_start for m in g1.mig] == [0, 1]
    assert [m.gi_profile_id for m in g1.mig] == [19, 19]
    assert g1.mig[0].memory_bytes == 10 * 2**30 and g1.mig[0].uuid.startswith("MIG-")
    assert g1.mig_device_name(g1.mig[1]) == "gpu-1-mig-1g10gb-19-1"
    # another node gives other UUIDs (two demo nodes must not collide)
    c = parse_scenario({"node": "other", "gpus": [{}]}, "s")
    assert c.gpus[0].uuid != g0.uuid


def test_pci_bus_id_is_normalised():
    sc = parse_scenario({"gpus": [{"pci_bus_id": "00000000:3B:00.0"}]}, "s")
    assert sc.gpus[0].pci_bus_id == "0000:3b:00.0"


def test_json_scenarios(tmp_path):
    p = tmp_path / "n.json"
    p.write_text(json.dumps({"gpus": [{"name": "a"}], "claims": [{"name": "c", "devices": ["a"]}]}))
    sc = load_scenario(p)
    assert sc.name == "n" and sc.claims[0].devices == ("a",)


def test_faults_are_sorted_by_time():
    sc = parse_scenario(
        {"gpus": [{}], "faults": [{"kind": "reset", "gpu": "gpu0", "at": "2m"}, {"kind": "xid", "gpu": "gpu0", "at": 5, "code": 13}]}, "s"
    )
    assert [f.kind for f in sc.faults] == ["xid", "reset"]


# ------------------------------------------------------------------ strict errors that name the place

BASE = {"gpus": [{"name": "a"}, {"name": "m", "mig": [{"profile": "3g.40gb", "placement_start": 0}]}]}


def with_(**parts) -> dict:
    d = json.loads(json.dumps(BASE))
    d.update(parts)
    return d


@pytest.mark.parametrize(
    "data,where",
    [
        ([], r"^src: expected a mapping"),
        ({}, r"^src\.gpus: at least one GPU"),
        ({"gpus": [{}], "colour": "red"}, r"^src: unknown key\(s\) colour"),
        ({"gpus": [{"memry": "1Gi"}]}, r"^gpus\[0\]: unknown key\(s\) memry"),
        ({"gpus": [{"memory": "lots"}]}, r"^gpus\[0\]\.memory: expected a size"),
        ({"gpus": [{"uuid": "1234"}]}, r"^gpus\[0\]\.uuid: expected GPU-"),
        ({"gpus": [{"pci_bus_id": "slot 3"}]}, r"^gpus\[0\]\.pci_bus_id"),
        ({"gpus": [{"minor": 1.5}]}, r"^gpus\[0\]\.minor: expected a whole number"),
        ({"gpus": [{"minor": -1}]}, r"^gpus\[0\]\.minor"),
        ({"gpus": [{"name": "x"}, {"name": "x"}]}, r"^src\.gpus: duplicate name 'x'"),
        ({"gpus": [{"minor": 1}, {"minor": 1}]}, r"^src\.gpus: duplicate minor"),
        ({"gpus": [{"utilization": {"pattern": "zigzag"}}]}, r"^gpus\[0\]\.utilization\.pattern"),
        ({"gpus": [{"utilization": {"base": "high"}}]}, r"^gpus\[0\]\.utilization\.base: expected a number"),
        ({"gpus": [{"utilization": {"period": "1m30s"}}]}, r"^gpus\[0\]\.utilization\.period"),
        ({"gpus": [{"mig": [{}]}]}, r"^gpus\[0\]\.mig\[0\]\.profile: required"),
        ({"gpus": [{"mig": [{"profile": "5g.60gb"}]}]}, r"^gpus\[0\]\.mig\[0\]\.gi_profile_id: required for profile '5g.60gb'"),
        ({"gpus": [{"mig": [{"profile": "1g.10gb", "placement_start": 1}, {"profile": "1g.10gb", "placement_start": 1}]}]}, r"^gpus\[0\]\.mig: two instances share"),
        ({"gpus": [{"mig": [{"profile": "1g.10gb", "uuid": "GPU-1234abcd"}]}]}, r"^gpus\[0\]\.mig\[0\]\.uuid: expected MIG-"),
        ({"gpus": [{"mig": [{"profile": "1g.10gb", "placement_start": "zero"}]}]}, r"^gpus\[0\]\.mig\[0\]\.placement_start"),
        ({"node": "Bad_Node", "gpus": [{}]}, r"^src\.node: 'Bad_Node'"),
        (with_(claims=[{"name": "c", "devices": ["zz"]}]), r"^claims\[0\]\.devices\[0\]: unknown GPU 'zz' \(known: a, m\)"),
        (with_(claims=[{"name": "c", "devices": ["m"]}]), r"^claims\[0\]\.devices\[0\]: GPU 'm' is in MIG mode"),
        (with_(claims=[{"name": "c", "devices": ["m:3g.40gb:4"]}]), r"^claims\[0\]\.devices\[0\]: no MIG instance 'm:3g.40gb:4'"),
        (with_(claims=[{"name": "c", "devices": ["a:1g.10gb:0"]}]), r"^claims\[0\]\.devices\[0\]: no MIG instance"),
        (with_(claims=[{"name": "c", "devices": []}]), r"^claims\[0\]\.devices: at least one"),
        (with_(claims=[{"devices": ["a"]}]), r"^claims\[0\]\.name: required"),
        (with_(claims=[{"name": "c", "devices": ["a"]}, {"name": "c", "devices": ["a"]}]), r"^src\.claims: duplicate claim"),
        (with_(pods=[{"name": "p", "containers": []}]), r"^pods\[0\]\.containers: at least one container"),
        (with_(pods=[{"name": "p", "containers": [{"name": "c", "claims": ["nope"]}]}]), r"^pods\[0\]\.containers\[0\]\.claims\[0\]: no claim 'nope' in namespace 'default'"),
        (
            with_(claims=[{"namespace": "x", "name": "c", "devices": ["a"]}], pods=[{"name": "p", "containers": [{"name": "c", "claims": ["c"]}]}]),
            r"^pods\[0\]\.containers\[0\]\.claims\[0\]: no claim 'c' in namespace 'default'",
        ),
        (with_(pods=[{"name": "p", "containers": [{"name": "c", "device_plugin": [{"resource": "nvidia.com/gpu"}]}]}]), r"^pods\[0\]\.containers\[0\]\.device_plugin\[0\]\.device: required"),
        (with_(pods=[{"name": "p", "containers": [{"name": "c", "device_plugin": [{"device": "q"}]}]}]), r"^pods\[0\]\.containers\[0\]\.device_plugin\[0\]\.device: unknown GPU 'q'"),
        (with_(pods=[{"name": "p", "containers": [{"name": "c", "restartable_init": "no"}]}]), r"^pods\[0\]\.containers\[0\]\.restartable_init: expected true or false"),
        (with_(pods=[{"name": "p", "containers": [{"name": "c"}, {"name": "c"}]}]), r"^pods\[0\]\.containers: duplicate container name"),
        (with_(pods=[{"name": "p", "labels": ["a"], "containers": [{"name": "c"}]}]), r"^pods\[0\]\.labels: expected a mapping"),
        (with_(pods=[{"name": "p", "start": "5m", "end": "1m", "containers": [{"name": "c"}]}]), r"^pods\[0\]\.end: must be after start"),
        (with_(pods=[{"name": "p", "containers": [{"name": "c"}]}, {"name": "p", "containers": [{"name": "c"}]}]), r"^pods\[1\]\.name: duplicate pod default/p"),
        (with_(pods=[{"name": "p", "containers": [{"name": "c"}], "start": "later"}]), r"^pods\[0\]\.start"),
        (with_(faults=[{"kind": "meltdown", "gpu": "a", "at": 1}]), r"^faults\[0\]\.kind: expected one of xid, lost"),
        (with_(faults=[{"kind": "lost", "gpu": "b", "at": 1}]), r"^faults\[0\]\.gpu: unknown GPU 'b'"),
        (with_(faults=[{"kind": "lost", "gpu": "a"}]), r"^faults\[0\]\.at: required"),
        (with_(faults=[{"kind": "xid", "gpu": "a", "at": 1}]), r"^faults\[0\]\.code: an xid fault needs its XID number"),
        (with_(faults=[{"kind": "lost", "gpu": "a", "at": "2m", "until": "1m"}]), r"^faults\[0\]\.until: must be after at"),
        (with_(faults=[{"kind": "recovery_action", "gpu": "a", "at": 1, "code": 9}]), r"^faults\[0\]\.code: a recovery_action fault needs a value 1\.\.5"),
        (with_(faults=[{"kind": "recovery_action", "gpu": "a", "at": 1}]), r"^faults\[0\]\.code: a recovery_action fault"),
        (with_(faults=[{"kind": "lost", "gpu": "a", "at": 1, "code": 79}]), r"^faults\[0\]\.code: only xid and recovery_action"),
        (with_(faults=[{"kind": "xid", "gpu": "a", "at": 1, "code": 79, "until": 5}]), r"^faults\[0\]\.until: an xid fault is an instant"),
        (with_(faults=[{"kind": "lost", "gpu": "a", "at": 1, "rate_per_minute": 5}]), r"^faults\[0\]\.rate_per_minute: only ecc_uncorrectable"),
        (with_(faults=[{"kind": "ecc_uncorrectable", "gpu": "a", "at": 1, "rate_per_minute": -1}]), r"^faults\[0\]\.rate_per_minute: must not be negative"),
        (with_(faults=[{"kind": "lost", "gpu": "a", "at": 1, "when": 2}]), r"^faults\[0\]: unknown key\(s\) when"),
    ],
)
def test_errors_name_the_place(data, where):
    with pytest.raises(ScenarioError, match=where):
        parse_scenario(data, "src")


def test_load_errors_name_the_file(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("gpus: [\n")
    with pytest.raises(ScenarioError, match=r"bad\.yaml: not valid YAML") as e:
        load_scenario(bad_yaml)
    assert "\n" not in str(e.value)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{gpus: 1}")
    with pytest.raises(ScenarioError, match=r"bad\.json: not valid JSON"):
        load_scenario(bad_json)
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "absent.yaml")
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path)  # a directory
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ScenarioError, match=r"^empty\.yaml: expected a mapping"):
        load_scenario(empty)
    nested = tmp_path / "nested.yaml"
    nested.write_text("gpus:\n  - name: a\n    mig:\n      - profile: 1g.10gb\n        memory: huge\n")
    with pytest.raises(ScenarioError, match=r"^gpus\[0\]\.mig\[0\]\.memory: expected a size like 80Gi or 40GB, got 'huge'$"):
        load_scenario(nested)
