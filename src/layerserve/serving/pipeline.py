"""Pipelines: a model whose config.yaml lists `pipeline:` steps (other models of the repository) is served as one
version. Its signature is the first step's inputs and the last step's output; a request runs each step on the step
model's version as that model serves it (its batcher, its engine, its cache), so each step batches with the step
model's other requests. Connecting checks every step once when the pipeline loads (names, datatypes and shapes that
meet, no circle); a step model swapped since is checked again on the first request that meets it."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from layerserve.errors import (
    BadRequestError,
    BudgetFullError,
    DeadlineExceededError,
    LayerserveError,
    ModelLoadError,
    NotFoundError,
    NotReadyError,
)
from layerserve.features.labels import load_labels
from layerserve.lifecycle.model import Signature
from layerserve.serving.input_codec import InputCodec
from layerserve.serving.layers import LayerGraph
from layerserve.serving.request_checks import RequestChecks
from layerserve.serving.statistics import StepStatistics
from layerserve.settings import ModelConfig, PipelineStep
from layerserve.tensors import Array, TensorSpec
from layerserve.tracing import span

NO_LAYERS = "a pipeline answers its last step's output; each step's model answers its own layers"


class StepVersion(Protocol):
    """What a pipeline uses of a step's version (a ModelVersion)."""

    name: str
    version: int
    fingerprint: tuple[object, ...]
    signature: Signature
    graph: LayerGraph
    codec: InputCodec | None

    @property
    def max_batch_size(self) -> int:
        """The most rows one model call takes."""

    async def predict(
        self, inputs: dict[str, Array], outputs: tuple[str, ...] = (), timeout_ms: int | None = None,
        use_cache: bool = True,
    ) -> dict[str, Array]:  # fmt: skip
        """Answer one checked request."""

    def release(self) -> None:
        """The end of a hold."""


class StepSource(Protocol):
    """Where a pipeline finds its steps' models (the reloader)."""

    def config_of(self, model: str) -> ModelConfig | None:
        """A repository model's config (None: no such model)."""

    async def step_for_load(self, model: str, version: int | None) -> StepVersion:
        """The READY version a step names, as a pipeline's load checks it (loaded first if it is listed)."""

    async def hold(self, model: str, version: int | None) -> StepVersion:
        """The READY version a step names, held for one request (loaded on demand if it is listed)."""


@dataclass(frozen=True)
class Link:
    """One step as connected: its model and version (None: the one a request without one gets), the tensor that
    takes the previous step's output ("" for the first step) and the output handed on, with their specs."""

    number: int
    model: str
    version: int | None
    input: str
    output: str
    input_spec: TensorSpec | None
    output_spec: TensorSpec

    @property
    def title(self) -> str:
        """`step 2 (model 'head')`, for messages."""
        return f"step {self.number} (model '{self.model}')"


def pipeline_depth(model: str, config_of: Callable[[str], ModelConfig | None]) -> int:
    """0 for a model that is no pipeline, else 1 + its deepest step's (models load in this order: steps first); a
    circle counts as no deeper (its pipelines fail to load, naming it)."""
    depths: dict[str, int] = {}

    def depth(name: str, trail: frozenset[str]) -> int:
        if name in depths:
            return depths[name]
        config = config_of(name)
        if config is None or config.pipeline is None or name in trail:
            return 0
        depths[name] = 1 + max(depth(step.model, trail | {name}) for step in config.pipeline)
        return depths[name]

    return depth(model, frozenset())


def find_circle(model: str, steps: list[PipelineStep], config_of: Callable[[str], ModelConfig | None]) -> str:
    """Why the steps lead back to a model already on the way (`step 2 (model 'b') leads back: a -> b -> a`), or ""."""

    def walk(name: str, trail: list[str]) -> list[str]:
        config = config_of(name)
        for step in (config.pipeline or []) if config is not None else []:
            if step.model in trail:
                return [*trail, step.model]
            found = walk(step.model, [*trail, step.model])
            if found:
                return found
        return []

    for number, step in enumerate(steps, 1):
        trail = [model, step.model] if step.model == model else walk(step.model, [model, step.model])
        if trail:
            return f"step {number} (model '{step.model}') leads back to a model on the way: {' -> '.join(trail)}"
    return ""


def _only(specs: tuple[TensorSpec, ...], role: str, title: str) -> str:
    if len(specs) != 1:
        names = ", ".join(spec.name for spec in specs)
        raise ModelLoadError(f"{title} has {len(specs)} {role}s ({names}): name the one to use with '{role}'")
    return specs[0].name


