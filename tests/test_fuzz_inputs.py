"""Fuzzing the two remaining kinds of outside input: scenario files and the configuration.

The contract for both: a parser either returns a usable value or raises its module's own
error (ScenarioError, ConfigError; argparse's SystemExit(2) for usage errors) with one line
that names the offending place; never any other exception. A scenario that parses must also
run: the simulated backend enumerates and reads every device at the scenario's interesting
instants with sane readings, and the demo's cluster view builds. A configuration that
resolves must satisfy the documented ranges.

Each bug these tests found is kept as an ``@example``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import ipaddress
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from tree_helpers import tree_paths

from drasim import objects
from drasim.backend import SimBackend, SimClock
from drasim.scenario import Scenario, ScenarioError, bundled_scenarios, load_scenario, parse_scenario
from exporter.cli import main
from exporter.config import ENV_PREFIX, Config, ConfigError, TaintMode, build_parser, kubelet_socket_unusable, parse_listen, resolve
from exporter.devices.model import ReadError, RecoveryAction

DOCS = Path(__file__).resolve().parent.parent / "docs" / "scenarios.md"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A directory for scenario files. Module-scoped: hypothesis refuses function-scoped
    fixtures in @given tests, since one fixture value would serve every example."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as d:
        yield Path(d)


def _one_line(msg: str) -> None:
    # (lengths and prefixes only in the asserts: pytest would print a huge message in full)
    n, lines, head = len(msg), len(msg.splitlines()), msg[:300]
    assert n, "an error needs a message"
    assert lines == 1 and msg.splitlines()[0] == msg, f"not one line: {head!r}"
    assert n < 1000, f"message too long ({n} chars): {head!r}..."


# =============================================================================================
# scenarios: the contract


def _location(*sources: str) -> re.Pattern[str]:
    """An error starts with the place: "<source>", "<source>.key", or a path below the top
    level ("gpus[2].mig[0].profile", "pods[1].labels"). The loader names the file by its path,
    the parser by its name."""
    path = r"(?:\.[A-Za-z_]+|\[\d+\])*"
    src = "|".join(map(re.escape, sources))
    return re.compile(rf"^(?:(?:{src})(?:\.[a-z_]+)?|(?:gpus|claims|pods|faults)\[\d+\]{path}): \S")


class _SteppedClock(SimClock):
    """Simulated time that moves only when the test says so."""

    def __init__(self) -> None:
        super().__init__(scale=1.0)
        self.t = 0.0

    def now(self) -> float:
        return self.t


HORIZON = 1e7  # simulated seconds (~4 months): as far as a demo's clock plausibly gets


def _instants(sc: Scenario) -> list[float]:
    """0 and every time the scenario names (and just after), where something changes."""
    times = {0.0}
    for f in sc.faults:
        times |= {f.at, f.at + 0.5} | ({f.until, f.until + 0.5} if f.until is not None else set())
    for p in sc.pods:
        times |= {p.start} | ({p.end} if p.end is not None else set())
    return sorted(t for t in times if t <= HORIZON)[:16]


_RATIOS = ("utilization_ratio", "sm_active_ratio", "tensor_active_ratio", "dram_active_ratio")
_FLOATS = ("power_watts", "energy_joules", "temperature_celsius", "memory_temperature_celsius", "sm_clock_hertz", "memory_clock_hertz")


def assert_usable(sc: Scenario) -> None:
    """The scenario runs: every device enumerates and reads sanely, and the cluster view builds."""
    clock = _SteppedClock()
    b = SimBackend(sc, clock)
    b.open()
    b.close()  # a scripted hang then returns at once instead of blocking the test
    ids = b.enumerate()
    assert len(ids) == len(sc.gpus) + sum(len(g.mig) for g in sc.gpus)
    assert len({i.uuid for i in ids}) == len(ids)
    assert b.driver_version() == sc.driver_version
    energy: dict[str, float] = {}
    for t in _instants(sc):
        clock.t = t
        for ident in ids:
            r = b.read(ident)
            where = f"{ident.uuid} at t={t}"
            assert r.uuid == ident.uuid
            if not r.ok:
                assert r.error is ReadError.LOST, where  # the only failure a scenario scripts
                continue
            for name in _RATIOS:
                v = getattr(r, name)
                assert v is None or 0.0 <= v <= 1.0 + 1e-9, f"{where}: {name}={v}"
            for name in _FLOATS:
                v = getattr(r, name)
                assert v is None or math.isfinite(v), f"{where}: {name}={v}"
            assert r.memory_total_bytes is not None and 0 <= r.memory_used_bytes <= r.memory_total_bytes, where
            assert r.power_watts is None or r.power_watts >= 0, f"{where}: power {r.power_watts}"
            assert isinstance(r.ecc_uncorrectable_total, int) and r.ecc_uncorrectable_total >= 0, where
            assert r.recovery_action is None or isinstance(r.recovery_action, RecoveryAction)
            if r.energy_joules is not None:  # a counter: never goes back
                assert r.energy_joules >= energy.get(ident.uuid, 0.0), where
                energy[ident.uuid] = r.energy_joules
    # what the demo publishes: Node, ResourceSlice, ResourceClaims, Pods, the kubelet's answer
    pods = list(sc.pods)
    for obj in (objects.node(sc), objects.resource_slice(sc), objects.resource_claims(sc, pods), [objects.pod_object(sc, p) for p in pods]):
        json.dumps(obj, allow_nan=False)
    for msg in objects.kubelet_pods(sc, pods):
        msg.SerializeToString()


def parse_or_error(data: Any, source: str = "src") -> Scenario | ScenarioError:
    """parse_scenario under the contract: a usable Scenario, or a ScenarioError that names
    the place in one line. Anything else propagates and fails the test."""
    try:
        sc = parse_scenario(data, source)
    except ScenarioError as e:
        msg = str(e)
        _one_line(msg)
        assert _location(source).match(msg), f"error does not start with a location: {msg!r}"
        return e
    assert isinstance(sc, Scenario)
    assert_usable(sc)
    return sc


# =============================================================================================
# scenarios (a): any bytes as a file


YAML_TOKENS = [
    "gpus:", "claims:", "pods:", "faults:", "name:", "mig:", "profile:", "memory:", "at:", "until:", "labels:",
    "utilization:", "period:", "phase:", "base:", "code:", "kind: xid", "gpu: gpu0", "devices:", "containers:",
    "\n", "\n  ", "\n  - ", "- ", " ", "[", "]", "{", "}", ",", ":", "&a ", "*a", "!!binary ", "!!set ", "!!float ", "!!int ", "!!bool ", "!!timestamp ", "!!str ", "!!omap ",
    "? ", "<<: ", "~", ".nan", ".inf", "-.inf", "1e400", "1.0e+400", "0x1f", "0o17", "1:30", "2001-12-14", '"\\ud800"',
    "'", '"', "#", "|", ">", "---", "...", "%YAML 1.1\n", "\t", "\x00", "\ufeff", "9" * 400, "1" * 5000, "80Gi", "-1",
    "true", "null", "gpu0", "1g.10gb", '"gpu0:1g.10gb:0"', "{}", "[]",
]
yaml_like = st.lists(st.sampled_from(YAML_TOKENS), max_size=40).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
file_bodies = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300).map(str.encode),
    yaml_like.map(lambda s: s.encode("utf-8", "surrogatepass")),
    json_values.map(lambda v: json.dumps(v).encode()),
)

# A tree the loader builds cheaply but that is exponentially large when printed or stringified.
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcde", "bcdef", strict=True)
)
LAUGHS_FLOW = "{" + LAUGHS.strip().replace("\n", ", ") + "}"  # the same, as one flow mapping


def _write(dir_: Path, body: bytes, suffix: str) -> Path:
    p = dir_ / f"case{suffix}"
    p.write_bytes(body)
    return p


def _load_or_error(p: Path) -> Scenario | ScenarioError:
    try:
        sc = load_scenario(p)
    except ScenarioError as e:
        msg = str(e)
        _one_line(msg)
        assert _location(str(p), p.name).match(msg), f"error does not name the file or a place in it: {msg!r}"
        return e
    # No amplification: YAML aliases let a small file describe a huge tree, and a value turned
    # into a string (pod labels) must not turn that into a huge scenario.
    limit = 2 * p.stat().st_size + 64
    assert all(len(k) + len(v) <= limit for pod in sc.pods for k, v in pod.labels.items()), "a label longer than the file"
    assert_usable(sc)
    return sc


@FUZZ
@given(body=file_bodies, suffix=st.sampled_from([".yaml", ".yml", ".json"]))
@example(body=b"\xff\xfe gpus: []", suffix=".yaml")  # not UTF-8: UnicodeDecodeError escaped
@example(body=b"[" * 5000, suffix=".yaml")  # the YAML composer recursed: RecursionError
@example(body=b"[" * 100000, suffix=".json")  # so did json.loads
@example(body=b"gpus: [{minor: " + b"1" * 5000 + b"}]", suffix=".yaml")  # int() digit limit: bare ValueError
@example(body=b'{"gpus": [{"minor": ' + b"1" * 5000 + b"}]}", suffix=".json")
@example(body=b"gpus: [{memory: " + b"9" * 400 + b"}]", suffix=".yaml")  # size x ratio in read(): OverflowError
@example(body=b"gpus: [{memory: " + b"9" * 400 + b"Gi}]", suffix=".yaml")  # int(inf): OverflowError
@example(body=b"gpus: [{utilization: {pattern: sine, phase: " + b"9" * 400 + b"}}]", suffix=".yaml")  # sin(inf) at read time
@example(body=b"gpus: [{utilization: .nan, power_limit_watts: .inf}]", suffix=".yaml")  # NaN/inf readings
@example(body=b"!!float ", suffix=".yaml")  # PyYAML's constructor: IndexError
@example(body=b"gpus: [{name: !!bool x}]", suffix=".yaml")  # KeyError
@example(body=b"gpus: [{name: !!timestamp x}]", suffix=".yaml")  # AttributeError
@example(body=b"gpus: [{name: 2001-13-45}]", suffix=".yaml")  # datetime(): ValueError
@example(body=b"gpus: [{name: a, x: 1, 2: 3}]", suffix=".yaml")  # unknown keys of mixed types: sorted() TypeError
@example(body=b'gpus: [{name: "\\ud800"}]', suffix=".yaml")  # lone surrogate: protobuf cannot encode it
@example(body=b"gpus: [{}]\ndriver_version: \"580.\xc2\xb2\"", suffix=".yaml")  # '\xb2'.isdigit() but int() fails
@example(body=f"gpus: [{{}}]\npods: [{{name: p, containers: [{{name: c}}], labels: {LAUGHS_FLOW}}}]\n".encode(), suffix=".yaml")  # a 5 MB label
@example(body=(LAUGHS + "gpus: [{name: *f}]\n").encode(), suffix=".yaml")  # the error message printed it all
@example(body=b"!!bool " + b"1" * 5000, suffix=".yaml")  # PyYAML's KeyError quoted the whole scalar
def test_any_file_is_a_scenario_or_one_scenario_error(scratch, body, suffix):
    _load_or_error(_write(scratch, body, suffix))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=file_bodies, suffix=st.sampled_from([".yaml", ".json"]))
@example(body=b"gpus: [{\"a\\nb\": 1}]", suffix=".yaml")  # the unknown key was printed as is: two lines
@example(body=b"gpus: [{name: \"a\\u2028b\"}]\nclaims: [{name: c, devices: [zz]}]", suffix=".yaml")  # splitlines() splits at U+2028
def test_demo_with_a_bad_scenario_exits_2_with_one_line(scratch, clean_env, body, suffix):
    p = _write(scratch, body, suffix)
    result = _load_or_error(p)
    if isinstance(result, Scenario):
        return  # a good one would start the demo; test_demo.py covers that
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["demo", "--scenario", str(p)]) == 2
    assert err.getvalue().splitlines() == [f"dra-gpu-exporter: error: {result}"]


def test_the_real_entry_point_with_a_bad_scenario(tmp_path):
    """The one subprocess check: no traceback reaches the terminal."""
    p = tmp_path / "bad.yaml"
    p.write_bytes(b"[" * 5000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    r = subprocess.run([sys.executable, "-m", "exporter", "demo", "--scenario", str(p)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(f"dra-gpu-exporter: error: {p}: not valid YAML: "), r.stderr


# =============================================================================================
# scenarios (b): any JSON-like tree


KEYS = [
    "name", "description", "node", "driver_version", "gpus", "claims", "pods", "faults", "minor", "uuid", "model",
    "memory", "pci_bus_id", "power_limit_watts", "idle_power_watts", "temperature_celsius", "utilization", "memory_used",
    "mig", "profile", "gi_profile_id", "placement_start", "pattern", "base", "amplitude", "period", "phase", "namespace",
    "devices", "labels", "start", "end", "containers", "claims", "device_plugin", "restartable_init", "resource",
    "device", "kind", "gpu", "at", "until", "code", "rate_per_minute",
]
NASTY_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(),
    st.sampled_from([0, -1, 2**63, 10**400, 10**4000, math.nan, math.inf, -math.inf, -0.0, 1e308, "", " ", "-1", "1e400",
                     "9" * 400, "nope", "gpu0", "gpu0:1g.10gb:0", "xid", "lost", "hang", "sine", "80Gi", "5m", "\ud800", "a\nb"]),
    st.text(max_size=8),
)
scenario_trees = st.recursive(
    NASTY_SCALARS,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), children, max_size=5),
    max_leaves=25,
)


@FUZZ
@given(tree=scenario_trees)
@example(tree={"gpus": [{"utilization": 10**400}]})  # float(): OverflowError
@example(tree={"gpus": [{"power_limit_watts": 10**400}]})
@example(tree={"gpus": [{}], "faults": [{"kind": "xid", "gpu": "gpu0", "at": 0, "code": math.nan}]})  # int(nan)
@example(tree={"gpus": [{}], "faults": [{"kind": "xid", "gpu": "gpu0", "at": 0, "code": math.inf}]})  # int(inf)
@example(tree={"gpus": [{}], "faults": [{"kind": "xid", "gpu": "gpu0", "at": 10**400, "code": 79}]})
@example(tree={"gpus": [{}], "claims": [{"name": "c", "devices": ["gpu0"]}], "pods": [{"name": "p", "containers": [{"name": "c", "claims": [[]]}]}]})
@example(tree={"gpus": [{"memory": 0, "mig": [{"profile": "1g.10gb"}]}]})  # ZeroDivisionError in read()
@example(tree={"gpus": [{"memory": "10Gi", "mig": [{"profile": "7g.80gb", "utilization": 1}]}]})  # SM activity 8.0
@example(tree={"gpus": [{"power_limit_watts": -700, "utilization": 1}]})  # negative power, energy ran backwards
@example(tree={"gpus": [{"power_limit_watts": 1e308, "utilization": 1}], "faults": [{"kind": "reset", "gpu": "gpu0", "at": 10}]})  # inf energy
@example(tree={"gpus": [{}], "faults": [{"kind": "ecc_uncorrectable", "gpu": "gpu0", "at": 0, "until": 120, "rate_per_minute": 1e308}]})  # int(inf)
@example(tree={"gpus": [{"name": "\ud800"}]})
@example(tree={"gpus": [{"uuid": "x" * 5000}]})  # the whole value in the message
def test_any_tree_is_a_scenario_or_one_scenario_error(tree):
    parse_or_error(tree)


@pytest.mark.parametrize(
    "tree",  # not @example: hypothesis cannot print these ints when it reports the example
    [
        {"gpus": [{"minor": 10**5000}]},  # repr() of the value in the error raised ValueError
        {"gpus": [{"name": 10**5000}]},
        {"gpus": [{"memory": 10**5000}]},
        {"gpus": [{}], "pods": [{"name": "p", "containers": [{"name": "c"}], "labels": {"k": 10**5000}}]},  # str() did
    ],
)
def test_ints_too_long_to_print(tree):
    assert isinstance(parse_or_error(tree), ScenarioError)


# =============================================================================================
# scenarios (c): valid scenarios, and each with one thing broken

_LOWER = "abcdefghijklmnopqrstuvwxyz"
MIG_PROFILES = {"1g.10gb": 10, "1g.20gb": 20, "2g.20gb": 20, "3g.40gb": 40, "4g.40gb": 40, "7g.80gb": 80}  # GiB
durations = st.one_of(
    st.integers(0, 10**6),
    st.floats(0, 1e6),
    st.builds(lambda n, u: f"{n}{u}", st.integers(0, 9999), st.sampled_from(["", "ms", "s", "m", "h"])),
)
curves = st.one_of(
    st.none(),
    st.floats(-1, 2),
    st.fixed_dictionaries(
        {},
        optional={
            "pattern": st.sampled_from(["constant", "sine", "square", "sawtooth", "ramp"]),
            "base": st.floats(-2, 2),
            "amplitude": st.floats(-2, 2),
            "period": durations,
            "phase": durations,
        },
    ),
)
label_keys = st.text(alphabet=_LOWER + "0123456789", min_size=1, max_size=6).map(lambda s: "k" + s)
label_values = st.text(alphabet=_LOWER + "0123456789-", max_size=8)


@st.composite
def valid_scenarios(draw: st.DrawFn) -> dict:
    """A scenario that must parse: every reference resolves, every value is in range."""
    d: dict = {}
    if draw(st.booleans()):
        d["node"] = draw(st.sampled_from(["demo-node", "n1", "gpu-node.example"]))
    refs: list[str] = []
    gpus = []
    for i in range(draw(st.integers(1, 4))):
        g: dict = {"name": f"g{i}"}
        for key, strat in (
            ("model", st.sampled_from(["NVIDIA H100 80GB HBM3", "NVIDIA L40S"])),
            ("temperature_celsius", st.floats(0, 60)),
            ("utilization", curves),
            ("memory_used", curves),
        ):
            if draw(st.booleans()):
                g[key] = draw(strat)
        if draw(st.booleans()):
            idle = draw(st.floats(0, 200))
            g["idle_power_watts"], g["power_limit_watts"] = idle, idle + draw(st.floats(0, 1000))
        if draw(st.integers(0, 2)) == 0:  # MIG mode, instances within the GPU's 80Gi
            starts = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True))
            migs, used = [], 0
            for s in starts:
                prof = draw(st.sampled_from(sorted(MIG_PROFILES)))
                if used + MIG_PROFILES[prof] > 80:
                    continue
                used += MIG_PROFILES[prof]
                migs.append({"profile": prof, "placement_start": s, "utilization": draw(curves), "memory_used": draw(curves)})
                refs.append(f"g{i}:{prof}:{s}")
            assume(migs)
            g["mig"] = migs
        else:
            if draw(st.booleans()):
                g["memory"] = draw(st.sampled_from(["80Gi", "48Gi", "40GB", 1024, "512MiB"]))
            refs.append(f"g{i}")
        gpus.append(g)
    d["gpus"] = gpus
    claims = []
    for j in range(draw(st.integers(0, 3))):
        ns = draw(st.sampled_from(["default", "ml"]))
        claims.append({"namespace": ns, "name": f"c{j}", "devices": draw(st.lists(st.sampled_from(refs), min_size=1, max_size=2, unique=True))})
    d["claims"] = claims
    pods = []
    for k in range(draw(st.integers(0, 3))):
        ns = draw(st.sampled_from(["default", "ml"]))
        mine = [c["name"] for c in claims if c["namespace"] == ns]
        containers = []
        for m in range(draw(st.integers(1, 2))):
            ct: dict = {"name": f"ct{m}", "claims": draw(st.lists(st.sampled_from(mine), max_size=2, unique=True)) if mine else []}
            if draw(st.booleans()):
                ct["device_plugin"] = [{"device": draw(st.sampled_from(refs))}]
            if draw(st.booleans()):
                ct["restartable_init"] = draw(st.booleans())
            containers.append(ct)
        pod: dict = {"namespace": ns, "name": f"p{k}", "containers": containers, "labels": draw(st.dictionaries(label_keys, label_values, max_size=2))}
        start = draw(st.integers(0, 100))
        pod["start"] = start
        if draw(st.booleans()):
            pod["end"] = start + draw(st.integers(1, 1000))
        pods.append(pod)
    d["pods"] = pods
    faults = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["xid", "lost", "ecc_uncorrectable", "hang", "reset", "recovery_action", "row_remap_failure", "row_remap_pending"]))
        at = draw(st.integers(0, 600))
        f: dict = {"kind": kind, "gpu": f"g{draw(st.integers(0, len(gpus) - 1))}", "at": at}
        if kind == "xid":
            f["code"] = draw(st.sampled_from([13, 31, 48, 79, 95, 119]))
        if kind == "recovery_action":
            f["code"] = draw(st.integers(1, 5))
        if kind == "ecc_uncorrectable":
            f["rate_per_minute"] = draw(st.floats(0, 100))
        if kind not in ("xid", "reset") and draw(st.booleans()):
            f["until"] = at + draw(st.integers(1, 600))
        faults.append(f)
    d["faults"] = faults
    return d


@FUZZ
@given(data=valid_scenarios())
@example(data={"gpus": [{"name": "g0", "utilization": {"pattern": "sine", "phase": 1, "period": 5e-324}}], "claims": [], "pods": [], "faults": []})  # sin(inf)
@example(data={"gpus": [{"name": "g0", "utilization": {"pattern": "sine", "phase": 1e308, "period": 1}}], "claims": [], "pods": [], "faults": []})
def test_generated_valid_scenarios_parse_and_run(data):
    sc = parse_or_error(data)
    assert isinstance(sc, Scenario), f"a valid scenario was rejected: {sc}"
    assert [g.name for g in sc.gpus] == [g["name"] for g in data["gpus"]]
    assert [len(g.mig) for g in sc.gpus] == [len(g.get("mig", [])) for g in data["gpus"]]
    assert [(c.namespace, c.name, c.devices) for c in sc.claims] == [(c["namespace"], c["name"], tuple(c["devices"])) for c in data["claims"]]
    assert [(p.namespace, p.name, len(p.containers)) for p in sc.pods] == [(p["namespace"], p["name"], len(p["containers"])) for p in data["pods"]]
    assert [f.at for f in sc.faults] == sorted(f["at"] for f in data["faults"])


def _bundled() -> list[dict]:
    found = [yaml.safe_load(p.read_text()) for p in bundled_scenarios().values()]
    full = [b for b in re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.S) if b.startswith("name:")]
    return found + [yaml.safe_load(full[0])]


BUNDLED = _bundled()


def _at(obj: Any, path: tuple) -> Any:
    for step in path:
        obj = obj[step]
    return obj


def _where(path: tuple, source: str = "src") -> str:
    """The place an error names for ``path``: "src.node", "gpus[0].mig[1].profile"; a label
    key is reported at its pod's labels."""
    if "labels" in path:
        path = path[: path.index("labels") + 1]
    if len(path) == 1:
        return f"{source}.{path[0]}"
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


