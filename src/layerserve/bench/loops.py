"""What the load generator's client processes share: run_timed (an event loop of their own, uvloop where installed, and
the CPU seconds it took) and client_tls (their TLS context for an https URL)."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any


def run_timed(main: Callable[[], Coroutine[Any, Any, None]]) -> float:
    """Run `main()` to the end on a new event loop; the CPU seconds this process spent meanwhile."""
    cpu_started = time.process_time()
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    return time.process_time() - cpu_started


def client_tls(alpn: str) -> ssl.SSLContext:
    """The load generator's TLS context (for an https URL): the system's CAs, or those of SSL_CERT_FILE (which
    `layerserve bench --tls-ca-file` sets), offering `alpn`."""
    context = ssl.create_default_context()
    context.set_alpn_protocols([alpn])
    return context