def _meets(given: TensorSpec, taken: TensorSpec) -> bool:
    """Whether a tensor of spec `given` fits an input of spec `taken` (-1: any size)."""
    if given.datatype != taken.datatype or len(given.shape) != len(taken.shape):
        return False
    return all(a == b or -1 in (a, b) for a, b in zip(given.shape, taken.shape, strict=True))


def _reading(codec: InputCodec | None) -> tuple[object, ...]:
    """How a step's model reads requests (its config's digest and its tokenizer): a pipeline reads as its first's."""
    return (codec.config_digest, codec.tokenizer) if codec else ("", None)


def _describe(spec: TensorSpec) -> str:
    return f"{spec.datatype} {list(spec.shape)}"


def _link(number: int, step: PipelineStep, version: StepVersion, previous: Link | None) -> Link:
    """One step connected to the previous one's output.

    Raises:
        ModelLoadError: a name the step's model does not have, or a tensor that does not fit, naming the step.
    """
    title = f"step {number} (model '{step.model}' version {version.version})"
    graph = version.graph
    try:
        output = step.output or _only(version.signature.outputs, "output", title)
        output_spec = graph.spec(output, "output")
        if previous is None:
            return Link(number, step.model, step.version, "", output, None, output_spec)
        name = step.input or _only(version.signature.inputs, "input", title)
        input_spec = graph.spec(name, "input")
        model_inputs = {spec.name for spec in version.signature.inputs}
        if name in model_inputs and len(model_inputs) > 1:
            raise ModelLoadError(
                f"{title} has inputs {', '.join(sorted(model_inputs))}: a step is fed one tensor, the previous "
                "step's output"
            )
        if name not in model_inputs:
            graph.check_cut((name,), (output,))
    except (BadRequestError, NotFoundError) as error:
        raise ModelLoadError(f"{title}: {error.message}") from None
    if not _meets(previous.output_spec, input_spec):
        raise ModelLoadError(
            f"{title}: its input '{name}' takes {_describe(input_spec)}, but step {previous.number}'s output "
            f"'{previous.output}' gives {_describe(previous.output_spec)}"
        )
    return Link(number, step.model, step.version, name, output, input_spec, output_spec)