@st.composite
def scenario_bases(draw: st.DrawFn) -> dict:
    return copy.deepcopy(draw(st.sampled_from(BUNDLED) | valid_scenarios()))


BAD_VALUES = st.one_of(
    NASTY_SCALARS,
    st.sampled_from([[], {}, [1], {"x": 1}, [[]], "gpu9", "gpu0:1g.10gb:99", "nope:7g.80gb:0", "Bad_Name"]),
)


@FUZZ
@given(base=scenario_bases(), data=st.data())
def test_one_field_replaced_by_junk(base, data):
    """Any field of a good scenario replaced by a wrong type, an out-of-range number, a
    dangling reference, ...: still the contract."""
    path = data.draw(st.sampled_from([p for p in tree_paths(base) if p]))
    old = _at(base, path[:-1])[path[-1]]
    junk = data.draw(BAD_VALUES)
    _at(base, path[:-1])[path[-1]] = junk
    result = parse_or_error(base)
    if isinstance(old, (str, int, float)) and isinstance(junk, (list, dict)) and isinstance(result, ScenarioError):
        # a container where a scalar was: nothing before this field changed, so the first
        # error is about this field
        assert str(result).startswith(_where(path)), (path, str(result))
    if isinstance(old, (str, int, float)) and isinstance(junk, list) and "labels" not in path and path[-1] != "utilization" and path[-1] != "memory_used":
        assert isinstance(result, ScenarioError), f"{_where(path)} accepted a list"


@FUZZ
@given(base=scenario_bases(), data=st.data())
def test_an_unknown_key_anywhere_is_named(base, data):
    dicts = [p for p in tree_paths(base) if isinstance(_at(base, p), dict) and (not p or p[-1] != "labels")]
    path = data.draw(st.sampled_from(dicts))
    _at(base, path)["zz_unknown"] = data.draw(NASTY_SCALARS)
    with pytest.raises(ScenarioError) as e:
        parse_scenario(base, "src")
    assert str(e.value) == f"{_where(path) if path else 'src'}: unknown key(s) zz_unknown"


@FUZZ
@given(base=scenario_bases(), data=st.data())
def test_a_field_deleted_or_an_entry_duplicated(base, data):
    """Required keys gone, duplicate GPUs, claims, pods, containers, MIG instances, faults."""
    containers = [p for p in tree_paths(base) if p and isinstance(_at(base, p), (dict, list)) and p[-1] != "labels"]
    path = data.draw(st.sampled_from(containers))
    target = _at(base, path)
    if isinstance(target, dict) and target:
        del target[data.draw(st.sampled_from(sorted(target)))]
    elif isinstance(target, list) and target:
        i = data.draw(st.integers(0, len(target) - 1))
        target.insert(data.draw(st.integers(0, len(target))), copy.deepcopy(target[i]))
    parse_or_error(base)


