"""A real Prometheus server for tests: Debian's `prometheus` binary on a free loopback port.

Usage (pytest)::

    from prom_helpers import PROMETHEUS, start_prometheus
    from kit_helpers import wait_until

    @pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS_REASON)
    def test_x(tmp_path):
        with start_prometheus(["127.0.0.1:9402"], tmp_path) as prom:
            prom.wait_for_targets_up()
            rows = prom.query("gpu_up")

The server gets a generated config (one scrape job over the given targets, optional rule files),
its own TSDB directory under the caller's tmp_path, and is shut down (SIGTERM, then SIGKILL) when
the context exits. All waiting is bounded polling of the HTTP API: readiness (/-/ready), targets
(/api/v1/targets), or any condition the caller passes to ``wait_until``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kit_helpers import fetch, free_port, stop_process, wait_until  # noqa: F401 - re-exported for prom tests

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS_REASON = "prometheus binary not found: install Debian's `prometheus` package (CI does)"

class PrometheusError(RuntimeError):
    """The server did not start, or an API call failed (the message carries the server's error)."""






@dataclass
class PrometheusServer:
    url: str
    config_path: Path
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    _log_file: Any = field(repr=False, default=None)

    # --- raw API ----------------------------------------------------------------------------

    def api(self, path: str, **params: str | Sequence[str]) -> Any:
        """Call /api/v1/<path>; return ``data`` or raise PrometheusError with the server's error."""
        query = urllib.parse.urlencode(params, doseq=True)
        status, body = fetch(f"{self.url}/api/v1/{path}?{query}")
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise PrometheusError(f"{path}: HTTP {status}, not JSON: {body[:200]!r}") from exc
        if payload.get("status") != "success":
            raise PrometheusError(
                f"{path} {params}: {payload.get('errorType')}: {payload.get('error')} (HTTP {status})"
            )
        return payload["data"]

    # --- queries ----------------------------------------------------------------------------

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; returns the result list (vector or matrix entries, or a scalar wrapped)."""
        params: dict[str, str] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step}")
        return list(data["result"])

    def label_values(self, label: str, match: Sequence[str] = (), start: float | None = None) -> list[str]:
        params: dict[str, str | Sequence[str]] = {}
        if match:
            params["match[]"] = list(match)
        if start is not None:
            params["start"] = f"{start:.3f}"
        return list(self.api(f"label/{urllib.parse.quote(label, safe='')}/values", **params))

    def series(self, match: Sequence[str], start: float | None = None) -> list[dict[str, str]]:
        params: dict[str, str | Sequence[str]] = {"match[]": list(match)}
        if start is not None:
            params["start"] = f"{start:.3f}"
        return list(self.api("series", **params))

    def metric_names(self, start: float | None = None) -> set[str]:
        return set(self.label_values("__name__", start=start))

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    # --- waiting ----------------------------------------------------------------------------

    def wait_for_targets_up(self, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Wait until every configured target has been scraped successfully at least once."""

        def all_up() -> list[dict[str, Any]] | None:
            targets = self.targets()
            return targets if targets and all(t["health"] == "up" for t in targets) else None

        try:
            return wait_until(all_up, timeout, interval=0.2, message="all scrape targets up", ignore=(Exception,))
        except TimeoutError as exc:
            states = [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in self._safe_targets()]
            raise TimeoutError(f"{exc}; targets: {states}; log tail: {self.log_tail()}") from exc

    def wait_for_query(self, expr: str, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Wait until an instant query returns a non-empty result; return it."""
        return wait_until(lambda: self.query(expr), timeout, interval=0.2, message=f"data for {expr!r}", ignore=(Exception,))

    def _safe_targets(self) -> list[dict[str, Any]]:
        try:
            return self.targets()
        except Exception:  # diagnostics only
            return []

    # --- lifecycle --------------------------------------------------------------------------

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def write_config(
    path: Path,
    targets: Sequence[str],
    job: str = "dra-gpu-exporter",
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    rule_files: Sequence[Path] = (),
    target_labels: dict[str, str] | None = None,
    honor_labels: bool = True,
) -> Path:
    """A prometheus.yml with one static scrape job; honor_labels matches the shipped ServiceMonitor."""
    static: dict[str, Any] = {"targets": list(targets)}
    if target_labels:
        static["labels"] = dict(target_labels)
    config = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": evaluation_interval,
        },
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job, "honor_labels": honor_labels, "metrics_path": "/metrics", "static_configs": [static]}
        ],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@contextmanager
def start_prometheus(
    targets: Sequence[str],
    workdir: Path,
    *,
    job: str = "dra-gpu-exporter",
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    rule_files: Sequence[Path] = (),
    target_labels: dict[str, str] | None = None,
    startup_timeout: float = 20.0,
    attempts: int = 3,
) -> Iterator[PrometheusServer]:
    """Run Prometheus scraping ``targets`` until the context exits.

    ``workdir`` (e.g. pytest's tmp_path) receives prometheus.yml, the TSDB directory and the log.
    The port is picked free; if another process grabs it before Prometheus binds, start again.
    """
    if PROMETHEUS is None:
        raise PrometheusError(NO_PROMETHEUS_REASON)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = write_config(
        workdir / "prometheus.yml",
        targets,
        job=job,
        scrape_interval=scrape_interval,
        evaluation_interval=evaluation_interval,
        rule_files=rule_files,
        target_labels=target_labels,
    )
    server: PrometheusServer | None = None
    last_error = ""
    for attempt in range(attempts):
        port = free_port()
        data_dir = workdir / f"tsdb-{attempt}"
        log_path = workdir / f"prometheus-{attempt}.log"
        log_file = log_path.open("wb")
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={data_dir}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        candidate = PrometheusServer(
            url=f"http://127.0.0.1:{port}",
            config_path=config_path,
            data_dir=data_dir,
            log_path=log_path,
            process=process,
            _log_file=log_file,
        )

        def ready(c: PrometheusServer = candidate) -> bool:
            if c.process.poll() is not None:
                raise PrometheusError(f"prometheus exited with {c.process.returncode}")
            return fetch(f"{c.url}/-/ready", timeout=2)[0] == 200

        try:
            wait_until(ready, startup_timeout, interval=0.2, message="prometheus /-/ready", ignore=(Exception,), fatal=(PrometheusError,))
        except (TimeoutError, PrometheusError) as exc:
            last_error = f"{exc}; log: {candidate.log_tail()}"
            candidate.stop()
            continue
        server = candidate
        break
    if server is None:
        raise PrometheusError(f"prometheus did not start after {attempts} attempts: {last_error}")
    try:
        yield server
    finally:
        server.stop()
