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
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            where = address(host, port)
            if error.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"cannot listen on {where}: another program listens there; stop it, or choose another port "
                    f"with {flag}"
                ) from None
            raise ConfigError(f"cannot listen on {where} ({flag}): {error.strerror or error}") from None
