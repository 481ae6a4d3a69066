"""Images or texts in: /classify (top-k labels), /features (any layer, pooled) and /explain (a heatmap of the evidence
for a class); stored features by id."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Scope

from layerserve.dataplane import VersionView
from layerserve.errors import BadRequestError
from layerserve.features.explain import overlay_png
from layerserve.messages import ClassifyRequest, ExplainRequest, FeaturesRequest
from layerserve.protocols.v2 import load_json_object
from layerserve.tracing import span
from layerserve.transports.http.bodies import (
    NPY_MEDIA_TYPE,
    JSONResponse,
    npy_bytes,
    read_body,
    read_images,
    read_texts,
    wants_npy,
)
from layerserve.transports.http.services import services
from layerserve.transports.http.v2_routes import parse_version


def query_parameters(scope: Scope) -> Mapping[str, str]:
    """The query string's parameters, a repeated name's last value winning as in Starlette's `query_params` (a
    third of its cost: no multi-dict); read-only, as the same query string's are shared."""
    raw = scope.get("query_string", b"")
    return _parsed_query(raw) if raw else _NO_PARAMETERS


_NO_PARAMETERS: Mapping[str, str] = MappingProxyType({})


@functools.lru_cache(maxsize=256)  # clients send the same few query strings (`?cache=false`) again and again
def _parsed_query(raw: bytes) -> Mapping[str, str]:
    return MappingProxyType(dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=True)))


def _use_cache(query: Mapping[str, str]) -> bool:
    """Query `cache=false` bypasses the feature cache (`cache=true`, the default, uses it).

    Raises:
        BadRequestError: another value.
    """
    raw = query.get("cache", "true")
    if raw not in ("true", "false"):
        raise BadRequestError(f"query 'cache' must be true or false, got {raw!r}")
    return raw == "true"


def _query_int(query: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise BadRequestError(f"query '{name}' must be a positive integer, got {raw!r}")
    return int(raw)


async def _items(request: Request, view: VersionView) -> list[bytes] | list[str]:
    """The texts (a text model) or encoded images of the request body."""
    limit = services(request).settings.max_body_bytes
    if view.takes_texts:
        return await read_texts(request, limit)
    view.require_image()
    return await read_images(request, limit)


async def classify(request: Request) -> Response:
    """POST /v2/models/{model}[/versions/{version}]/classify: images or texts in, top-k labels out."""
    query = query_parameters(request.scope)
    async with services(request).data.open(request.path_params["model"], parse_version(request)) as view:
        k = _query_int(query, "top_k", 5) or 5
        items = await _items(request, view)
        answer = await view.classify(ClassifyRequest(view.model, items, k, view.version, _use_cache(query)))
        with span("encode"):
            return JSONResponse(
                {"model_name": answer.model, "model_version": str(answer.version), "predictions": answer.predictions}
            )


async def features(request: Request) -> Response:
    """POST /v2/models/{model}[/versions/{version}]/features?layer=L[&pool=avg][&ids=a,b]: vectors out."""
    query = query_parameters(request.scope)
    layer = query.get("layer")
    pool = query.get("pool") or "default"
    ids = query["ids"].split(",") if "ids" in query else []
    async with services(request).data.open(request.path_params["model"], parse_version(request)) as view:
        if not view.takes_texts:
            view.require_image()
        if not layer:
            raise BadRequestError("query 'layer' is required: the layer whose output is the feature vector")
        view.check_features(layer, pool, "query 'pool'")
        items = await _items(request, view)
        answer = await view.features(
            FeaturesRequest(view.model, items, layer, pool, view.version, _use_cache(query), ids)
        )
        with span("encode"):
            if wants_npy(request):
                return Response(npy_bytes(answer.features), media_type=NPY_MEDIA_TYPE)
            vectors = answer.features
            return JSONResponse(
                {"model_name": answer.model, "model_version": str(answer.version), "layer": layer,
                 "datatype": str(vectors.dtype), "shape": list(vectors.shape), "features": vectors}
            )  # fmt: skip


async def explain(request: Request) -> Response:
    """POST /v2/models/{model}[/versions/{version}]/explain[?class=C&method=score-cam|occlusion&layer=L&channels=N
    &format=png]: one image in, a heatmap of where the model saw the evidence for the class (JSON, or the image with
    the heatmap over it as PNG)."""
    query = query_parameters(request.scope)
    fmt = query.get("format", "json")
    if fmt not in ("json", "png"):
        raise BadRequestError(f"query 'format' must be json or png, got {fmt!r}")
    async with services(request).data.open(request.path_params["model"], parse_version(request)) as view:
        view.require_image()
        images = await read_images(request, services(request).settings.max_body_bytes)
        if len(images) != 1:
            raise BadRequestError(f"/explain takes one image, got {len(images)}")
        asked = ExplainRequest(
            view.model, images[0], view.version, query.get("class"), query.get("method", "score-cam"),
            query.get("layer"), _query_int(query, "channels", 32) or 32,
        )  # fmt: skip
        answer = await view.explain(asked)
    with span("encode"):
        if fmt == "png":
            return Response(overlay_png(answer.pixels, answer.heatmap), media_type="image/png")
        return JSONResponse(answer.to_dict())


async def stored_feature(request: Request) -> Response:
    """GET /v2/models/{model}/features/{id}[?layer=L&version=V]: a stored vector, JSON or .npy."""
    query = query_parameters(request.scope)
    feature = await services(request).data.stored_feature(
        request.path_params["model"], request.path_params["feature_id"], _query_int(query, "version", None),
        query.get("layer"),
    )  # fmt: skip
    if wants_npy(request):
        return Response(npy_bytes(feature.array), media_type=NPY_MEDIA_TYPE)
    return JSONResponse(feature.to_dict())


async def stored_features(request: Request) -> Response:
    """POST /v2/models/{model}/features/batch {"ids": [...], "layer"?, "version"?}: many stored vectors."""
    found = services(request)
    body = load_json_object(await read_body(request, found.settings.max_body_bytes), "the request body")
    ids, layer, version = body.get("ids"), body.get("layer"), body.get("version")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids) or len(ids) > 10_000:
        raise BadRequestError("'ids' must be a non-empty list of at most 10000 strings")
    if (layer is not None and not isinstance(layer, str)) or (version is not None and type(version) is not int):
        raise BadRequestError("'layer' must be a string and 'version' an integer")
    stored = await found.data.stored_features(request.path_params["model"], ids, version, layer)
    return JSONResponse({"features": {i: f.to_dict() if f else None for i, f in zip(ids, stored, strict=True)}})


_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"

routes = [
    *(Route(f"{prefix}/classify", classify, methods=["POST"]) for prefix in (_MODEL, _VERSION)),
    *(Route(f"{prefix}/features", features, methods=["POST"]) for prefix in (_MODEL, _VERSION)),
    *(Route(f"{prefix}/explain", explain, methods=["POST"]) for prefix in (_MODEL, _VERSION)),
    Route("/v2/models/{model}/features/batch", stored_features, methods=["POST"]),
    Route("/v2/models/{model}/features/{feature_id}", stored_feature, methods=["GET"]),
]
