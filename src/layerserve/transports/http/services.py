"""HttpServices: what the HTTP routes serve with, given by the composition root (see layerserve.server)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from starlette.requests import Request

from layerserve.control import ControlPlane
from layerserve.dataplane import DataPlane
from layerserve.settings import Settings
from layerserve.training.jobs import JobRunner


@dataclass(frozen=True)
class HttpServices:
    """The data and control planes, the settings, readiness, the metrics' text, the job runner, and the thread
    compressed bodies inflate on."""

    data: DataPlane
    control: ControlPlane
    settings: Settings
    is_ready: Callable[[], bool]
    readiness: Callable[[], Awaitable[bool]]
    exposition: Callable[[], Awaitable[bytes]]
    jobs: Callable[[], JobRunner]
    inflater: Executor | None = None  # None: the loop's default executor


def services(request: Request) -> HttpServices:
    """The services of the app that answers `request`."""
    found: HttpServices = request.app.state.services
    return found
