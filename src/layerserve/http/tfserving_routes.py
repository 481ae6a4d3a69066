"""TF Serving REST routes: model status, metadata and `:predict`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.http.bodies import JSONResponse, read_body
from layerserve.http.v2_routes import parse_version
from layerserve.protocols import tfserving
from layerserve.registry import ModelRegistry, ModelVersion, VersionState

_TF_STATES = {VersionState.LOADING: "LOADING", VersionState.READY: "AVAILABLE", VersionState.FAILED: "END"}


def _registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry = request.app.state.registry
    return registry


def _status(version: ModelVersion) -> dict[str, object]:
    error = "UNKNOWN" if version.state is VersionState.FAILED else "OK"
    return {
        "version": str(version.version),
        "state": _TF_STATES[version.state],
        "status": {"error_code": error, "error_message": version.reason},
    }


async def model_status(request: Request) -> Response:
    """GET /v1/models/{model}[/versions/{version}]."""
    registry = _registry(request)
    name, number = request.path_params["model"], parse_version(request)
    if number is not None:
        return JSONResponse({"model_version_status": [_status(registry.find(name, number))]})
    versions = registry.entry(name).versions
    return JSONResponse({"model_version_status": [_status(v) for _, v in sorted(versions.items(), reverse=True)]})


async def model_metadata(request: Request) -> Response:
    """GET /v1/models/{model}[/versions/{version}]/metadata."""
    version = _registry(request).get(request.path_params["model"], parse_version(request))
    return JSONResponse(
        {
            "model_spec": {"name": version.name, "signature_name": "", "version": str(version.version)},
            "metadata": {
                "signature_def": {"signature_def": {"serving_default": tfserving.signature_def(version.signature)}}
            },
        }
    )


async def predict(request: Request) -> Response:
    """POST /v1/models/{model}[/versions/{version}]:predict."""
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    version = _registry(request).get(request.path_params["model"], parse_version(request))
    parsed = tfserving.parse_predict_request(body, version.graph, version.encoded_input)
    inputs = await version.decode_encoded(parsed.inputs, request.app.state.decoder)
    outputs = await version.predict(inputs, parsed.outputs)
    return Response(tfserving.encode_predict_response(parsed, outputs), media_type="application/json")


routes = [
    Route("/v1/models/{model}:predict", predict, methods=["POST"]),
    Route("/v1/models/{model}/versions/{version}:predict", predict, methods=["POST"]),
    Route("/v1/models/{model}", model_status, methods=["GET"]),
    Route("/v1/models/{model}/versions/{version}", model_status, methods=["GET"]),
    Route("/v1/models/{model}/metadata", model_metadata, methods=["GET"]),
    Route("/v1/models/{model}/versions/{version}/metadata", model_metadata, methods=["GET"]),
]
