"""Board: the Ray Serve deployment (one replica, no CPU) where every layerserve replica posts how it stands
(ready or not, the last change it made, its metrics) each second, and where a change asked of one replica is
left for the others (see peers.py). It holds soft state only: restarted, it is whole again within a second."""

from __future__ import annotations

import time
import uuid
from typing import Any

STALE_S = 3.0  # a replica that has not posted for this long is gone (it posts every second)
BOARD_NAME = "layerserve-board"


class Board:
    """Posts by replica, and the log of changes (the latest of each family per model: a replica that starts
    late, or again, makes what is still in force)."""

    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, dict[str, Any]]] = {}
        self._ops: dict[tuple[str, str], tuple[int, str, dict[str, Any]]] = {}  # (model, family) -> seq, origin
        self._seq = 0
        self.epoch = uuid.uuid4().hex  # sequence numbers count within one life of the board

    async def post(self, snapshot: dict[str, Any]) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
        """Record a replica's snapshot; the board's epoch and the changes (others', in order) the replica has not
        received in this epoch."""
        identity = snapshot["identity"]
        self._posts[identity] = (time.monotonic(), snapshot)
        received = snapshot["received"] if snapshot["epoch"] == self.epoch else 0
        pending = [(seq, op) for seq, origin, op in self._ops.values() if seq > received and origin != identity]
        return self.epoch, sorted(pending, key=lambda item: item[0])

    async def tell(self, origin: str, op: dict[str, Any], family: str) -> tuple[str, int]:
        """Leave a change made by `origin` for every other replica; the epoch and its sequence number."""
        self._seq += 1
        self._ops[(op["model"], family)] = (self._seq, origin, op)
        return self.epoch, self._seq

    async def snapshots(self) -> list[dict[str, Any]]:
        """The last snapshot of every replica that posted in the last STALE_S seconds."""
        now = time.monotonic()
        for identity in [i for i, (at, _) in self._posts.items() if now - at > STALE_S]:
            del self._posts[identity]
        return [snapshot for _, snapshot in self._posts.values()]
