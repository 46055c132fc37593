"""TLS test kit for the metrics endpoint (tests/ is on sys.path): a throw-away CA per test
(trustme), a web config file, a started server and a one-request client.

    pki = Pki(tmp_path)
    s = serve(web_config(tmp_path, {"tls_server_config": {"cert_file": str(pki.cert), "key_file": str(pki.key)}}))
    status, headers, body, peer_cert = get(s, pki.client_context())
"""

from __future__ import annotations

import base64
import http.client
import os
import ssl
from pathlib import Path

import trustme
import yaml
from kit_helpers import publish

from exporter.metrics.server import MetricsServer
from exporter.metrics.webconfig import load_web_config

CLIENT_ERRORS = (ssl.SSLError, ConnectionError, http.client.HTTPException, OSError)  # a refused TLS client sees one of these


class Pki:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ca = trustme.CA()
        self.cert, self.key, self.ca_file = tmp / "tls.crt", tmp / "tls.key", tmp / "ca.crt"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.issue()

    def issue(self) -> trustme.LeafCert:
        """A new server certificate, swapped in atomically like a Secret volume update."""
        leaf = self.ca.issue_cert("127.0.0.1", "localhost")
        for path, blob in ((self.cert, leaf.cert_chain_pems[0]), (self.key, leaf.private_key_pem)):
            tmp = path.with_suffix(".new")
            blob.write_to_path(str(tmp))
            os.replace(tmp, path)
        return leaf

    def client_context(self, client: trustme.LeafCert | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        if client is not None:
            client.configure_cert(ctx)
        return ctx


def web_config(tmp: Path, doc: dict) -> Path:
    p = tmp / "web.yml"
    p.write_text(yaml.safe_dump(doc))
    return p


def serve(path: Path) -> MetricsServer:
    s = MetricsServer("127.0.0.1", 0, lambda: (True, "ready"), web_config=load_web_config(str(path)))
    publish(s)
    s.start()
    return s


def get(s: MetricsServer, ctx: ssl.SSLContext | None, path: str = "/metrics", headers: dict | None = None):
    c = http.client.HTTPSConnection("127.0.0.1", s.port, context=ctx, timeout=20) if ctx else http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        peer = c.sock.getpeercert(binary_form=True) if ctx else None
        return r.status, dict(r.getheaders()), r.read(), peer
    finally:
        c.close()


def basic(user: str, password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
