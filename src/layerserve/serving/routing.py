"""VersionRouter: which engine answers a batch, by its input names and outputs: the full model's, or a cut's."""

from __future__ import annotations

from collections.abc import Callable

from layerserve.engines.base import Engine
from layerserve.engines.process.engine import ProcessOnnxEngine
from layerserve.errors import EngineProcessError
from layerserve.serving.cuts import CutCache
from layerserve.serving.layers import LayerGraph
from layerserve.tensors import Array


class VersionRouter:
    """Model inputs in and model outputs out run on `engine` (the version's); any other names on the cut for them
    (built on first use, see CutCache). `on_engine_lost` hears when the engine's process is gone."""

    def __init__(
        self, engine: Engine, cuts: CutCache, graph: LayerGraph, on_engine_lost: Callable[[str], None]
    ) -> None:
        self.engine = engine
        self._cuts = cuts
        self._graph = graph
        self._inputs = tuple(spec.name for spec in graph.signature.inputs)
        self._outputs = tuple(spec.name for spec in graph.signature.outputs)
        self._on_engine_lost = on_engine_lost

    def is_full_model(self, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> bool:
        """Whether the model's own call answers these names (model inputs in, model outputs out)."""
        return self._graph.is_full_model(inputs, outputs)

    def sends_from_loop(self, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> bool:
        """Whether a batch of these names is sent from the event loop (`run_async`): the full model's, on an engine
        process. Any other batch runs on the model thread (`run`)."""
        return isinstance(self.engine, ProcessOnnxEngine) and self._graph.is_full_model(inputs, outputs)

    @property
    def lanes(self) -> int:
        """How many batches sent from the loop may run at once (the engine process session's lanes)."""
        return self.engine.lanes if isinstance(self.engine, ProcessOnnxEngine) else 1

    async def run_async(self, inputs: dict[str, Array], outputs: tuple[str, ...]) -> dict[str, Array]:
        """On the event loop: one full-model batch through the engine process (see `sends_from_loop`).

        Raises:
            EngineProcessError: the engine's process is gone (the version is told first).
        """
        assert isinstance(self.engine, ProcessOnnxEngine), "sends_from_loop says which batches come here"
        try:
            results = await self.engine.run_async([inputs[name] for name in self._inputs])
        except EngineProcessError as error:
            self._on_engine_lost(error.message)
            raise
        by_name = dict(zip(self._outputs, results, strict=True))
        return {name: by_name[name] for name in outputs}

    def run(self, inputs: dict[str, Array], outputs: tuple[str, ...]) -> dict[str, Array]:
        """On the model thread: one batch through the engine that answers its names.

        Raises:
            EngineProcessError: the engine's process is gone (the version is told first).
            BadRequestError: a cut whose outputs need a tensor the inputs do not give.
        """
        if self._graph.is_full_model(tuple(inputs), outputs):
            try:
                results = self.engine.run([inputs[name] for name in self._inputs])
            except EngineProcessError as error:
                self._on_engine_lost(error.message)
                raise
            by_name = dict(zip(self._outputs, results, strict=True))
            return {name: by_name[name] for name in outputs}
        cut = self._cuts.get(tuple(sorted(inputs)), tuple(sorted(set(outputs))))
        results = cut.engine.run([inputs[name] for name in cut.inputs])
        by_name = dict(zip(cut.outputs, results, strict=True))
        return {name: by_name[name] for name in outputs}
