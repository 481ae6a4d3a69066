"""TF Serving REST routes: model status, metadata, `:predict`, `:classify` and `:regress`, by version or label."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.messages import InferRequest, InferResponse
from layerserve.protocols import tfserving, tfserving_examples
from layerserve.serving.registry import ModelRegistry, ModelVersion, VersionState
from layerserve.tensors import Array
from layerserve.transports.http.bodies import JSONResponse, read_body
from layerserve.transports.http.v2_routes import parse_version

_TF_STATES = {VersionState.LOADING: "LOADING", VersionState.READY: "AVAILABLE", VersionState.FAILED: "END"}


def _registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry = request.app.state.runtime.registry
    return registry


def _version_number(request: Request) -> int | None:
    """The path's `{version}`, or the version its `{label}` names; None where the path has neither.

    Raises:
        BadRequestError: a malformed version.
        NotFoundError: an unknown model or label.
    """
    label = request.path_params.get("label")
    if label is None:
        return parse_version(request)
    return _registry(request).label_version(request.path_params["model"], label)


def _status(version: ModelVersion) -> dict[str, object]:
    error = "UNKNOWN" if version.state is VersionState.FAILED else "OK"
    return {
        "version": str(version.version),
        "state": _TF_STATES[version.state],
        "status": {"error_code": error, "error_message": version.reason},
    }


async def _infer(
    request: Request, version: ModelVersion, inputs: dict[str, Array], outputs: tuple[str, ...]
) -> dict[str, Array]:
    """The data plane's answer for the leased `version`: the outputs (all, if none is named) by name."""
    asked = InferRequest(version.name, inputs, outputs, version.version)
    answer: InferResponse = await request.app.state.runtime.data.infer_on(version, asked)
    return answer.outputs


async def _examples(request: Request, version: ModelVersion) -> dict[str, Array]:
    """The inputs of a `:classify` or `:regress` body (texts and images still encoded)."""
    body = await read_body(request, request.app.state.runtime.settings.max_body_bytes)
    return tfserving_examples.parse_examples_request(body, version.graph, version.encoded_input)


async def model_status(request: Request) -> Response:
    """GET /v1/models/{model}[/versions/{version}|/labels/{label}]."""
    registry = _registry(request)
    name, number = request.path_params["model"], _version_number(request)
    if number is not None:
        return JSONResponse({"model_version_status": [_status(registry.find(name, number))]})
    versions = registry.entry(name).versions
    return JSONResponse({"model_version_status": [_status(v) for _, v in sorted(versions.items(), reverse=True)]})


async def model_metadata(request: Request) -> Response:
    """GET /v1/models/{model}[/versions/{version}|/labels/{label}]/metadata."""
    async with _registry(request).lease(request.path_params["model"], _version_number(request)) as version:
        signature_defs = {tfserving.SIGNATURE_NAME: tfserving.signature_def(version.signature)}
        return JSONResponse(
            {
                "model_spec": {"name": version.name, "signature_name": "", "version": str(version.version)},
                "metadata": {"signature_def": {"signature_def": signature_defs}},
            }
        )


async def predict(request: Request) -> Response:
    """POST /v1/models/{model}[/versions/{version}|/labels/{label}]:predict."""
    body = await read_body(request, request.app.state.runtime.settings.max_body_bytes)
    async with _registry(request).lease(request.path_params["model"], _version_number(request)) as version:
        parsed = tfserving.parse_predict_request(body, version.graph, version.encoded_input)
        outputs = await _infer(request, version, parsed.inputs, parsed.outputs)
        return Response(tfserving.encode_predict_response(parsed, outputs), media_type="application/json")


async def classify(request: Request) -> Response:
    """POST /v1/models/{model}[/versions/{version}|/labels/{label}]:classify: the classes of each example."""
    async with _registry(request).lease(request.path_params["model"], _version_number(request)) as version:
        output = version.classify_output
        scores = (await _infer(request, version, await _examples(request, version), (output,)))[output]
        return Response(
            tfserving_examples.encode_classifications(scores, version.labels), media_type="application/json"
        )


async def regress(request: Request) -> Response:
    """POST /v1/models/{model}[/versions/{version}|/labels/{label}]:regress: one value per example."""
    async with _registry(request).lease(request.path_params["model"], _version_number(request)) as version:
        output = tfserving_examples.regression_output(version.signature)
        values = (await _infer(request, version, await _examples(request, version), (output,)))[output]
        return Response(tfserving_examples.encode_regressions(values), media_type="application/json")


PREFIXES = ("/v1/models/{model}", "/v1/models/{model}/versions/{version}", "/v1/models/{model}/labels/{label}")

routes = [
    *(Route(f"{p}:{verb.__name__}", verb, methods=["POST"]) for p in PREFIXES for verb in (predict, classify, regress)),
    *(Route(prefix, model_status, methods=["GET"]) for prefix in PREFIXES),
    *(Route(f"{prefix}/metadata", model_metadata, methods=["GET"]) for prefix in PREFIXES),
]