def _refs(d: dict) -> list[tuple]:
    """Paths of every reference in a scenario: claim devices, container claims, plugin devices, fault GPUs."""
    out = []
    for p in tree_paths(d):
        if (
            (p[:1] == ("claims",) and len(p) == 4 and p[2] == "devices")
            or (p[:1] == ("pods",) and len(p) == 6 and p[4] == "claims")
            or (p[:1] == ("pods",) and len(p) == 7 and p[-1] == "device")
            or (p[:1] == ("faults",) and len(p) == 3 and p[-1] == "gpu")
        ):
            out.append(p)
    return out


@FUZZ
@given(base=scenario_bases(), data=st.data())
def test_a_dangling_reference_is_named(base, data):
    refs = _refs(base)
    assume(refs)
    path = data.draw(st.sampled_from(refs))
    old = _at(base, path)
    new = data.draw(st.sampled_from([old + "x", "x" + old, old.split(":")[0] + ":7g.80gb:9", old + ":1g.10gb:0", "", ":"]))
    _at(base, path[:-1])[path[-1]] = new
    with pytest.raises(ScenarioError) as e:
        parse_scenario(base, "src")
    assert str(e.value).startswith(_where(path) + ": "), (path, str(e.value))


# =============================================================================================
# configuration

ENV_FLAGS = [
    "listen", "interval", "backend", "taint-mode", "log-format", "log-level", "call-timeout", "per-process",
    "pod-label-allowlist", "dcgm-compat-labels", "taint-rate-limit", "taint-hold-seconds",
    "node-name", "kubelet-socket", "kubeconfig", "scenario", "time-scale",
]
BOOL_FLAGS = {"per-process", "dcgm-compat-labels"}
DEMO_ONLY = {"scenario", "time-scale"}
RANGES = {  # flag -> (Config field, lo, hi)
    "interval": ("interval", 0.05, 3600),
    "call-timeout": ("call_timeout", 0.01, 600),
    "taint-rate-limit": ("taint_rate_limit", 0, 1000),
    "taint-hold-seconds": ("taint_hold_seconds", 0, 7 * 86400),
    "time-scale": ("time_scale", 0.01, 10000),
}
CHOICES = {"backend": ("auto", "nvml", "amdsmi", "sim"), "taint-mode": tuple(m.value for m in TaintMode),
           "log-format": ("auto", "json", "console"), "log-level": ("debug", "info", "warning", "error")}
