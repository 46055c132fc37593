"""The README is part of the contract: its metric reference and its two commands."""

from __future__ import annotations

import re
from pathlib import Path

from exporter.metrics.catalog import CATALOG

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_metric_reference_matches_the_code() -> None:
    section = README.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z_]+)` \| (\w+) \|", section, flags=re.M)
    assert [(n, k) for n, k in documented] == [(m.name, m.kind) for m in CATALOG]


def test_readme_opens_with_exactly_two_commands() -> None:
    first_block = README.split("```sh\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(first_block) == 2
    assert first_block[0].endswith("dra-gpu-exporter demo")
    assert "pytest" in first_block[1]
    # .ci/run must run the README's test command verbatim
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert first_block[1] in ci


def test_every_contract_metric_is_in_the_catalog() -> None:
    contract = """gpu_info gpu_up gpu_utilization_ratio gpu_memory_used_bytes gpu_memory_total_bytes gpu_power_watts
    gpu_energy_joules_total gpu_temperature_celsius gpu_ecc_errors_total gpu_xid_errors_total gpu_healthy gpu_health_condition
    dra_device_allocation_info dra_claim_devices dra_claim_utilization_ratio dra_claim_memory_used_bytes dra_claim_healthy
    dra_device_taint_rule dra_gpu_exporter_build_info dra_gpu_exporter_collector_duration_seconds
    dra_gpu_exporter_collector_success""".split()
    names = {m.name for m in CATALOG}
    assert set(contract) <= names
