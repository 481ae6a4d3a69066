"""run_timed: a load-generating process's event loop (uvloop where installed) and the CPU seconds it took."""

from __future__ import annotations

import asyncio
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
