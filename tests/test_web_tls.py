"""--web-config-file: TLS, mTLS, bcrypt basic auth and headers, with certificates made by a
throw-away CA in each test (trustme), against the real server; and a real Prometheus scraping
over TLS with basic auth. Bad files are one line and exit code 2.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time

import bcrypt
import pytest
import trustme
import yaml
from kit_helpers import fetch, free_port, wait_until
from prom_helpers import NO_PROMETHEUS_REASON, PROMETHEUS, PrometheusServer
from tls_helpers import CLIENT_ERRORS, Pki, basic, get, serve, web_config

from exporter.cli import check_web_config
from exporter.config import ConfigError, build_parser, resolve
from exporter.metrics.webconfig import WebConfigError, parse_web_config

PASSWORD = "s3cret-scrape"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()  # cost 4: fast tests, same code path


def test_tls_serves_rotated_certificates_and_refuses_plain_http(tmp_path):
    pki = Pki(tmp_path)
    s = serve(web_config(tmp_path, {"tls_server_config": {"cert_file": str(pki.cert), "key_file": str(pki.key), "min_version": "TLS12"}}))
    try:
        assert s.url.startswith("https://")
        status, _, body, first = get(s, pki.client_context())
        assert status == 200 and b"dra_gpu_exporter_build_info" in body
        # plain HTTP to the TLS port: the client gets an error, not a hang, and the server
        # counts it and goes on
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            get(s, None)
        wait_until(lambda: s.stats().tls_failed >= 1, message="the failed handshake counted")
        # rotate on disk: new connections get the new certificate, no restart
        pki.issue()
        wait_until(lambda: get(s, pki.client_context())[3] != first, message="the rotated certificate served")
        assert get(s, pki.client_context())[0] == 200
        # a broken pair on disk (key of another cert) keeps the last good certificate
        other = pki.ca.issue_cert("127.0.0.1")
        other.private_key_pem.write_to_path(str(pki.key))
        time.sleep(1.2)  # past the once-a-second file check, so the broken pair is tried
        assert get(s, pki.client_context())[0] == 200
    finally:
        s.stop()


def test_mutual_tls_requires_a_certificate_from_the_client_ca(tmp_path):
    pki = Pki(tmp_path)
    good = pki.ca.issue_cert("scraper@example.com")
    stranger = trustme.CA().issue_cert("scraper@example.com")
    s = serve(web_config(tmp_path, {"tls_server_config": {
        "cert_file": str(pki.cert), "key_file": str(pki.key),
        "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": str(pki.ca_file),
    }}))
    try:
        assert get(s, pki.client_context(good))[0] == 200
        for client in (None, stranger):
            with pytest.raises(CLIENT_ERRORS):
                get(s, pki.client_context(client))
        assert get(s, pki.client_context(good), "/readyz")[0] == 200  # still serving
    finally:
        s.stop()


def test_client_allowed_sans_serves_listed_certificates_only(tmp_path):
    """exporter-toolkit's client_allowed_sans (its VerifyPeerCertificate): after the chain is
    verified, the client certificate must carry one of the listed values among its DNS, email,
    IP and URI SANs. Client certificates from the same CA: those with a listed SAN are served;
    one whose SAN is not listed is refused (closed right after the handshake, before a request
    is read), even with a listed name as its subject CN, which the toolkit does not compare."""
    pki = Pki(tmp_path)
    by_dns = pki.ca.issue_cert("prometheus.monitoring.svc")
    by_email = pki.ca.issue_cert("scraper@example.com")
    by_ip = pki.ca.issue_cert("10.0.0.7", "2001:db8::7")
    unlisted = pki.ca.issue_cert("intruder.example", "10.0.0.8", common_name="prometheus.monitoring.svc")
    s = serve(web_config(tmp_path, {"tls_server_config": {
        "cert_file": str(pki.cert), "key_file": str(pki.key),
        "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": str(pki.ca_file),
        "client_allowed_sans": ["prometheus.monitoring.svc", "scraper@example.com", "2001:db8::7"],
    }}))
    try:
        for client in (by_dns, by_email, by_ip):
            assert get(s, pki.client_context(client))[0] == 200
        with pytest.raises(CLIENT_ERRORS):
            get(s, pki.client_context(unlisted))
        wait_until(lambda: s.stats().tls_failed == 1, message="the refused certificate counted")
        assert get(s, pki.client_context(by_dns), "/readyz")[0] == 200  # still serving
        assert s.stats().requests == {"200": 4}  # the refused client's request was never read
    finally:
        s.stop()


def test_basic_auth_with_bcrypt_and_headers(tmp_path):
    s = serve(web_config(tmp_path, {
        "basic_auth_users": {"prometheus": HASH},
        "http_server_config": {"headers": {"X-Frame-Options": "deny", "X-Content-Type-Options": "nosniff"}},
    }))
    try:
        status, h, _, _ = get(s, None)
        assert status == 401 and h["WWW-Authenticate"].startswith("Basic")
        assert get(s, None, headers=basic("prometheus", "wrong"))[0] == 401
        assert get(s, None, headers=basic("nobody", PASSWORD))[0] == 401
        assert get(s, None, headers={"Authorization": "Basic !!!"})[0] == 401
        status, h, body, _ = get(s, None, headers=basic("prometheus", PASSWORD))
        assert status == 200 and b"dra_gpu_exporter_build_info" in body
        assert h["X-Frame-Options"] == "deny" and h["X-Content-Type-Options"] == "nosniff"
        assert get(s, None, headers=basic("prometheus", PASSWORD))[0] == 200  # cached: no second bcrypt
        # the kubelet's probes carry no credentials
        assert get(s, None, "/healthz")[0] == 200 and get(s, None, "/readyz")[0] == 200
        assert s.stats().requests.get("401", 0) == 4
    finally:
        s.stop()


@pytest.mark.parametrize(
    "doc, message",
    [
        ("tls_server_config: [1, 2]\n", "tls_server_config: expected a mapping"),
        ("tls_server_config:\n  cert_file: /nonexistent.crt\n  key_file: /nonexistent.key\n", "tls_server_config.cert_file /nonexistent.crt: No such file or directory"),
        ("basic_auth_users:\n  prom: plaintext\n", "basic_auth_users.prom: not a bcrypt hash"),
        ("basic_auth: {}\n", "unknown key(s) basic_auth"),
        ("http_server_config:\n  headers:\n    X-Powered-By: me\n", "'X-Powered-By' is not one of"),
        ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n", "'allow' is not one of deny, sameorigin"),
        ("tls_server_config:\n  cert_file: a\n  key_file: b\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n", "cipher_suites: not supported"),
        ("rate_limit:\n  interval: 1s\n  burst: 5\n", "rate_limit: not supported"),
        ("a: [\n", "not valid YAML at line"),
    ],
)
def test_bad_web_config_is_one_clear_line(tmp_path, doc, message):
    p = tmp_path / "web.yml"
    p.write_text(doc)
    cfg = resolve(build_parser().parse_args(["--node-name", "n", "--web-config-file", str(p)]))
    problem = check_web_config(cfg)  # what the CLI prints before it starts anything (exit 2)
    assert problem is not None and message in problem and "\n" not in problem, problem
    assert problem.startswith(f"--web-config-file {p}: ")
    with pytest.raises(ConfigError, match="no such file"):
        resolve(build_parser().parse_args(["--node-name", "n", "--web-config-file", str(tmp_path / "missing.yml")]))


def test_tls_settings_are_checked_at_start(tmp_path):
    pki = Pki(tmp_path)
    other = pki.ca.issue_cert("x")
    other.private_key_pem.write_to_path(str(tmp_path / "other.key"))
    for tls, message in (
        ({"cert_file": str(pki.cert), "key_file": str(tmp_path / "other.key")}, "cannot load certificate, key or client CA"),
        ({"cert_file": str(pki.cert), "key_file": str(pki.key), "client_auth_type": "RequireAndVerifyClientCert"}, "needs client_ca_file"),
        ({"cert_file": str(pki.cert), "key_file": str(pki.key), "client_auth_type": "RequireAnyClientCert", "client_ca_file": str(pki.ca_file)}, "not supported"),
        ({"cert_file": str(pki.cert), "key_file": str(pki.key), "min_version": "TLS14"}, "expected one of TLS10"),
        ({"cert_file": str(pki.cert)}, "are both required"),
    ):
        with pytest.raises(WebConfigError, match=message):
            parse_web_config({"tls_server_config": tls})
    # inline PEM works like the files
    cfg = parse_web_config({"tls_server_config": {"cert": pki.cert.read_text(), "key": pki.key.read_text()}})
    assert cfg.tls is not None and cfg.tls.cert_file is None


def test_cli_exits_2_with_one_line_on_a_bad_file(tmp_path):
    p = tmp_path / "web.yml"
    p.write_text("basic_auth_users:\n  prom: plaintext\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRA_GPU_EXPORTER_")}
    r = subprocess.run([sys.executable, "-m", "exporter", "--node-name", "n", "--web-config-file", str(p)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "basic_auth_users.prom: not a bcrypt hash" in lines[0], r.stderr


@pytest.mark.prometheus
@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS_REASON)
def test_prometheus_scrapes_over_tls_with_basic_auth(tmp_path):
    pki = Pki(tmp_path)
    s = serve(web_config(tmp_path, {
        "tls_server_config": {"cert_file": str(pki.cert), "key_file": str(pki.key)},
        "basic_auth_users": {"prometheus": HASH},
    }))
    (tmp_path / "password").write_text(PASSWORD)
    config = {
        "global": {"scrape_interval": "500ms", "scrape_timeout": "500ms"},
        "scrape_configs": [
            {"job_name": "tls-auth", "scheme": "https", "static_configs": [{"targets": [f"127.0.0.1:{s.port}"]}],
             "tls_config": {"ca_file": str(pki.ca_file)},
             "basic_auth": {"username": "prometheus", "password_file": str(tmp_path / "password")}},
            {"job_name": "wrong-password", "scheme": "https", "static_configs": [{"targets": [f"127.0.0.1:{s.port}"]}],
             "tls_config": {"ca_file": str(pki.ca_file)}, "basic_auth": {"username": "prometheus", "password": "nope"}},
        ],
    }
    cfg_path = tmp_path / "prometheus.yml"
    cfg_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg_path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    prom = PrometheusServer(url=f"http://127.0.0.1:{port}", config_path=cfg_path, data_dir=tmp_path / "tsdb", log_path=log_path, process=proc)
    try:
        wait_until(lambda: fetch(f"{prom.url}/-/ready", timeout=2)[0] == 200, 60, message="prometheus ready", ignore=(OSError,))

        def scraped():
            t = {x["labels"]["job"]: x for x in prom.targets()}
            return t if t.get("tls-auth", {}).get("health") == "up" and t.get("wrong-password", {}).get("health") == "down" else None

        targets = wait_until(scraped, 90, message="tls-auth up and wrong-password down")
        assert "401" in targets["wrong-password"]["lastError"]
        assert prom.wait_for_query('dra_gpu_exporter_build_info{job="tls-auth"}', timeout=60)
    finally:
        prom.stop()
        s.stop()
