"""``--web-config-file``: TLS, client certificates, basic auth and response headers, in the
Prometheus exporter-toolkit's file format, so a file written for node_exporter works here.

Format: https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md

Every key either does what the toolkit does or is refused with one line naming it
(``KEYS`` lists them all; tests/test_web_config_keys.py walks each one). Where it differs:
- The file itself is read once, at start (a bad file ends the program with one line, exit 2).
  The certificate, key and client CA *files* it names are re-read when they change on disk,
  so cert-manager rotations are served without a restart. Relative paths are taken from the
  file's directory, as the toolkit does.
- ``client_auth_type`` accepts NoClientCert, VerifyClientCertIfGiven and
  RequireAndVerifyClientCert. RequestClientCert and RequireAnyClientCert (and the old alias
  RequireClientCert) accept a certificate without verifying it; OpenSSL through Python's ssl
  module cannot do that, and the toolkit's own docs call them insecure: refused.
- ``client_allowed_sans`` is checked as the toolkit checks it (its ``VerifyPeerCertificate``):
  after the chain is verified, the client certificate must carry one of the listed values
  among its DNS, email, IP and URI subject alternative names, compared as exact strings (IPs
  in Go's text form); the subject's common name does not count. The toolkit fails the
  handshake; here the connection is closed right after it, before any request is read.
- ``cipher_suites`` and ``curve_preferences`` use Go's names; ``rate_limit`` is one token
  bucket for all clients, which lets a flood lock Prometheus out: refused with a clear error
  rather than silently ignored.
- ``http2``: this server speaks HTTP/1.1 only and says so in ALPN, so a client that offers h2
  negotiates HTTP/1.1; ``false`` is exactly the toolkit's behaviour, ``true`` (its default)
  is accepted for files written for node_exporter.
- ``prefer_server_cipher_suites`` (default true) sets OpenSSL's server-preference option; Go
  (1.17 and later) ignores the key and always chooses itself.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
import yaml

log = structlog.get_logger(__name__)


class WebConfigError(ValueError):
    """The web config file is unusable; the message is one line naming the key."""


_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_UNVERIFIED_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
# The toolkit allows exactly these response headers (and checks two of their values).
_HEADERS = {
    "content-security-policy": ("Content-Security-Policy", None),
    "x-frame-options": ("X-Frame-Options", ("deny", "sameorigin")),
    "x-content-type-options": ("X-Content-Type-Options", ("nosniff",)),
    "x-xss-protection": ("X-XSS-Protection", None),
    "strict-transport-security": ("Strict-Transport-Security", None),
}
_TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")
_TLS_KEYS = ("cert_file", "key_file", "cert", "key", "client_ca_file", "client_ca", "client_auth_type",
             "client_allowed_sans", "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites",
             "curve_preferences")
_HTTP_KEYS = ("http2", "headers")
# Every key of the exporter-toolkit format, dotted: what tests/test_web_config_keys.py walks.
KEYS = (*(k for k in _TOP_KEYS if k not in ("tls_server_config", "http_server_config")),
        *(f"tls_server_config.{k}" for k in _TLS_KEYS), *(f"http_server_config.{k}" for k in _HTTP_KEYS))
_UNSUPPORTED_TLS = {"cipher_suites": "Go cipher suite names", "curve_preferences": "Go curve names"}


@dataclass(frozen=True)
class TLSSettings:
    cert_file: str | None = None
    key_file: str | None = None
    cert: str | None = None  # inline PEM
    key: str | None = None
    client_ca_file: str | None = None
    client_ca: str | None = None
    verify_mode: ssl.VerifyMode = ssl.CERT_NONE
    client_allowed_sans: tuple[str, ...] = ()
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3
    prefer_server_cipher_suites: bool = True


@dataclass(frozen=True)
class WebConfig:
    tls: TLSSettings | None = None
    basic_auth_users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: tuple[tuple[str, str], ...] = ()
    source: str = ""


def _mapping(v: Any, where: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise WebConfigError(f"{where}: expected a mapping, got {type(v).__name__}")
    return v


def _string(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise WebConfigError(f"{where}: expected a non-empty string")
    return v


def _readable(path: str, where: str, base: str) -> str:
    path = os.path.join(base, path)  # an absolute path stays as it is
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise WebConfigError(f"{where} {path}: {e.strerror or e}") from None
    return path


def parse_web_config(data: Any, source: str = "") -> WebConfig:
    """Validate a parsed YAML document; WebConfigError with one line on the first problem."""
    top = _mapping(data, "web config")
    unknown = set(top) - set(_TOP_KEYS)
    if unknown:
        raise WebConfigError(f"unknown key(s) {', '.join(sorted(map(str, unknown)))} (expected tls_server_config, "
                             "http_server_config, basic_auth_users)")
    if top.get("rate_limit"):
        raise WebConfigError("rate_limit: not supported (one limit for all clients would let a flood lock Prometheus "
                             "out; the server's own per-connection limits apply, see docs/deploy.md)")
    base = os.path.dirname(os.path.abspath(source)) if source else ""
    tls = _parse_tls(top["tls_server_config"], base) if top.get("tls_server_config") else None
    users: dict[str, bytes] = {}
    for user, hashed in _mapping(top.get("basic_auth_users"), "basic_auth_users").items():
        user = _string(user, "basic_auth_users: user name")
        h = _string(hashed, f"basic_auth_users.{user}")
        if not (h.startswith(("$2a$", "$2b$", "$2y$")) and len(h) == 60):
            raise WebConfigError(f"basic_auth_users.{user}: not a bcrypt hash (make one with: htpasswd -nBC 10 \"\" | "
                                 "tr -d ':\\n')")
        if ":" in user:
            raise WebConfigError(f"basic_auth_users: user name {user!r} contains ':', which basic auth cannot carry")
        # bcrypt (the library) checks $2b$; $2y$ (htpasswd's) is the same algorithm
        users[user] = ("$2b$" + h[4:]).encode()
    headers: list[tuple[str, str]] = []
    http = _mapping(top.get("http_server_config"), "http_server_config")
    for k in http:
        if k not in _HTTP_KEYS:
            raise WebConfigError(f"http_server_config: unknown key {k!r} (expected http2, headers)")
    if "http2" in http and not isinstance(http["http2"], bool):
        raise WebConfigError("http_server_config.http2: expected true or false")
    for name, value in _mapping(http.get("headers"), "http_server_config.headers").items():
        spec = _HEADERS.get(str(name).lower())
        if spec is None:
            raise WebConfigError(f"http_server_config.headers: {name!r} is not one of "
                                 f"{', '.join(c for c, _ in _HEADERS.values())}")
        canonical, allowed = spec
        if value is None or value == "":
            continue  # unset if blank, as in the toolkit
        value = _string(value, f"http_server_config.headers.{name}")
        if allowed and value.lower() not in allowed:
            raise WebConfigError(f"http_server_config.headers.{name}: {value!r} is not one of {', '.join(allowed)}")
        if any(c in value for c in "\r\n\0"):
            raise WebConfigError(f"http_server_config.headers.{name}: control characters are not allowed")
        headers.append((canonical, value))
    return WebConfig(tls=tls, basic_auth_users=users, headers=tuple(headers), source=source)


def _parse_tls(raw: Any, base: str = "") -> TLSSettings:
    t = _mapping(raw, "tls_server_config")
    unknown = set(t) - set(_TLS_KEYS)
    if unknown:
        raise WebConfigError(f"tls_server_config: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
    for k, what in _UNSUPPORTED_TLS.items():
        if t.get(k):
            raise WebConfigError(f"tls_server_config.{k}: not supported ({what} do not map onto OpenSSL); leave it out "
                                 "to use OpenSSL's defaults")
    kw: dict[str, Any] = {}
    for inline, path in (("cert", "cert_file"), ("key", "key_file"), ("client_ca", "client_ca_file")):
        if t.get(inline) and t.get(path):
            raise WebConfigError(f"tls_server_config: give {inline} or {path}, not both")
        if t.get(path):
            kw[path] = _readable(_string(t[path], f"tls_server_config.{path}"), f"tls_server_config.{path}", base)
        elif t.get(inline):
            kw[inline] = _string(t[inline], f"tls_server_config.{inline}")
    if not (kw.get("cert_file") or kw.get("cert")) or not (kw.get("key_file") or kw.get("key")):
        raise WebConfigError("tls_server_config: cert_file (or cert) and key_file (or key) are both required")
    auth = t.get("client_auth_type") or "NoClientCert"
    if auth in _UNVERIFIED_AUTH:
        raise WebConfigError(f"tls_server_config.client_auth_type {auth}: not supported (accepts unverified "
                             "certificates); use RequireAndVerifyClientCert")
    if auth not in _CLIENT_AUTH:
        raise WebConfigError(f"tls_server_config.client_auth_type {auth!r}: expected one of {', '.join(_CLIENT_AUTH)}")
    kw["verify_mode"] = _CLIENT_AUTH[auth]
    has_ca = bool(kw.get("client_ca_file") or kw.get("client_ca"))
    if kw["verify_mode"] != ssl.CERT_NONE and not has_ca:
        raise WebConfigError(f"tls_server_config.client_auth_type {auth}: needs client_ca_file (or client_ca)")
    if kw["verify_mode"] == ssl.CERT_NONE and has_ca:
        # the toolkit refuses this too: a CA that is never asked for looks like mTLS and is not
        raise WebConfigError("tls_server_config.client_ca_file (or client_ca): set, but client_auth_type is "
                             "NoClientCert; set RequireAndVerifyClientCert or VerifyClientCertIfGiven")
    if "client_allowed_sans" in t and t["client_allowed_sans"] is not None:
        sans = t["client_allowed_sans"]
        if not isinstance(sans, list) or not all(isinstance(s, str) and s for s in sans):
            raise WebConfigError("tls_server_config.client_allowed_sans: expected a list of strings")
        if not sans:
            raise WebConfigError("tls_server_config.client_allowed_sans: empty, which would refuse every client; list "
                                 "the SANs to allow, or leave the key out")
        if kw["verify_mode"] != ssl.CERT_REQUIRED:
            raise WebConfigError("tls_server_config.client_allowed_sans: needs client_auth_type "
                                 "RequireAndVerifyClientCert")
        kw["client_allowed_sans"] = tuple(sans)
    if "prefer_server_cipher_suites" in t:
        if not isinstance(t["prefer_server_cipher_suites"], bool):
            raise WebConfigError("tls_server_config.prefer_server_cipher_suites: expected true or false")
        kw["prefer_server_cipher_suites"] = t["prefer_server_cipher_suites"]
    for k in ("min_version", "max_version"):
        if t.get(k) is not None:
            if t[k] not in _TLS_VERSIONS:
                raise WebConfigError(f"tls_server_config.{k} {t[k]!r}: expected one of {', '.join(_TLS_VERSIONS)}")
            kw[k] = _TLS_VERSIONS[t[k]]
    s = TLSSettings(**kw)
    if s.min_version > s.max_version:
        raise WebConfigError("tls_server_config: min_version is above max_version")
    build_context(s)  # a key that does not match its certificate fails here, at start
    return s


def load_web_config(path: str) -> WebConfig:
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 20)
    except OSError as e:
        raise WebConfigError(f"{path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise WebConfigError(f"not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    return parse_web_config(data, source=path)


def _load_pem_chain(ctx: ssl.SSLContext, cert_pem: str, key_pem: str) -> None:
    # load_cert_chain takes paths only; inline PEM goes through a private temporary file
    import tempfile

    with tempfile.TemporaryDirectory(prefix="web-config-") as d:
        c, k = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for p, data in ((c, cert_pem), (k, key_pem)):
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(data)
        ctx.load_cert_chain(c, k)


def build_context(s: TLSSettings) -> ssl.SSLContext:
    """A server context from the settings as they are on disk now."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version, ctx.maximum_version = s.min_version, s.max_version
    ctx.options |= ssl.OP_NO_COMPRESSION
    if s.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    ctx.set_alpn_protocols(["http/1.1"])  # no h2 here: a client offering it negotiates HTTP/1.1
    try:
        if s.cert_file or s.key_file:
            if s.cert_file and s.key_file:
                ctx.load_cert_chain(s.cert_file, s.key_file)
            else:
                _load_pem_chain(ctx, s.cert or _read(s.cert_file), s.key or _read(s.key_file))
        else:
            _load_pem_chain(ctx, s.cert or "", s.key or "")
        if s.verify_mode != ssl.CERT_NONE:
            if s.client_ca_file:
                ctx.load_verify_locations(cafile=s.client_ca_file)
            else:
                ctx.load_verify_locations(cadata=s.client_ca)
            ctx.verify_mode = s.verify_mode
    except (ssl.SSLError, OSError, ValueError) as e:
        raise WebConfigError("tls_server_config: cannot load certificate, key or client CA: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    return ctx


def client_san_problem(cert: dict[str, Any], allowed: tuple[str, ...]) -> str | None:
    """None when the (verified) client certificate carries one of the ``allowed`` SANs, else why
    not. The same comparison as exporter-toolkit's ``VerifyPeerCertificate``: DNS names, email
    addresses, IP addresses and URIs of the certificate, each as Go writes it, against the list
    as exact strings; other SAN kinds and the subject (CN) are not compared."""
    found: list[str] = []
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "IP Address":
            value = _go_ip(value)
        elif kind not in ("DNS", "email", "URI"):
            continue
        if value in allowed:
            return None
        found.append(value)
    listed = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return f"no allowed SAN in the client certificate (it has: {listed or 'none'})"


def _go_ip(text: str) -> str:
    """An IP SAN as Python's ssl shows it (OpenSSL's form: IPv6 upper-case and uncompressed) in
    Go's net.IP text form, which the toolkit compares: RFC 5952, an IPv4-mapped address as IPv4."""
    try:
        ip = ipaddress.ip_address(text.strip())
    except ValueError:
        return text.strip()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def _read(path: str | None) -> str:
    with open(path or "", encoding="utf-8") as f:
        return f.read()


class ReloadingContext:
    """Hands out an SSLContext built from the files as they are now.

    ``current()`` runs at each TLS handshake (from the SNI callback, see web.py). It looks at
    the files' mtime/size/inode at most once a second, and rebuilds the context when they
    changed. A half-written or mismatched pair (cert renewed, key not yet) keeps the previous
    context and is retried at the next check, logged once per change.
    """

    CHECK_EVERY = 1.0

    def __init__(self, settings: TLSSettings) -> None:
        self.settings = settings
        self._paths = [p for p in (settings.cert_file, settings.key_file, settings.client_ca_file) if p]
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._ctx = build_context(settings)
        self._checked = time.monotonic()
        self._failed_stamp: tuple[tuple[int, int, int] | None, ...] | None = None
        self.reloads = 0

    def _stat(self) -> tuple[tuple[int, int, int] | None, ...]:
        out: list[tuple[int, int, int] | None] = []
        for p in self._paths:
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def current(self) -> ssl.SSLContext:
        now = time.monotonic()
        if not self._paths or now - self._checked < self.CHECK_EVERY:
            return self._ctx
        with self._lock:
            self._checked = now
            stamp = self._stat()
            if stamp == self._stamp or stamp == self._failed_stamp:
                return self._ctx
            try:
                ctx = build_context(self.settings)
            except WebConfigError as e:
                self._failed_stamp = stamp
                log.warning("tls_reload_failed", error=str(e), keeping="previous certificate")
                return self._ctx
            self._ctx, self._stamp, self._failed_stamp = ctx, stamp, None
            self.reloads += 1
            log.info("tls_reloaded", files=self._paths)
            return ctx
