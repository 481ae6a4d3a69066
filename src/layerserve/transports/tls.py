"""TLS for the doors: each door's certificate, key and client CA from the settings (`tls_*`, with the gRPC door's
`grpc_tls_*` overrides), checked at start with messages that name the file, and an SSL context that follows the
files: a renewed certificate is used for the connections that come after it (those open keep theirs)."""

from __future__ import annotations

import logging
import os
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from layerserve.errors import ConfigError
from layerserve.settings import Settings

log = logging.getLogger(__name__)

Door = Literal["http", "grpc"]
ALPN: dict[Door, list[str]] = {"http": ["http/1.1"], "grpc": ["h2"]}
CHECK_INTERVAL_S = 1.0  # how often, at most, a handshake looks whether the files changed
# A TLS connection's closing handshake (close_notify both ways) reads and decrypts what the client still sends; it
# is cut short after this (asyncio's default: 30 s).
SHUTDOWN_TIMEOUT_S = 2.0
_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


@dataclass(frozen=True)
class TlsFiles:
    """One door's TLS: its certificate chain, key (and its password), the CA of its clients (mutual TLS) or None,
    the oldest version it accepts, and the ALPN protocols it offers."""

    cert: Path
    key: Path
    password: str | None
    client_ca: Path | None
    min_version: str
    alpn: tuple[str, ...]

    def paths(self) -> list[Path]:
        """The files the context is made of."""
        return [self.cert, self.key, *([self.client_ca] if self.client_ca else [])]


def door_tls(settings: Settings, door: Door) -> TlsFiles | None:
    """The door's TLS files (the gRPC door's own where set, else the shared ones), or None: plaintext."""
    cert, key, client_ca = settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
    if door == "grpc" and settings.grpc_tls_cert_file is not None:
        cert, key = settings.grpc_tls_cert_file, settings.grpc_tls_key_file
    if door == "grpc" and settings.grpc_tls_client_ca_file is not None:
        client_ca = settings.grpc_tls_client_ca_file
    if cert is None or key is None:
        return None
    return TlsFiles(cert, key, settings.tls_key_password, client_ca, settings.tls_min_version, tuple(ALPN[door]))


def build_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context of these files.

    Raises:
        ConfigError: a file is missing or unreadable, is not PEM of what it should hold, or the key does not match
            the certificate (or its password is wrong); the message names the file.
    """
    for path, what in ((files.cert, "certificate"), (files.key, "key"), (files.client_ca, "client CA")):
        if path is None:
            continue
        if not path.exists():
            raise ConfigError(f"TLS {what} file {path}: no such file")
        if not path.is_file():
            raise ConfigError(f"TLS {what} file {path}: not a file")
        if not os.access(path, os.R_OK):
            raise ConfigError(f"TLS {what} file {path}: not readable by this process")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS[files.min_version]
    context.set_alpn_protocols(list(files.alpn))

    def no_password() -> bytes:  # instead of OpenSSL's prompt on the terminal
        raise ConfigError(f"TLS key file {files.key} is encrypted: give its password (tls_key_password)")

    try:
        context.load_cert_chain(files.cert, files.key, files.password if files.password is not None else no_password)
    except ssl.SSLError as error:
        raise ConfigError(_chain_problem(files, error)) from None
    if files.client_ca is not None:
        try:
            context.load_verify_locations(cafile=files.client_ca)
        except ssl.SSLError as error:
            raise ConfigError(f"TLS client CA file {files.client_ca}: not PEM certificates ({error.reason})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _chain_problem(files: TlsFiles, error: ssl.SSLError) -> str:
    """What is wrong with a certificate and key that do not load, naming the file."""
    reason = error.reason or str(error)
    if reason == "KEY_VALUES_MISMATCH":
        return f"TLS key file {files.key} does not match the certificate in {files.cert}"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=files.cert)
    except ssl.SSLError:
        return f"TLS certificate file {files.cert}: not a PEM certificate ({reason})"
    return f"TLS key file {files.key}: not a usable PEM private key, or a wrong password ({reason})"


class ServerTls:
    """The SSL context a door listens with. Each handshake (at most once a `CHECK_INTERVAL_S`) looks whether the
    files changed; if so, and they make a good context, that context serves the handshakes that follow. Files
    caught half-written (a key that does not yet match) are tried again on the next check; until then the last good
    context serves.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._current = build_context(files)
        self._signature = self._stat()
        self._checked = time.monotonic()
        self.context = self._current
        self.context.sni_callback = self._on_hello  # runs for every ClientHello, with or without a server name

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        signature = []
        for path in self.files.paths():
            try:
                found = path.stat()
                signature.append((found.st_ino, found.st_size, found.st_mtime_ns))
            except OSError:
                signature.append((0, 0, 0))
        return tuple(signature)

    def _on_hello(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        now = time.monotonic()
        if now - self._checked >= CHECK_INTERVAL_S:
            self._checked = now
            self.refresh()
        if connection.context is not self._current:
            connection.context = self._current

    def refresh(self) -> bool:
        """Re-read the files if they changed since the context in use was made; whether a new one is in use."""
        signature = self._stat()
        if signature == self._signature:
            return False
        try:
            context = build_context(self.files)
        except (ConfigError, OSError) as error:
            log.warning("TLS files changed but do not make a good context yet (the old one serves): %s", error)
            return False
        self._signature, self._current = signature, context
        log.info("TLS certificate %s re-read: new connections use it", self.files.cert)
        return True


def listen_options(tls: ServerTls | None, handshake_timeout_s: float) -> dict[str, Any]:
    """The `create_server` arguments of a door with `tls` (none for plaintext): its context, the time a client has
    for the handshake, and the bound on the closing one."""
    if tls is None:
        return {}
    return {
        "ssl": tls.context, "ssl_handshake_timeout": handshake_timeout_s, "ssl_shutdown_timeout": SHUTDOWN_TIMEOUT_S
    }  # fmt: skip


def server_tls(settings: Settings, door: Door) -> ServerTls | None:
    """The door's TLS (checked now), or None: plaintext.

    Raises:
        ConfigError: see build_context.
    """
    files = door_tls(settings, door)
    return None if files is None else ServerTls(files)


def check_tls(settings: Settings) -> None:
    """Check both doors' TLS files before serving (see build_context).

    Raises:
        ConfigError: a file is missing, unreadable or wrong, naming it.
    """
    for door in ALPN:
        files = door_tls(settings, door)
        if files is not None:
            build_context(files)
