"""The addresses the server listens on: how they are written, and whether they can be listened on at all."""

from __future__ import annotations

import errno
import socket

from layerserve.errors import ConfigError


def address(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_can_listen(host: str, port: int, flag: str) -> None:
    """Bind `host:port` as the server will (SO_REUSEADDR), then let it go: a port taken by another program is a
    clear error at start, before any model loads, rather than a bind error once they have (or, for the gRPC port
    of several workers, which they share with SO_REUSEPORT, silently sharing it with another server).

    Raises:
        ConfigError: the port is in use, the host is not an address of this machine, or the port is privileged;
            the message names `flag`, the setting to change.
    """
    if port == 0:
        return
    where = address(host, port)
    try:
        # Every address the host names, as asyncio's create_server binds them (IPv6 ones IPv6-only).
        found = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
        for family, kind, protocol, _, sockaddr in found:
            with socket.socket(family, kind, protocol) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(sockaddr)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"cannot listen on {where}: another program listens there; stop it, or choose another port with {flag}"
            ) from None
        raise ConfigError(f"cannot listen on {where} ({flag}): {error.strerror or error}") from None


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` that other processes of this user may bind too (SO_REUSEPORT: a node's
    Ray replicas share their direct port, the kernel spreading connections over them).

    Raises:
        OSError: the port is held without SO_REUSEPORT, or by another user.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (SO_REUSEADDR), for worker processes to share.

    Raises:
        OSError: the port cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock
