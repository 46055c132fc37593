"""Every key of the exporter-toolkit web config format, one row each: what it does here.

A key is either *enforced* (the row starts a real server with the key set and shows the
behaviour on the wire, against a client built with Python's ssl and http.client) or *refused*
(the row shows the one-line error, naming the key, that the CLI prints before exiting 2). The
table must name every key the parser knows (``webconfig.KEYS``): a key added to the parser
without a row fails here. docs/deploy.md ("TLS and authentication") has the same table in words.

Format: https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import bcrypt
import pytest
import trustme
from tls_helpers import CLIENT_ERRORS, Pki, basic, get, serve, web_config

from exporter.metrics.webconfig import KEYS, WebConfigError, client_san_problem, load_web_config

PASSWORD = "s3cret-scrape"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()  # cost 4: fast tests, same code path


def tls(pki: Pki, **extra) -> dict:
    return {"tls_server_config": {"cert_file": str(pki.cert), "key_file": str(pki.key), **extra}}


def mtls(pki: Pki, auth: str = "RequireAndVerifyClientCert", **extra) -> dict:
    return tls(pki, client_auth_type=auth, client_ca_file=str(pki.ca_file), **extra)


def refused(tmp: Path, doc: dict, message: str) -> None:
    with pytest.raises(WebConfigError) as e:
        load_web_config(str(web_config(tmp, doc)))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def served(tmp: Path, doc: dict, check: Callable) -> None:
    s = serve(web_config(tmp, doc))
    try:
        check(s)
    finally:
        s.stop()


def handshake(s, ctx: ssl.SSLContext) -> tuple[str | None, str | None, str | None, bytes | None]:
    """(TLS version, cipher, ALPN protocol, server certificate) of one handshake with ``s``."""
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", s.port), timeout=20), server_hostname="127.0.0.1") as c:
        cipher = c.cipher()
        return c.version(), cipher[0] if cipher else None, c.selected_alpn_protocol(), c.getpeercert(binary_form=True)


def served_with(pki: Pki, certificate: Path) -> Callable:
    def check(s):
        status, _, _, peer = get(s, pki.client_context())
        assert status == 200 and peer == ssl.PEM_cert_to_DER_cert(certificate.read_text())

    return check


# ------------------------------------------------------------------ one function per key


def basic_auth_users(tmp: Path, pki: Pki) -> None:
    def check(s):
        assert get(s, None)[0] == 401
        assert get(s, None, headers=basic("prometheus", "wrong"))[0] == 401
        assert get(s, None, headers=basic("prometheus", PASSWORD))[0] == 200

    served(tmp, {"basic_auth_users": {"prometheus": HASH}}, check)
    refused(tmp, {"basic_auth_users": {"prometheus": "plaintext"}}, "basic_auth_users.prometheus: not a bcrypt hash")


def rate_limit(tmp: Path, pki: Pki) -> None:
    refused(tmp, {"rate_limit": {"interval": "1s", "burst": 5}}, "rate_limit: not supported")


def cert_file(tmp: Path, pki: Pki) -> None:
    served(tmp, tls(pki), served_with(pki, pki.cert))
    # a relative path is taken from the config file's directory, as the toolkit does
    served(tmp, {"tls_server_config": {"cert_file": pki.cert.name, "key_file": pki.key.name}}, served_with(pki, pki.cert))
    refused(tmp, {"tls_server_config": {"cert_file": str(tmp / "missing.crt"), "key_file": str(pki.key)}}, "tls_server_config.cert_file")


def key_file(tmp: Path, pki: Pki) -> None:
    other = pki.ca.issue_cert("127.0.0.1")
    other.private_key_pem.write_to_path(str(tmp / "other.key"))
    served(tmp, tls(pki), served_with(pki, pki.cert))
    refused(tmp, {"tls_server_config": {"cert_file": str(pki.cert), "key_file": str(tmp / "other.key")}}, "cannot load certificate, key or client CA")


def cert(tmp: Path, pki: Pki) -> None:
    served(tmp, {"tls_server_config": {"cert": pki.cert.read_text(), "key_file": str(pki.key)}}, served_with(pki, pki.cert))
    refused(tmp, {"tls_server_config": {"cert": pki.cert.read_text(), "cert_file": str(pki.cert), "key_file": str(pki.key)}}, "give cert or cert_file, not both")


def key(tmp: Path, pki: Pki) -> None:
    served(tmp, {"tls_server_config": {"cert": pki.cert.read_text(), "key": pki.key.read_text()}}, served_with(pki, pki.cert))
    refused(tmp, {"tls_server_config": {"cert": pki.cert.read_text()}}, "are both required")


def _mtls_check(pki: Pki, *, no_cert_ok: bool) -> Callable:
    good, stranger = pki.ca.issue_cert("client.example"), trustme.CA().issue_cert("client.example")

    def check(s):
        assert get(s, pki.client_context(good))[0] == 200
        with pytest.raises(CLIENT_ERRORS):
            get(s, pki.client_context(stranger))  # a certificate from another CA
        if no_cert_ok:
            assert get(s, pki.client_context())[0] == 200
        else:
            with pytest.raises(CLIENT_ERRORS):
                get(s, pki.client_context())

    return check


def client_ca_file(tmp: Path, pki: Pki) -> None:
    served(tmp, mtls(pki), _mtls_check(pki, no_cert_ok=False))
    # a CA that is never asked for looks like mutual TLS and is not: the toolkit refuses it too
    refused(tmp, tls(pki, client_ca_file=str(pki.ca_file)), "client_auth_type is NoClientCert")


def client_ca(tmp: Path, pki: Pki) -> None:
    served(tmp, tls(pki, client_auth_type="RequireAndVerifyClientCert", client_ca=pki.ca_file.read_text()), _mtls_check(pki, no_cert_ok=False))
    refused(tmp, tls(pki, client_ca=pki.ca_file.read_text(), client_ca_file=str(pki.ca_file), client_auth_type="RequireAndVerifyClientCert"), "give client_ca or client_ca_file, not both")


def client_auth_type(tmp: Path, pki: Pki) -> None:
    served(tmp, tls(pki, client_auth_type="NoClientCert"), served_with(pki, pki.cert))
    served(tmp, mtls(pki, "VerifyClientCertIfGiven"), _mtls_check(pki, no_cert_ok=True))
    served(tmp, mtls(pki, "RequireAndVerifyClientCert"), _mtls_check(pki, no_cert_ok=False))
    for unverified in ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert"):
        refused(tmp, mtls(pki, unverified), f"client_auth_type {unverified}: not supported")
    refused(tmp, mtls(pki, "Sometimes"), "expected one of NoClientCert")


def client_allowed_sans(tmp: Path, pki: Pki) -> None:
    listed, unlisted = pki.ca.issue_cert("prometheus.monitoring.svc"), pki.ca.issue_cert("other.example")

    def check(s):
        assert get(s, pki.client_context(listed))[0] == 200
        with pytest.raises(CLIENT_ERRORS):
            get(s, pki.client_context(unlisted))

    served(tmp, mtls(pki, client_allowed_sans=["prometheus.monitoring.svc"]), check)
    refused(tmp, mtls(pki, "VerifyClientCertIfGiven", client_allowed_sans=["x"]), "needs client_auth_type RequireAndVerifyClientCert")
    refused(tmp, mtls(pki, client_allowed_sans=[]), "empty, which would refuse every client")


def min_version(tmp: Path, pki: Pki) -> None:
    old = pki.client_context()
    old.maximum_version = ssl.TLSVersion.TLSv1_2

    def check(s):
        with pytest.raises(CLIENT_ERRORS):
            get(s, old)
        assert get(s, pki.client_context())[0] == 200

    served(tmp, tls(pki, min_version="TLS13"), check)
    refused(tmp, tls(pki, min_version="TLS14"), "expected one of TLS10")


def max_version(tmp: Path, pki: Pki) -> None:
    def check(s):
        assert handshake(s, pki.client_context())[0] == "TLSv1.2"

    served(tmp, tls(pki, max_version="TLS12"), check)
    refused(tmp, tls(pki, min_version="TLS13", max_version="TLS12"), "min_version is above max_version")


def prefer_server_cipher_suites(tmp: Path, pki: Pki) -> None:
    ctx = pki.client_context()
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2  # TLS 1.3 suites are not chosen by preference order
    ctx.set_ciphers("ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384")  # the client prefers AES128

    def chooses(cipher: str) -> Callable:
        def check(s):
            assert handshake(s, ctx)[1] == cipher

        return check

    served(tmp, tls(pki), chooses("ECDHE-ECDSA-AES256-GCM-SHA384"))  # default true: OpenSSL's (the server's) order
    served(tmp, tls(pki, prefer_server_cipher_suites=False), chooses("ECDHE-ECDSA-AES128-GCM-SHA256"))  # the client's
    refused(tmp, tls(pki, prefer_server_cipher_suites="yes"), "prefer_server_cipher_suites: expected true or false")


def cipher_suites(tmp: Path, pki: Pki) -> None:
    refused(tmp, tls(pki, cipher_suites=["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"]), "cipher_suites: not supported")


def curve_preferences(tmp: Path, pki: Pki) -> None:
    refused(tmp, tls(pki, curve_preferences=["X25519"]), "curve_preferences: not supported")


def http2(tmp: Path, pki: Pki) -> None:
    ctx = pki.client_context()
    ctx.set_alpn_protocols(["h2", "http/1.1"])

    def check(s):
        assert handshake(s, ctx)[2] == "http/1.1"  # HTTP/2 is never offered
        assert get(s, pki.client_context())[0] == 200

    for value in (False, True):  # false is the toolkit's behaviour; true (its default) is accepted
        served(tmp, {**tls(pki), "http_server_config": {"http2": value}}, check)
    refused(tmp, {"http_server_config": {"http2": "maybe"}}, "http_server_config.http2: expected true or false")


def headers(tmp: Path, pki: Pki) -> None:
    def check(s):
        for path in ("/metrics", "/healthz", "/nothing"):
            h = get(s, None, path)[1]
            assert h["X-Frame-Options"] == "deny" and h["Strict-Transport-Security"] == "max-age=31536000", (path, h)

    served(tmp, {"http_server_config": {"headers": {"X-Frame-Options": "deny", "Strict-Transport-Security": "max-age=31536000"}}}, check)
    refused(tmp, {"http_server_config": {"headers": {"X-Powered-By": "me"}}}, "'X-Powered-By' is not one of")
    refused(tmp, {"http_server_config": {"headers": {"X-Frame-Options": "allow"}}}, "'allow' is not one of deny, sameorigin")


# key -> (what it does here, the row)
TABLE: dict[str, tuple[str, Callable[[Path, Pki], None]]] = {
    "basic_auth_users": ("enforced: bcrypt, 401 without a valid user", basic_auth_users),
    "rate_limit": ("refused: one bucket for all clients lets a flood lock Prometheus out", rate_limit),
    "tls_server_config.cert_file": ("enforced: served, relative to the file, re-read on change", cert_file),
    "tls_server_config.key_file": ("enforced: must match the certificate", key_file),
    "tls_server_config.cert": ("enforced: inline PEM", cert),
    "tls_server_config.key": ("enforced: inline PEM", key),
    "tls_server_config.client_ca_file": ("enforced: client certificates from this CA only", client_ca_file),
    "tls_server_config.client_ca": ("enforced: inline client CA", client_ca),
    "tls_server_config.client_auth_type": ("enforced: the three verifying types; unverified ones refused", client_auth_type),
    "tls_server_config.client_allowed_sans": ("enforced: a listed DNS/email/IP/URI SAN required", client_allowed_sans),
    "tls_server_config.min_version": ("enforced", min_version),
    "tls_server_config.max_version": ("enforced", max_version),
    "tls_server_config.prefer_server_cipher_suites": ("enforced: OpenSSL's server-preference option", prefer_server_cipher_suites),
    "tls_server_config.cipher_suites": ("refused: Go cipher suite names", cipher_suites),
    "tls_server_config.curve_preferences": ("refused: Go curve names", curve_preferences),
    "http_server_config.http2": ("accepted: HTTP/1.1 only, said in ALPN", http2),
    "http_server_config.headers": ("enforced: the toolkit's five, on every answer", headers),
}


def test_the_table_names_every_key():
    assert sorted(TABLE) == sorted(KEYS)


@pytest.mark.parametrize("key", sorted(TABLE), ids=lambda k: f"{k} ({TABLE[k][0].split(':')[0]})")
def test_each_key_is_enforced_or_refused_with_one_line(tmp_path, key):
    TABLE[key][1](tmp_path, Pki(tmp_path))


def test_san_comparison_is_the_toolkits():
    """The toolkit compares DNS names, email addresses, IPs (Go's text form) and URIs, exactly;
    Python's ssl shows IPv6 SANs upper-case and uncompressed (OpenSSL's form)."""
    cert = {
        "subject": ((("commonName", "prometheus"),),),
        "subjectAltName": (
            ("DNS", "scraper.example"), ("email", "ops@example.com"), ("URI", "spiffe://cluster.local/ns/monitoring/sa/prometheus"),
            ("IP Address", "2001:DB8:0:0:0:0:0:1"), ("IP Address", "0:0:0:0:0:FFFF:A00:7"), ("IP Address", "10.0.0.9"),
            ("DirName", ((("commonName", "dirname"),),)), ("othername", "<unsupported>"),
        ),
    }
    for allowed in ("scraper.example", "ops@example.com", "spiffe://cluster.local/ns/monitoring/sa/prometheus", "2001:db8::1", "10.0.0.7", "10.0.0.9"):
        assert client_san_problem(cert, (allowed,)) is None, allowed
    for not_allowed in ("prometheus", "Scraper.example", "2001:DB8:0:0:0:0:0:1", "2001:db8:0::1", "dirname", "<unsupported>", "*.example"):
        problem = client_san_problem(cert, (not_allowed,))
        assert problem is not None and problem.startswith("no allowed SAN in the client certificate"), not_allowed