LABEL_KEY = re.compile(r"([a-z0-9.-]+/)?[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
NODE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


# argparse names the subcommand when the error is in its part of the line
USAGE_ERROR = re.compile(r"dra-gpu-exporter( demo)?: error: \S.* \(see --help\)\n\Z")


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.upper().replace("-", "_")


@pytest.fixture(scope="module")
def clean_env() -> Iterator[None]:
    """No DRA_GPU_EXPORTER_* or NODE_NAME from the developer's shell; module-scoped so that
    hypothesis tests may use it."""
    with pytest.MonkeyPatch.context() as mp:
        for k in list(os.environ):
            if k.startswith(ENV_PREFIX) or k == "NODE_NAME":
                mp.delenv(k)
        yield


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield


NUMBERS = st.one_of(
    st.sampled_from(["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e309", "-1e309", "1e-400", "-1", "-0", "0", "0x10",
                     "1_0", "１２", "٣", "²", "5", "0.05", "0.0499999", "3600", "3600.0000001", "600", "1000", "1000.5",  # noqa: RUF001 - full-width digits on purpose
                     "2.5", "1", "1.0", " 5 ", "", " ", "5s", "1e3", "7e5", "604800", "604801", "0.01", "10000", "10001"]),
    st.floats().map(repr),
    st.integers(-(10**6), 10**6).map(str),
)
LISTENS = st.one_of(
    st.sampled_from([
        "0.0.0.0:9402", ":9402", "[::]:80", "[::1]:65535", "[::1]:65536", "[fe80::1%eth0]:80", "[::ffff:1.2.3.4]:80",
        "[1:2:3:4:5:6:7:8:9]:1", "[fe80::1%a b]:1", "[fe80::1%\x01]:1", "[:]:1", "[]:1", "[::1]", "::1:80", "a:b:80", "host:-1", "host:00080", "host:99999",
        "host:0", "ho st:1", "\x00:1", "a\x01b:80", "localhost:٨٠", "exa_mple.com:80", "my-host.example:9402", " :80 ",
        "*:80", "a/b:80", "é:80",
    ]),
    st.builds(lambda h, p: f"{h}:{p}", st.text(max_size=10), st.integers(-10, 70000)),
    st.builds(lambda h, p: f"[{h}]:{p}", st.text(alphabet="0123456789abcdef:.%", max_size=12), st.integers(0, 65535)),
)
LABEL_LISTS = st.one_of(
    st.sampled_from(["app", "app,team", "app,app", "a.b,a_b", "a-b,a.b", "app.kubernetes.io/name", "team, app ,", ",,,", "",
                     "bad key!", "-a", "a-", "A/b", "x/", "/x", "a" * 64, "é"]),
    st.lists(st.text(alphabet=_LOWER + "AZ09._-/ ", max_size=8), max_size=4).map(",".join),
)
PATHS = st.one_of(st.sampled_from(["", "/", "/nonexistent", "/dev/null", "/tmp", "a\x00b", "a\nb", "\ud800", "x" * 300]), st.text(max_size=20))
VALUES = {
    "listen": LISTENS,
    "interval": NUMBERS, "call-timeout": NUMBERS, "taint-rate-limit": NUMBERS,
    "taint-hold-seconds": NUMBERS, "time-scale": NUMBERS,
    "backend": st.sampled_from(["auto", "nvml", "amdsmi", "sim", "cuda", "SIM", "", " sim"]) | st.text(max_size=6),
    "taint-mode": st.sampled_from(["off", "dry-run", "shadow", "enforce", "OFF", "dry_run", ""]) | st.text(max_size=6),
    "log-format": st.sampled_from(["auto", "json", "console", "JSON", ""]) | st.text(max_size=6),
    "log-level": st.sampled_from(["debug", "info", "warning", "error", "INFO", "Warning", "warn", ""]) | st.text(max_size=6),
    "per-process": st.sampled_from(["1", "true", "yes", "on", "0", "false", "no", "off", "", " TRUE ", "maybe", "2"]) | st.text(max_size=4),
    "pod-label-allowlist": LABEL_LISTS,
    "node-name": st.sampled_from(["gpu-node-1", "a", "a.b", "Node", "a_b", "-a", "a" * 253, "a" * 254, "a..b", "", " "]) | st.text(max_size=8),
    "kubelet-socket": PATHS, "kubeconfig": PATHS, "scenario": PATHS,
}
VALUES["dcgm-compat-labels"] = VALUES["per-process"]


def _no_nul(s: str) -> bool:
    # the environment cannot hold NUL (or unencodable surrogates): real input never has them
    try:
        os.fsencode(s)
    except UnicodeEncodeError:
        return False
    return "\x00" not in s


@st.composite
def configs(draw: st.DrawFn) -> tuple[list[str], dict[str, str], bool]:
    """argv and environment: a few flags on the command line, a few in the environment."""
    demo = draw(st.booleans())
    allowed = [f for f in ENV_FLAGS if demo or f not in DEMO_ONLY]
    argv_flags = draw(st.lists(st.sampled_from(allowed), max_size=4, unique=True))
    env_flags = draw(st.lists(st.sampled_from(allowed), max_size=4, unique=True))
    argv: list[str] = ["demo"] if demo else []
    for f in argv_flags:
        if f in BOOL_FLAGS:
            argv.append(f"--{f}")
        elif f in ("node-name", "kubelet-socket", "kubeconfig") and demo:
            continue  # top-level only: they would have to come before "demo"
        else:
            v = draw(VALUES[f])
            argv += [f"--{f}={v}"] if v.startswith("-") or draw(st.booleans()) else [f"--{f}", v]
    env = {_env_name(f): draw(VALUES[f].filter(_no_nul)) for f in env_flags}
    if draw(st.booleans()):
        env["NODE_NAME"] = draw(VALUES["node-name"].filter(_no_nul))
    return argv, env, demo


def assert_config_ok(c: Config, demo: bool) -> None:
    """The documented invariants of a resolved configuration."""
    host = c.listen_host
    assert host and host.isprintable() and not any(ch.isspace() for ch in host), repr(host)
    if ":" in host:
        ipaddress.IPv6Address(host)  # only a bracketed IPv6 literal has colons
    assert isinstance(c.listen_port, int) and 0 <= c.listen_port <= 65535
    for flag, (name, lo, hi) in RANGES.items():
        v = getattr(c, name)
        assert math.isfinite(v) and lo <= v <= hi, (flag, v)
    assert isinstance(c.taint_rate_limit, int)
    for flag, choices in CHOICES.items():
        v = getattr(c, flag.replace("-", "_"))
        assert (v.value if isinstance(v, TaintMode) else v) in choices, (flag, v)
    assert isinstance(c.per_process, bool) and isinstance(c.dcgm_compat_labels, bool)
    assert isinstance(c.pod_label_allowlist, tuple)
    for k in c.pod_label_allowlist:
        assert LABEL_KEY.fullmatch(k), k
    # each key becomes its own Prometheus label on dra_pod_labels: they must stay distinct
    exported = [re.sub(r"[^a-zA-Z0-9_]", "_", k) for k in c.pod_label_allowlist]
    assert len(set(exported)) == len(exported), c.pod_label_allowlist
    if demo:
        # a file, or a name the demo looks up among the bundled scenarios (issue 15)
        assert c.scenario is None or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", c.scenario) or Path(c.scenario).is_file()
        assert c.backend == "sim"
    else:
        assert NODE.fullmatch(c.node_name) and len(c.node_name) <= 253, c.node_name
        # issue 15: problems the kubelet client rides out do not stop the start; unusable paths do
        assert kubelet_socket_unusable(c.kubelet_socket) is None
        assert c.backend != "sim"  # the demo's backend, refused for the agent (issue 15)
        assert c.kubeconfig is None or Path(c.kubeconfig).is_file()


def _argv_value(flag: str, argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith(f"--{flag}="):
            return a.split("=", 1)[1]
        if a == f"--{flag}":
            return argv[i + 1] if flag not in BOOL_FLAGS else "true"
    return None


def _given(flag: str, argv: list[str], env: dict[str, str]) -> str | None:
    """Where a flag's value came from: "argv", the environment variable's name, or None. The
    node name falls back to the downward API's NODE_NAME when the flag and its variable are
    unset or empty."""
    value, source = _argv_value(flag, argv), "argv"
    if value is None and _env_name(flag) in env:
        value, source = env[_env_name(flag)], _env_name(flag)
    if flag == "node-name" and not value and env.get("NODE_NAME"):
        return "NODE_NAME"
    return source if value is not None else None


def _resolve_or_error(argv: list[str], env: dict[str, str]) -> Config | ConfigError | SystemExit:
    """parse_args + resolve under the contract."""
    with _environ(env):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = build_parser().parse_args(argv)
        except SystemExit as e:
            assert e.code == 2, f"argparse exited {e.code} for {argv}"
            _one_line(err.getvalue().rstrip("\n"))
            assert USAGE_ERROR.match(err.getvalue()), err.getvalue()
            return e
        try:
            return resolve(ns)
        except ConfigError as e:
            msg = str(e)
            _one_line(msg)
            m = re.match(r"--([a-z-]+)", msg)
            assert m, f"a configuration error names its flag first: {msg!r}"
            source = _given(m.group(1), argv, env)
            assert source, f"{msg!r} names a flag that was not given"
            if source == "argv":
                assert "(from " not in msg, msg
            else:
                assert msg.endswith(f" (from {source})"), f"a bad value from {source} must say so: {msg!r}"
            return e


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=configs())
@example(case=(["--kubelet-socket", "a\x00b"], {}, False))  # Path.stat(): ValueError escaped
@example(case=(["--kubelet-socket", "\ud800"], {}, False))  # os.fsencode(): UnicodeEncodeError escaped
@example(case=(["demo", "--scenario", "a\nb"], {}, True))  # the error was two lines
@example(case=(["--kubeconfig=a\u2028b"], {}, False))
@example(case=([], {"NODE_NAME": "Not_A_Node"}, False))  # did not say it came from NODE_NAME
@example(case=(["--node-name", ""], {"NODE_NAME": "Not_A_Node"}, False))
@example(case=([], {_env_name("node-name"): "", "NODE_NAME": "Not_A_Node"}, False))  # said DRA_GPU_EXPORTER_NODE_NAME
@example(case=(["--pod-label-allowlist", "a.b,a_b"], {}, False))  # both exported as label_a_b
@example(case=([], {_env_name("pod-label-allowlist"): "app,app"}, False))
@example(case=(["--listen", "[1:2:3:4:5:6:7:8:9]:1"], {}, False))  # not an IPv6 address
@example(case=(["--listen", "a\x01b:80"], {}, False))
@example(case=(["--listen", "[fe80::1%a b]:80"], {}, False))  # guards the IPv6 check: ipaddress takes any scope id
@example(case=(["--bogus\nflag"], {}, False))  # argparse's message carried the newline
@example(case=(["demo"], {_env_name("scenario"): "x" * 300}, True))  # is_file(): ENAMETOOLONG escaped
@example(case=(["--kubeconfig", "x" * 300], {}, False))
def test_any_configuration_resolves_to_valid_config_or_one_error(clean_env, case):
    argv, env, demo = case
    result = _resolve_or_error(argv, env)
    if isinstance(result, Config):
        assert_config_ok(result, demo)


@FUZZ
@given(addr=st.ip_addresses(), port=st.integers(0, 65535), scope=st.sampled_from(["", "%eth0", "%1"]), dotted=st.booleans())
@example(addr=ipaddress.IPv6Address("::ffff:1.2.3.4"), port=80, scope="", dotted=True)  # valid, was refused for its dots
def test_listen_accepts_every_ip_address(addr, port, scope, dotted):
    if addr.version == 4:
        assert parse_listen(f"{addr}:{port}") == (str(addr), port)
        return
    text = f"::ffff:{addr.ipv4_mapped}" if dotted and addr.ipv4_mapped else str(addr)
    assert parse_listen(f"[{text}{scope}]:{port}") == (f"{text}{scope}", port)


@st.composite
def one_bad_value(draw: st.DrawFn) -> tuple[str, str, bool]:
    flag = draw(st.sampled_from(sorted(set(RANGES) | set(CHOICES) | BOOL_FLAGS)))
    return flag, draw(VALUES[flag].filter(_no_nul)), draw(st.booleans())


def _expected(flag: str, value: str, from_env: bool) -> Any:
    """What the documentation says a single value means: the resolved value, or None when it
    is invalid (the oracle for test_one_value_means_what_the_docs_say)."""
    if flag in RANGES:
        _, lo, hi = RANGES[flag]
        try:
            v = float(value)
        except ValueError:
            return None
        if not lo <= v <= hi:
            return None
        if flag == "taint-rate-limit":
            return int(v) if v == int(v) else None  # a count of rules: a whole number
        return v
    if flag == "backend" and value == "sim":
        return None  # the agent refuses it: the simulated backend is the demo's (docs/configuration.md)
    if flag in CHOICES:
        v = value.lower() if flag == "log-level" and from_env else value
        return v if v in CHOICES[flag] else None
    return {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False, "": False}.get(value.strip().lower())


@FUZZ
@given(case=one_bad_value())
@example(case=("taint-rate-limit", "2.5", False))  # silently became 2
@example(case=("taint-rate-limit", "0.5", True))  # silently became 0: no taints at all
def test_one_value_means_what_the_docs_say(clean_env, case):
    flag, value, from_env = case
    if flag in BOOL_FLAGS:
        from_env = True  # on the command line these take no value
    if flag in DEMO_ONLY:
        argv = ["demo"]
    else:
        argv = []
    env = {_env_name(flag): value} if from_env else {}
    if not from_env:
        argv += [f"--{flag}={value}"]
    want = _expected(flag, value, from_env)
    result = _resolve_or_error(argv, env)
    if want is None:
        assert not isinstance(result, Config), f"--{flag} {value!r} was accepted as {result}"
        if isinstance(result, ConfigError):
            assert str(result).startswith(f"--{flag}")
    else:
        assert isinstance(result, Config), f"--{flag} {value!r} was refused: {result}"
        field = RANGES[flag][0] if flag in RANGES else flag.replace("-", "_")
        got = getattr(result, field)
        assert (got.value if isinstance(got, TaintMode) else got) == want


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=configs())
@example(case=(["--bogus\nflag"], {}, False))
@example(case=(["--kubelet-socket", "a\x00b"], {}, False))
@example(case=([], {"NODE_NAME": "Not_A_Node"}, False))
def test_main_with_bad_configuration_exits_2_with_one_line(clean_env, case):
    argv, env, _demo = case
    result = _resolve_or_error(argv, env)
    assume(not isinstance(result, Config))  # a good one would start the agent or the demo
    err = io.StringIO()
    with _environ(env), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    assert code == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, err.getvalue()
    if isinstance(result, ConfigError):
        assert lines[0] == f"dra-gpu-exporter: error: {result}"
    else:
        assert USAGE_ERROR.match(err.getvalue()), err.getvalue()
