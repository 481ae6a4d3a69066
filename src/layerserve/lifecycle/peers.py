"""Peers: the other servers of one deployment (Ray Serve replicas), as one of them sees them; ControlOp, a change
to the repository's serving state that every one of them makes.

One server with its workers needs none of this (the worker board and the shared metrics folder cover it). On Ray
Serve each replica is a server of its own: a load, unload or apply asked of one replica is told to the others,
and answers once they have made it; /metrics and readiness cover every replica (see transports/ray/peers.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

ControlKind = Literal["load", "unload", "apply", "unpin"]


@dataclass(frozen=True)
class ControlOp:
    """`load` (with an optional config), `unload`, `apply` (a version number) or `unpin` of one model."""

    kind: ControlKind
    model: str
    config: dict[str, Any] | None = None
    version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain values, to send to another process."""
        return asdict(self)

    @property
    def family(self) -> str:
        """Ops of one family replace each other: a later unload undoes a load, a later unpin an apply."""
        return "pin" if self.kind in ("apply", "unpin") else "presence"


class Peers(Protocol):
    """What one replica knows of, and tells, the others."""

    async def run(self, make: Callable[[ControlOp], Awaitable[None]], is_ready: Callable[[], bool]) -> None:
        """Until cancelled: tell the others how this replica stands, and `make` what they were asked."""

    async def tell(self, op: ControlOp) -> None:
        """Have every other ready replica make `op` (done here already); return once they have."""

    async def is_every_group_ready(self) -> bool:
        """Whether every group of the deployment has a ready replica."""

    async def exposition(self, own: bytes) -> bytes:
        """The Prometheus text of every replica (`own`: this replica's, used when the others cannot be asked)."""
