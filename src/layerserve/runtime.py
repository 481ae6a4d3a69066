"""Runtime: everything one server process serves with, built once from Settings: the registry of models, the
reloader, the data and control planes over them, the caches, the job runner; started and closed by the Server."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import REGISTRY, generate_latest

from layerserve.control import ControlPlane
from layerserve.dataplane import DataPlane
from layerserve.errors import LayerserveError, NotReadyError
from layerserve.features.cache import CacheBackend, FeatureCache, InProcessBackend, RedisBackend, wait_closed
from layerserve.features.feature_store import FeatureStore
from layerserve.features.images import ImageDecoder
from layerserve.lifecycle.peers import Peers
from layerserve.lifecycle.reloader import Reloader
from layerserve.lifecycle.worker_board import WorkerBoard
from layerserve.metric_files import exposition_here, exposition_of_files
from layerserve.metrics import (
    GAUGES_SAMPLED,
    MODEL_MEMORY_BUDGET_BYTES,
    MODEL_RESIDENT_BYTES,
    QUEUED,
    sample_process,
    set_version_memory,
)
from layerserve.serving.registry import ModelRegistry
from layerserve.settings import Settings
from layerserve.training.job_store import Job, open_job_store, records_dir
from layerserve.training.jobs import JobRunner
from layerserve.training.launchers import TrainingLauncher

log = logging.getLogger(__name__)

_JOB_RECORDS_TIMEOUT_S = 5.0  # a job record is worth waiting for (redis_timeout_ms is the feature cache's)


class Runtime:
    """The registry of models (and its engine processes), the reloader, the data plane and the control plane over
    them, the feature cache and store, the image decoding pool and the job runner of one server process.

    Built from `Settings` without starting anything; `start()` loads the models (in the background, or, with
    a worker `board` or `settle_first`, before it returns) and starts polling, sampling and the job runner;
    `close()` stops them.
    """

    def __init__(
        self, settings: Settings, board: WorkerBoard | None = None, settle_first: bool = False,
        peers: Peers | None = None, launcher: TrainingLauncher | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.board = board
        self.peers = peers
        self._launcher = launcher
        self._settle_first = settle_first or board is not None
        self._cache_backend: CacheBackend = (
            RedisBackend(settings.redis_url, settings.redis_timeout_ms / 1000)
            if settings.redis_url
            else InProcessBackend(settings.cache_max_bytes)
        )
        store_backend = self._cache_backend if settings.redis_url else InProcessBackend(settings.feature_store_bytes)
        cache = FeatureCache(self._cache_backend, settings.cache_ttl_s, settings.cache_key_prefix)
        self.registry = ModelRegistry(settings, cache)
        self.reloader = Reloader(self.registry)
        self._decode_pool = ThreadPoolExecutor(
            settings.decode_threads or os.cpu_count(), thread_name_prefix="image-decoder"
        )
        self.decoder = ImageDecoder(self._decode_pool, settings.max_image_pixels)
        self.feature_store = FeatureStore(store_backend, settings.cache_key_prefix)
        self.control = ControlPlane(settings, self.reloader, peers)
        on_demand = self.control.load_on_demand if settings.loads_on_demand else None
        self.data = DataPlane(self.registry, self.decoder, self.feature_store, on_demand)
        self._jobs: JobRunner | None = None
        self._jobs_error = "training jobs are unavailable: the runtime has not started"
        self.draining = threading.Event()  # set when shutdown begins: readiness turns false
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def is_ready(self) -> bool:
        """Every model has settled (in every worker), and shutdown has not begun."""
        return self.registry.is_ready and not self.draining.is_set() and (self.board is None or self.board.is_ready())

    async def readiness(self) -> bool:
        """`is_ready`, and on Ray Serve also every group of replicas has a ready one."""
        return self.is_ready and (self.peers is None or await self.peers.is_every_group_ready())

    async def wait_settled(self) -> None:
        """Return once every model that should load has settled (READY or FAILED)."""
        await self.registry.wait_settled()

    def jobs(self) -> JobRunner:
        """The job runner.

        Raises:
            NotReadyError: its records could not be opened at start-up, or the runtime has not started (503).
        """
        if self._jobs is None:
            raise NotReadyError(self._jobs_error)
        return self._jobs

    async def exposition(self) -> bytes:
        """This process's metrics, or with several workers every worker's, summed per metric (on Ray Serve, every
        replica's: see transports/ray/metric_sum.py), freshly sampled, in Prometheus text format."""
        text = await asyncio.to_thread(self._sampled_exposition)
        if self.peers is not None:
            text = await self.peers.exposition(text)
        return text

    async def start(self) -> None:
        """Load the models and keep them in sync with the repository; sample the process; open the job runner.
        With a worker board (or `settle_first`: a Ray Serve replica), return only once the models have settled
        (then it takes traffic)."""
        self._tasks = [asyncio.create_task(self._keep_in_sync()), asyncio.create_task(self._sample_forever())]
        if self.peers is not None:
            is_ready = lambda: self.registry.is_ready and not self.draining.is_set()  # noqa: E731
            self._tasks.append(asyncio.create_task(self.control.keep_in_step(is_ready)))
        self._jobs, self._jobs_error = self._open_jobs()
        if self._settle_first:
            await self.registry.wait_settled()
        if self.board is not None:
            self.board.mark_ready()

    async def close(self) -> None:
        """Stop taking traffic, stop the jobs, the polling and the sampling, and free every model and pool."""
        if self.board is not None:
            self.board.withdraw()
        if self._jobs is not None:
            await self._jobs.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Off the loop: a batch sent from the loop to an engine process gets its answer while the engines close.
        await asyncio.get_running_loop().run_in_executor(None, self.registry.close)
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        await wait_closed(self._cache_backend)

    def _sampled_exposition(self) -> bytes:
        with GAUGES_SAMPLED:
            self._sample_process(with_gpu=True)
            if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
                return generate_latest(REGISTRY)
            try:
                return exposition_of_files()
            except RuntimeError as error:  # the text is still worth having, at the cost the child spares
                log.warning("%s; made in this worker instead", error)
                return exposition_here()

    def sample_process(self, with_gpu: bool = True) -> None:
        """Refresh this process's CPU and memory gauges (its engine processes counted in) and its queue depths."""
        with GAUGES_SAMPLED:
            self._sample_process(with_gpu)

    def _sample_process(self, with_gpu: bool) -> None:
        sample_process(self.registry.engine_processes.usage(), with_gpu)
        resident = 0
        for entry in list(self.registry.models.values()):
            for version in list(entry.versions.values()):
                if version.is_ready:
                    QUEUED.labels(version.name, str(version.version)).set(version.queued)
                    memory = version.memory()
                    set_version_memory(version.name, version.version, memory)
                    resident += memory["total_bytes"]
        MODEL_RESIDENT_BYTES.set(resident)
        MODEL_MEMORY_BUDGET_BYTES.set(self.settings.model_memory_budget)

    async def _keep_in_sync(self) -> None:
        await self.reloader.start()
        # TensorFlow and Keras leave millions of long-lived objects; a full garbage collection walks them
        # all (about 0.2 s holding the GIL). Freezing what start-up made keeps collections short after.
        gc.collect()
        gc.freeze()
        if self.settings.reload_interval_s > 0:
            await self.reloader.run(self.settings.reload_interval_s)

    async def _sample_forever(self, every_s: float = 1.0, gpu_every: int = 5) -> None:
        """Keep the process gauges (and, less often, GPU memory) fresh; with several workers /metrics sums every
        worker's last sample."""
        for count in itertools.count():
            await asyncio.to_thread(self.sample_process, count % gpu_every == 0)
            await asyncio.sleep(every_s)

    async def _serve_new_version(self, job: Job) -> None:
        assert job.version is not None
        if job.apply:
            await self.control.apply(job.model, job.version)
        elif self.settings.loads_on_demand:
            await self.control.refresh(job.model)  # listed, loaded on its first request (or now, if it serves)
        else:
            await self.control.load(job.model)

    def _open_jobs(self) -> tuple[JobRunner | None, str]:
        """The job runner, or None and why (fail-soft: serving goes on without training jobs). Its records are
        in Redis with `redis_url` (replicas on several machines share them), else in SQLite."""
        settings = self.settings
        folder = records_dir(settings.jobs_dir, settings.model_repository)
        if settings.jobs_dir is None and folder.parent != settings.model_repository:
            log.info(
                "the repository %s cannot be written: training job records are kept in %s",
                settings.model_repository,
                folder,
            )
        try:
            store = open_job_store(folder, settings.redis_url, settings.cache_key_prefix, _JOB_RECORDS_TIMEOUT_S)
            runner = JobRunner(
                folder, settings.training_threads, settings.model_repository, self._serve_new_version, store,
                self._launcher,
            )  # fmt: skip
        except (OSError, sqlite3.Error, LayerserveError) as error:
            where = "Redis" if settings.redis_url else folder
            reason = f"training jobs are unavailable: {where}: {error}"
            log.error("%s", reason)
            return None, reason
        return runner, ""