@dataclass
class Pipeline:
    """A connected pipeline: what it serves as (signature, graph, codec, checks) and its steps (see the module)."""

    name: str
    links: tuple[Link, ...]
    signature: Signature
    graph: LayerGraph
    codec: InputCodec
    checks: RequestChecks
    statistics: list[StepStatistics]
    max_batch_size: int
    digest: str
    source: StepSource
    timeout_ms: int
    checked: dict[int, tuple[object, ...]]  # step number -> (version, files) of the step version last checked
    reading: tuple[object, ...]  # how the first step's model read requests when connected (_reading)
    last_labels: list[str] | None  # the last step's labels, where the pipeline answers with them

    @classmethod
    async def connect(
        cls, name: str, config: ModelConfig, folder: Path, source: StepSource, timeout_ms: int
    ) -> Pipeline:
        """Find and check every step of `config.pipeline` (the version's `folder` holds its labels, if any).

        Raises:
            ModelLoadError: a step's model is missing, not ready, leads back round, or does not connect.
        """
        steps = config.pipeline or []
        circle = find_circle(name, steps, source.config_of)
        if circle:
            raise ModelLoadError(circle)
        links: list[Link] = []
        versions: list[StepVersion] = []
        for number, step in enumerate(steps, 1):
            if source.config_of(step.model) is None:
                raise ModelLoadError(f"step {number}: the repository has no model '{step.model}'")
            try:
                version = await source.step_for_load(step.model, step.version)
            except BudgetFullError as error:  # no room now: the pipeline stays listed, and a later request tries again
                raise BudgetFullError(f"step {number} (model '{step.model}'): {error.message}") from None
            except LayerserveError as error:
                raise ModelLoadError(f"step {number} (model '{step.model}'): {error.message}") from None
            links.append(_link(number, step, version, links[-1] if links else None))
            versions.append(version)
        first, last = versions[0], versions[-1]
        output = links[-1].output_spec
        signature = Signature(first.signature.inputs, (output,))
        graph = LayerGraph(signature)
        graph.unavailable_reason = NO_LAYERS
        step_codec = first.codec
        labels, last_labels = None, None
        if config.labels:
            labels = load_labels(folder.parent, config.labels)
        elif last.codec is not None and last.codec.classify_output == output.name:
            labels = last_labels = last.codec.labels
        described = config.model_dump_json() + "".join(f"|{v.name}:{v.version}" for v in versions)
        digest = hashlib.sha256(described.encode()).hexdigest()[:16]
        codec = InputCodec(
            name, signature, output.name, step_codec.image if step_codec else None,
            step_codec.tokenizer if step_codec else None, labels, digest,
        )  # fmt: skip
        checks = RequestChecks(graph, codec.encoded_input, codec.image is not None)
        statistics = [StepStatistics(link.model, link.output) for link in links]
        checked: dict[int, tuple[object, ...]] = {
            link.number: (v.version, v.fingerprint) for link, v in zip(links, versions, strict=True)
        }
        return cls(
            name, tuple(links), signature, graph, codec, checks, statistics, first.max_batch_size, digest, source,
            timeout_ms, checked, _reading(first.codec), last_labels,
        )  # fmt: skip

    def describe(self) -> str:
        """`pipeline: a (pool) -> b (scores)`, for the version's engine reason."""
        return "pipeline: " + " -> ".join(f"{link.model} ({link.output})" for link in self.links)

    async def run(self, inputs: dict[str, Array], outputs: tuple[str, ...], timeout_ms: int | None) -> dict[str, Array]:
        """Run the steps one after the other, each on its model's version as served, within one deadline.

        Raises:
            BadRequestError: `outputs` names anything but the pipeline's output.
            NotReadyError: a step's model cannot serve now, or no longer fits the pipeline (503).
            DeadlineExceededError: the steps did not finish within `timeout_ms` (default: the server's) (504).
        """
        wanted = self.signature.outputs[0].name
        if any(name != wanted for name in outputs):
            raise BadRequestError(f"pipeline '{self.name}' answers its output '{wanted}' only")
        expected = [spec.name for spec in self.signature.inputs]
        if sorted(inputs) != sorted(expected):
            raise BadRequestError(
                f"pipeline '{self.name}' takes its inputs {', '.join(expected)}, got {', '.join(sorted(inputs))}: a "
                "pipeline cannot start at a layer"
            )
        budget_ms = timeout_ms if timeout_ms is not None else self.timeout_ms
        deadline = time.monotonic() + budget_ms / 1000
        current: dict[str, Array] = inputs
        answer: Array | None = None
        for link, counted in zip(self.links, self.statistics, strict=True):
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise DeadlineExceededError(
                    f"pipeline '{self.name}' did not reach {link.title} within its {budget_ms} ms"
                )
            answer = await self._step(link, counted, current, remaining_ms)
            current = {self.links[link.number].input: answer} if link.number < len(self.links) else {}
        assert answer is not None
        return {wanted: answer}

    async def _step(
        self, link: Link, counted: StepStatistics, inputs: dict[str, Array], timeout_ms: int
    ) -> Array:  # fmt: skip
        started, is_success = time.perf_counter(), False
        attributes = {"layerserve.pipeline": self.name, "layerserve.step": link.number, "layerserve.model": link.model}
        with span("pipeline step", attributes) as traced:
            try:
                version = await self.source.hold(link.model, link.version)
            except (NotFoundError, NotReadyError) as error:
                raise NotReadyError(f"pipeline '{self.name}' {link.title}: {error.message}") from None
            try:
                if traced is not None:
                    traced.set_attribute("layerserve.version", version.version)
                self._check(link, version)
                computed = await version.predict(inputs, (link.output,), timeout_ms)
                is_success = True
                return computed[link.output]
            finally:
                version.release()
                counted.record(is_success, time.perf_counter() - started, version.version)

    def _check(self, link: Link, version: StepVersion) -> None:
        """Check a step's version again when it is not the one last checked (its model was swapped meanwhile).

        Raises:
            NotReadyError: it no longer takes or gives what the pipeline was connected for.
        """
        identity = (version.version, version.fingerprint)
        if self.checked.get(link.number) == identity:
            return
        graph, problem = version.graph, ""
        try:
            given = graph.spec(link.output, "output")
            if given != link.output_spec:
                problem = f"its '{link.output}' is {_describe(given)}, was {_describe(link.output_spec)}"
            taken = graph.spec(link.input, "input") if link.input else None
            if taken is not None and link.input_spec is not None and taken != link.input_spec:
                problem = f"its '{link.input}' is {_describe(taken)}, was {_describe(link.input_spec)}"
            if link.number == 1 and version.signature.inputs != self.signature.inputs:
                problem = "its inputs are not the pipeline's any more"
            elif link.number == 1 and _reading(version.codec) != self.reading:
                problem = "it reads requests otherwise than the pipeline was connected for"
            labels = version.codec.labels if version.codec else None
            if link.number == len(self.links) and self.last_labels is not None and labels != self.last_labels:
                problem = "its labels are not those the pipeline was connected with"
        except (BadRequestError, NotFoundError) as error:
            problem = error.message
        if problem:
            raise NotReadyError(
                f"pipeline '{self.name}' {link.title} version {version.version} no longer fits the pipeline: "
                f"{problem}; the pipeline connects again at the next poll"
            )
        self.checked[link.number] = identity
