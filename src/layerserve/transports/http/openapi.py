"""The OpenAPI document of every route (`GET /openapi.json`) and a page to read and try it (`GET /docs`)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from layerserve import __version__
from layerserve.transports.http.bodies import JSONResponse

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
              "FP64", "BYTES"]  # fmt: skip
_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "datatype": {"type": "string", "enum": _DATATYPES},
        "data": {"type": "array"},
        "parameters": _ANY_OBJECT,
    },
}
_INFER = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "inputs": {"type": "array", "items": _TENSOR},
        "outputs": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                                "parameters": _ANY_OBJECT}}},
        "parameters": _ANY_OBJECT,
    },
}  # fmt: skip
_TEXTS = {
    "type": "object",
    "required": ["texts"],
    "properties": {"texts": {"type": "array", "items": {"type": "string"}}},
}
_TRAIN = {
    "type": "object",
    "properties": {
        "dataset": {"type": "object", "properties": {
            "texts": {"type": "array", "items": {"type": "string"}},
            "images": {"type": "array", "items": {"type": "object", "properties": {"b64": {"type": "string"}}}},
            "labels": {"type": "array", "items": {"type": "string"}},
            "path": {"type": "string"}, "format": {"type": "string", "enum": ["csv", "tsv", "jsonl"]},
            "text_column": {"type": "string"}, "label_column": {"type": "string"},
        }},
        "params": _ANY_OBJECT,
        "apply": {"type": "boolean"},
    },
}  # fmt: skip
_PREDICT = {
    "type": "object",
    "properties": {"instances": {"type": "array"}, "inputs": {}, "output_filter": {"type": "array",
                                                                                     "items": {"type": "string"}}},
}  # fmt: skip


_EXAMPLES = {
    "type": "object",
    "required": ["examples"],
    "properties": {"signature_name": {"type": "string"}, "context": _ANY_OBJECT,
                   "examples": {"type": "array", "items": _ANY_OBJECT}},
}  # fmt: skip


def _param(name: str, where: str = "path", schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": schema or {"type": "string"}}


def _operation(summary: str, body: dict[str, Any] | None = None, query: tuple[str, ...] = ()) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "parameters": [_param(name, "query") for name in query],
        "responses": {
            "200": {"description": "OK"},
            "4XX": {"description": "A bad request: what was wrong and what was expected",
                    "content": {"application/json": {"schema": _ERROR}}},
            "503": {"description": "Not ready, or the queue is full",
                    "content": {"application/json": {"schema": _ERROR}}},
        },
    }  # fmt: skip
    if body is not None:
        operation["requestBody"] = {"content": body}
    return operation


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


_IMAGE = {
    "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {"schema": {"type": "object",
                                       "properties": {"image": {"type": "string", "format": "binary"}}}},
}  # fmt: skip
_IMAGE_OR_TEXTS = {
    **_json(_TEXTS),
    "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {"schema": {"type": "object",
                                       "properties": {"image": {"type": "string", "format": "binary"}}}},
}  # fmt: skip


def _model_paths(suffix: str, operation: dict[str, Any], method: str = "post") -> dict[str, Any]:
    return {
        f"/v2/models/{{model}}{suffix}": {method: operation, "parameters": [_param("model")]},
        f"/v2/models/{{model}}/versions/{{version}}{suffix}": {
            method: operation, "parameters": [_param("model"), _param("version")],
        },
    }  # fmt: skip


def _tfserving_paths(suffix: str, operation: dict[str, Any], method: str) -> dict[str, Any]:
    return {
        f"/v1/models/{{model}}{suffix}": {method: operation, "parameters": [_param("model")]},
        f"/v1/models/{{model}}/versions/{{version}}{suffix}": {
            method: operation, "parameters": [_param("model"), _param("version")],
        },
        f"/v1/models/{{model}}/labels/{{label}}{suffix}": {
            method: operation, "parameters": [_param("model"), _param("label")],
        },
    }  # fmt: skip


# Its keys (log_file, log_info, log_warning, log_error, log_verbose_level, log_format) are not listed: the
# fuzzer would change the test process's own log level with them.
_LOG_SETTINGS = {"type": "object", "description": "Triton's log settings keys, any of them"}
_LOAD = {
    "type": "object",
    "properties": {"parameters": {"type": "object", "properties": {"config": {"type": "string"}}}},
}
_UNSUPPORTED = _operation("Not supported by layerserve: a 400 that says so")


def _shared_memory_paths(kind: str) -> dict[str, Any]:
    prefix, region = f"/v2/{kind}sharedmemory", [_param("region")]
    return {
        f"{prefix}/status": {"get": _UNSUPPORTED},
        f"{prefix}/region/{{region}}/status": {"get": _UNSUPPORTED, "parameters": region},
        f"{prefix}/region/{{region}}/register": {"post": _UNSUPPORTED, "parameters": region},
        f"{prefix}/region/{{region}}/unregister": {"post": _UNSUPPORTED, "parameters": region},
        f"{prefix}/unregister": {"post": _UNSUPPORTED},
    }


def document() -> dict[str, Any]:
    """The OpenAPI 3.0 document of layerserve's HTTP API."""
    paths: dict[str, Any] = {
        "/v2": {"get": _operation("Server metadata and extensions")},
        "/v2/health/live": {"get": _operation("Liveness")},
        "/v2/health/ready": {"get": _operation("Readiness: every model settled, not shutting down")},
        **_model_paths("", _operation("Model metadata: inputs, outputs, versions, state, engine"), "get"),
        **_model_paths("/ready", _operation("Model readiness"), "get"),
        **_model_paths("/infer", _operation("Inference (V2 JSON; binary tensor extension)", _json(_INFER))),
        **_model_paths("/layers", _operation("Every layer, in graph order"), "get"),
        **_model_paths("/classify", _operation("Top-k labels of images or texts", _IMAGE_OR_TEXTS, ("top_k",))),
        **_model_paths(
            "/features", _operation("A layer's output per image or text", _IMAGE_OR_TEXTS, ("layer", "pool", "ids"))
        ),
        **_model_paths(
            "/explain",
            _operation(
                "Where in one image the model saw a class (Score-CAM or occlusion)",
                _IMAGE,
                ("class", "method", "layer", "channels", "format"),
            ),
        ),
        "/v2/models/{model}/features/{feature_id}": {
            "get": _operation("A stored feature vector", query=("version", "layer")),
            "parameters": [_param("model"), _param("feature_id")],
        },
        "/v2/models/{model}/features/batch": {
            "post": _operation(
                "Stored feature vectors by id",
                _json(
                    {
                        "type": "object",
                        "properties": {
                            "ids": {"type": "array", "items": {"type": "string"}},
                            "version": {},
                            "layer": {"type": "string"},
                        },
                    }
                ),
            ),
            "parameters": [_param("model")],
        },
        "/v2/models/stats": {"get": _operation("Inference statistics of every model (Triton's model_stats)")},
        **_model_paths("/stats", _operation("Inference statistics (Triton's model_stats)"), "get"),
        **_model_paths("/config", _operation("The Triton model configuration"), "get"),
        "/v2/logging": {
            "get": _operation("Log settings (Triton's keys)"),
            "post": _operation("Change the log settings of this process", _json(_LOG_SETTINGS)),
        },
        "/v2/trace/setting": {"get": _UNSUPPORTED, "post": _UNSUPPORTED},
        "/v2/models/{model}/trace/setting": {
            "get": _UNSUPPORTED,
            "post": _UNSUPPORTED,
            "parameters": [_param("model")],
        },
        **_shared_memory_paths("system"),
        **_shared_memory_paths("cuda"),
        "/v2/repository/index": {"post": _operation("Every version with its state and reason")},
        "/v2/repository/models/{model}/load": {
            "post": _operation("(Re)load a model; parameters.config replaces config.yaml keys", _json(_LOAD)),
            "parameters": [_param("model")],
        },
        "/v2/repository/models/{model}/unload": {"post": _operation("Unload a model"), "parameters": [_param("model")]},
        "/v2/models/{model}/apply": {
            "post": _operation(
                'Unpin with {"version": "latest"}; pin a label\'s version with {"label": ...}', _json(_ANY_OBJECT)
            ),
            "parameters": [_param("model")],
        },
        "/v2/models/{model}/versions/{version}/apply": {
            "post": _operation("Pin a version as the active one"),
            "parameters": [_param("model"), _param("version")],
        },
        "/v2/models/{model}/labels/{label}/apply": {
            "post": _operation("Pin the version a label of the model's version_labels names"),
            "parameters": [_param("model"), _param("label")],
        },
        "/v2/models/{model}/train": {
            "post": _operation(
                "Start a training job",
                {
                    **_json(_TRAIN),
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "file": {"type": "string", "format": "binary"},
                                "params": {"type": "string"},
                                "apply": {"type": "string"},
                            },
                        }
                    },
                },
            ),
            "parameters": [_param("model")],
        },
        "/v2/jobs": {"get": _operation("Every training job")},
        "/v2/jobs/{job}": {"get": _operation("A training job"), "parameters": [_param("job")]},
        "/v2/jobs/{job}/cancel": {"post": _operation("Cancel a training job"), "parameters": [_param("job")]},
        **_tfserving_paths("", _operation("Version status (TF Serving)"), "get"),
        **_tfserving_paths("/metadata", _operation("Signature (TF Serving)"), "get"),
        **_tfserving_paths(":predict", _operation("Predict (TF Serving REST)", _json(_PREDICT)), "post"),
        **_tfserving_paths(":classify", _operation("Classes per example (TF Serving)", _json(_EXAMPLES)), "post"),
        **_tfserving_paths(":regress", _operation("One value per example (TF Serving)", _json(_EXAMPLES)), "post"),
        "/metrics": {"get": _operation("Prometheus metrics")},
        "/v2/overview": {
            "get": _operation("Every model with its versions, and the server's series (the console's data)")
        },
        "/console": {"get": _operation("The web console (an HTML page)")},
        "/": {
            "get": {
                **_operation("Browsers (Accept: text/html) are redirected to /console"),
                "responses": {
                    "307": {"description": "To /console"},
                    "4XX": {"description": "Not a browser", "content": {"application/json": {"schema": _ERROR}}},
                },
            }
        },
        "/openapi.json": {"get": _operation("This document")},
        "/docs": {"get": _operation("A page to read this document")},
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "layerserve", "version": __version__},
        "paths": paths,
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json."""
    return JSONResponse(document())


_DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>layerserve API</title>
<link rel="stylesheet" href="https://unpkg.com/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"></div><noscript><a href="/openapi.json">openapi.json</a></noscript>
<script src="https://unpkg.com/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script></body></html>
"""


async def docs(request: Request) -> Response:
    """GET /docs: Swagger UI over /openapi.json (the browser loads Swagger UI; the server serves no files)."""
    return HTMLResponse(_DOCS_PAGE)


routes = [Route("/openapi.json", openapi_json, methods=["GET"]), Route("/docs", docs, methods=["GET"])]
