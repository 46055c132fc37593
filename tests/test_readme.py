"""The README is part of the contract: its two commands, its demo sample and its metric families at a
glance; the metric reference (docs/metrics.md) with them."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from exporter.catalog import CATALOG

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
METRICS = (REPO / "docs" / "metrics.md").read_text()


def test_metric_reference_matches_the_code() -> None:
    section = METRICS.split("## Every family", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z_]+)` \| (\w+) \|", section, flags=re.M)
    assert [(n, k) for n, k in documented] == [(m.name, m.kind) for m in CATALOG]


def test_the_readme_glance_names_only_families_that_exist() -> None:
    section = README.split("## Metric families at a glance", 1)[1].split("\n## ", 1)[0]
    names = {m.name for m in CATALOG}
    named = re.findall(r"`((?:gpu|dra)_[a-z_*]+)`", section)
    assert len(named) > 20
    stale = [n for n in named if not fnmatch.filter(names, n)]
    assert not stale, f"README's metric glance names families that do not exist: {stale}"


def test_readme_opens_with_exactly_two_commands() -> None:
    first_block = README.split("```sh\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(first_block) == 2
    assert first_block[0].endswith("dra-gpu-exporter demo")
    assert "pytest" in first_block[1]
    # .ci/run must run the README's test command verbatim
    ci = (REPO / ".ci" / "run").read_text()
    assert first_block[1] in ci


def test_every_contract_metric_is_in_the_catalog() -> None:
    contract = """gpu_info gpu_up gpu_utilization_ratio gpu_memory_used_bytes gpu_memory_total_bytes gpu_power_watts
    gpu_energy_joules_total gpu_temperature_celsius gpu_ecc_errors_total gpu_xid_errors_total gpu_healthy gpu_health_condition
    dra_device_allocation_info dra_claim_devices dra_claim_utilization_ratio dra_claim_memory_used_bytes dra_claim_healthy
    dra_device_taint_rule dra_gpu_exporter_build_info dra_gpu_exporter_collector_duration_seconds
    dra_gpu_exporter_collector_success""".split()  # noqa: SIM905 - a word list, easier to read as prose
    names = {m.name for m in CATALOG}
    assert set(contract) <= names


# ---------------------------------------------------------------- the demo sample (issue 15)

_STATUS = re.compile(
    r"^\[sim \d\d:\d\d\] devices \d+ \(\d+ down\) \| pods \d+ \| claims \d+ \(\d+ unhealthy\) \| "
    r"conditions: (?P<conds>.+) \| taints: (?P<taints>none|off|[\w.-]+=\w+(, [\w.-]+=\w+)*)$"
)
_CONDITION = re.compile(
    r"GPU-[0-9a-f]{8} (fatal|degraded|informational): [a-z0-9_,]+"
    r"|\S{12} \([\w.-]+\) recovered, [\w.-]+=\w+ held until \d+s healthy"
)


def _readme_sample() -> list[str]:
    block = README.split("```text\n$ dra-gpu-exporter demo --time-scale 30\n", 1)[1].split("```", 1)[0]
    return block.rstrip("\n").splitlines()


def _untimed(line: str) -> str:
    return re.sub(r"^\[sim \d\d:\d\d\] ", "", line)


def _status_line_ok(line: str) -> bool:
    m = _STATUS.match(line)
    if not m:
        return False
    conds = m.group("conds")
    if conds == "none":
        return "NoExecute" not in m.group("taints")  # never "conditions: none" beside a NoExecute taint
    return all(_CONDITION.fullmatch(c) for c in conds.split("; "))


@pytest.mark.slow
def test_readme_demo_sample_matches_a_fresh_run(tmp_path) -> None:
    """Run the README's demo command and hold the sample to it: the banner line and the
    eviction/return lines verbatim, the steady status line verbatim, and every status line (the
    README's and the run's) in the status line's form. Timestamps differ run to run (a status
    line comes every 150 simulated seconds), so they are not compared."""
    import os
    import subprocess
    import sys

    from kit_helpers import free_port, stop_process, wait_until

    sample = _readme_sample()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRA_GPU_EXPORTER_")}
    env["PYTHONUNBUFFERED"] = "1"
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "demo", "--time-scale", "30", "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env,
        )
    lines: list[str] = []
    import threading

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    try:
        def recovered() -> bool:
            back = next((i for i, x in enumerate(lines) if "is running again" in x), None)
            return back is not None and any(_untimed(x) == _untimed(sample[-1]) for x in lines[back + 1 :])

        wait_until(recovered, 180, interval=0.2, message="the demo's recovery status line")
    finally:
        stop_process(proc, timeout=15)
    run = list(lines)
    assert run[0] == sample[0]
    assert run[1] == sample[1].replace("9402", str(port))
    run_untimed = {_untimed(x) for x in run}
    for line in sample[3:]:
        assert line.startswith("[sim "), line
        if _STATUS.match(line):
            assert _status_line_ok(line), f"README status line out of form: {line}"
        else:  # eviction and return lines
            assert _untimed(line) in run_untimed, f"README line not in a fresh run: {line}\nrun:\n" + "\n".join(run)
    assert _untimed(sample[-1]) in run_untimed
    statuses = [x for x in run if x.startswith("[sim ") and " devices " in x]
    assert statuses and all(_status_line_ok(x) for x in statuses), "\n".join(statuses)
