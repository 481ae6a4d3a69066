"""TF Serving REST routes: model status, metadata, `:predict`, `:classify` and `:regress`, by version or label."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.dataplane import VersionStatus, VersionView
from layerserve.messages import InferRequest
from layerserve.protocols import tfserving, tfserving_examples
from layerserve.tensors import Array
from layerserve.tracing import span
from layerserve.transports.http.bodies import JSONResponse, read_body
from layerserve.transports.http.services import services
from layerserve.transports.http.v2_routes import parse_version

# TF Serving's START: "tracked, no action taken yet", as a version listed and not loaded (on demand).
_TF_STATES = {"UNAVAILABLE": "START", "LOADING": "LOADING", "READY": "AVAILABLE", "FAILED": "END"}


def _version_number(request: Request) -> int | None:
    """The path's `{version}`, or the version its `{label}` names; None where the path has neither.

    Raises:
        BadRequestError: a malformed version.
        NotFoundError: an unknown model or label.
    """
    label = request.path_params.get("label")
    if label is None:
        return parse_version(request)
    return services(request).data.label_version(request.path_params["model"], label)


def _status(status: VersionStatus) -> dict[str, object]:
    error = "UNKNOWN" if status.state == "FAILED" else "OK"
    return {
        "version": str(status.version),
        "state": _TF_STATES[status.state],
        "status": {"error_code": error, "error_message": status.reason},
    }


async def _infer(view: VersionView, inputs: dict[str, Array], outputs: tuple[str, ...]) -> dict[str, Array]:
    """The view's answer: the outputs (all, if none is named) by name."""
    return (await view.infer(InferRequest(view.model, inputs, outputs, view.version))).outputs


async def _examples(request: Request, view: VersionView) -> dict[str, Array]:
    """The inputs of a `:classify` or `:regress` body (texts and images still encoded)."""
    body = await read_body(request, services(request).settings.max_body_bytes)
    return tfserving_examples.parse_examples_request(body, view.graph, view.encoded_input)


def _open(request: Request) -> VersionView:
    """The version the path names (by number or label), to hold in an `async with`."""
    return services(request).data.open(request.path_params["model"], _version_number(request))


async def model_status(request: Request) -> Response:
    """GET /v1/models/{model}[/versions/{version}|/labels/{label}]."""
    statuses = services(request).data.version_status(request.path_params["model"], _version_number(request))
    return JSONResponse({"model_version_status": [_status(status) for status in statuses]})


async def model_metadata(request: Request) -> Response:
    """GET /v1/models/{model}[/versions/{version}|/labels/{label}]/metadata."""
    async with _open(request) as view:
        signature_defs = {tfserving.SIGNATURE_NAME: tfserving.signature_def(view.signature)}
        return JSONResponse(
            {
                "model_spec": {"name": view.model, "signature_name": "", "version": str(view.version)},
                "metadata": {"signature_def": {"signature_def": signature_defs}},
            }
        )


async def predict(request: Request) -> Response:
    """POST /v1/models/{model}[/versions/{version}|/labels/{label}]:predict."""
    body = await read_body(request, services(request).settings.max_body_bytes)
    async with _open(request) as view:
        with span("decode"):
            parsed = tfserving.parse_predict_request(body, view.graph, view.encoded_input)
        outputs = await _infer(view, parsed.inputs, parsed.outputs)
        with span("encode"):
            return Response(tfserving.encode_predict_response(parsed, outputs), media_type="application/json")


async def classify(request: Request) -> Response:
    """POST /v1/models/{model}[/versions/{version}|/labels/{label}]:classify: the classes of each example."""
    async with _open(request) as view:
        output = view.classify_output
        scores = (await _infer(view, await _examples(request, view), (output,)))[output]
        return Response(tfserving_examples.encode_classifications(scores, view.labels), media_type="application/json")


async def regress(request: Request) -> Response:
    """POST /v1/models/{model}[/versions/{version}|/labels/{label}]:regress: one value per example."""
    async with _open(request) as view:
        output = tfserving_examples.regression_output(view.signature)
        values = (await _infer(view, await _examples(request, view), (output,)))[output]
        return Response(tfserving_examples.encode_regressions(values), media_type="application/json")


PREFIXES = ("/v1/models/{model}", "/v1/models/{model}/versions/{version}", "/v1/models/{model}/labels/{label}")

routes = [
    *(Route(f"{p}:{verb.__name__}", verb, methods=["POST"]) for p in PREFIXES for verb in (predict, classify, regress)),
    *(Route(prefix, model_status, methods=["GET"]) for prefix in PREFIXES),
    *(Route(f"{prefix}/metadata", model_metadata, methods=["GET"]) for prefix in PREFIXES),
]
