"""RayPeers: one Ray Serve replica's view of the others, through the Board deployment (see board.py).

Each second a replica posts its snapshot (identity, group, ready, the last change it received and made, what
failed, its metrics) and gets back the changes other replicas were asked for, which it makes in order. A change
asked of this replica is left on the board, and `tell` returns once every other ready replica has made it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import REGISTRY

from layerserve.errors import LayerserveError, LoadFailedError, NotReadyError
from layerserve.lifecycle.peers import ControlOp
from layerserve.transports.ray.metric_sum import collect_families, exposition

log = logging.getLogger(__name__)

POST_EVERY_S = 1.0
_BOARD_TIMEOUT_S = 5.0
_FAILURES_KEPT = 20


class RayPeers:
    """Posts this replica's snapshot to the board, makes the others' changes, answers for every replica."""

    def __init__(self, board: Any, identity: str, group: str, groups: tuple[str, ...], tell_timeout_s: float) -> None:
        self._board = board  # a DeploymentHandle of the Board
        self.identity = identity
        self._group = group
        self._groups = groups
        self._tell_timeout_s = tell_timeout_s
        self._epoch = ""
        self._received = 0
        self._acked = 0
        self._failures: dict[int, str] = {}
        self._queue: asyncio.Queue[tuple[int, ControlOp]] = asyncio.Queue()

    async def run(self, make: Callable[[ControlOp], Awaitable[None]], is_ready: Callable[[], bool]) -> None:
        """Post every second and `make` what the board hands back, until cancelled."""
        maker = asyncio.create_task(self._make_forever(make))
        try:
            while True:
                with contextlib.suppress(Exception):  # the board restarting: the next post finds it
                    await self._post(is_ready())
                await asyncio.sleep(POST_EVERY_S)
        finally:
            maker.cancel()
            await asyncio.gather(maker, return_exceptions=True)

    async def tell(self, op: ControlOp) -> None:
        """Leave `op` (made here already) for the others and wait until every other ready replica has made it.

        Raises:
            LoadFailedError: another replica could not make it (409); it is made here.
            NotReadyError: the board cannot be reached, or a replica has not made it within the timeout (503).
        """
        try:
            epoch, seq = await self._call(self._board.tell.remote(self.identity, op.to_dict(), op.family))
        except Exception as error:  # any failure of the board is one answer
            raise NotReadyError(
                f"{op.kind} of {op.model} is made on this replica only: the replicas' board did not answer "
                f"({error!r}); the others find pins at their next poll"
            ) from None
        deadline = time.monotonic() + self._tell_timeout_s
        while True:
            others = [s for s in await self._snapshots() if s["identity"] != self.identity and s["ready"]]
            made = [s for s in others if s["epoch"] == epoch and s["acked"] >= seq]
            failed = [f"{s['identity']}: {s['failures'][seq]}" for s in made if seq in s["failures"]]
            if failed:
                raise LoadFailedError(f"{op.kind} of {op.model} is made here but failed on {'; '.join(failed)}")
            pending = [s["identity"] for s in others if s not in made]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise NotReadyError(
                    f"{op.kind} of {op.model} is made on this replica, but replicas {', '.join(pending)} have not "
                    f"made it within {self._tell_timeout_s:.0f} s"
                )
            await asyncio.sleep(0.2)

    async def is_every_group_ready(self) -> bool:
        """Whether every group has a replica that posted ready lately (this one counts for its own group)."""
        ready = {self._group}
        with contextlib.suppress(NotReadyError):
            ready |= {s["group"] for s in await self._snapshots() if s["ready"]}
        return ready >= set(self._groups)

    async def exposition(self, own: bytes) -> bytes:
        """Every replica's metrics (see metric_sum.exposition); this replica's own text if the board is away."""
        try:
            snapshots = await self._snapshots()
        except NotReadyError as error:
            log.warning("/metrics covers this replica only: %s", error.message)
            return own
        families = {s["identity"]: s["metrics"] for s in snapshots if s["identity"] != self.identity}
        families[self.identity] = collect_families(REGISTRY)
        return exposition(families)

    async def _post(self, ready: bool) -> None:
        snapshot = {
            "identity": self.identity, "group": self._group, "ready": ready, "epoch": self._epoch,
            "received": self._received, "acked": self._acked, "failures": dict(self._failures),
            "metrics": collect_families(REGISTRY),
        }  # fmt: skip
        epoch, ops = await self._call(self._board.post.remote(snapshot))
        if epoch != self._epoch:  # a new board: its numbers start again
            self._epoch, self._received, self._acked, self._failures = epoch, 0, 0, {}
        for seq, op in ops:
            if seq > self._received:
                self._received = seq
                self._queue.put_nowait((seq, ControlOp(**op)))

    async def _make_forever(self, make: Callable[[ControlOp], Awaitable[None]]) -> None:
        while True:
            seq, op = await self._queue.get()
            try:
                await make(op)
                log.info("made %s of %s, asked of another replica", op.kind, op.model)
            except LayerserveError as error:
                log.error("%s of %s, asked of another replica, failed here: %s", op.kind, op.model, error.message)
                self._failures[seq] = error.message
                while len(self._failures) > _FAILURES_KEPT:
                    del self._failures[min(self._failures)]
            self._acked = max(self._acked, seq)

    async def _snapshots(self) -> list[dict[str, Any]]:
        try:
            snapshots: list[dict[str, Any]] = await self._call(self._board.snapshots.remote())
        except Exception as error:  # any failure of the board is one answer
            raise NotReadyError(f"the replicas' board did not answer: {error!r}") from None
        return snapshots

    @staticmethod
    async def _call(response: Any) -> Any:
        return await asyncio.wait_for(response, _BOARD_TIMEOUT_S)
