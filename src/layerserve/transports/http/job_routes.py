"""Training jobs over HTTP: start one (JSON or an uploaded file), list, watch and cancel them."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.errors import BadRequestError
from layerserve.lifecycle.repository import check_model_name
from layerserve.protocols.v2 import load_json_object
from layerserve.settings import Settings
from layerserve.training.datasets import format_of, parse_dataset, resolve_data_path
from layerserve.training.recipe import TextTrainingParams, check_dataset, check_text_model, check_version_writable
from layerserve.transports.http.bodies import JSONResponse, parse_form, read_body
from layerserve.transports.http.services import services

_BODY_KEYS = {"dataset", "params", "apply"}
_DATASET_KEYS = {"texts", "labels", "path", "format", "text_column", "label_column"}


def _dataset_from_json(dataset: Any, settings: Settings) -> tuple[list[str], list[str]]:
    if not isinstance(dataset, dict):
        raise BadRequestError('\'dataset\' must be {"texts": [...], "labels": [...]} or {"path": "..."}')
    unknown = set(dataset) - _DATASET_KEYS
    if unknown:
        raise BadRequestError(f"unknown dataset keys {sorted(unknown)}; expected some of {sorted(_DATASET_KEYS)}")
    if "path" in dataset:
        if not isinstance(dataset["path"], str):
            raise BadRequestError("dataset 'path' must be a string")
        path = resolve_data_path(settings.data_dir, dataset["path"])
        return _parse_file(path.read_bytes(), path.name, dataset)
    texts, labels = dataset.get("texts"), dataset.get("labels")
    if not isinstance(texts, list) or not isinstance(labels, list):
        raise BadRequestError("the dataset needs 'texts' and 'labels' lists (or a 'path', or an uploaded file)")
    labels = [
        str(label) if isinstance(label, (int, float)) and not isinstance(label, bool) else label for label in labels
    ]
    return texts, labels


def _parse_file(data: bytes, filename: str, options: dict[str, Any]) -> tuple[list[str], list[str]]:
    fmt = format_of(filename, options.get("format"))
    columns = {key: options[key] for key in ("text_column", "label_column") if options.get(key)}
    if not all(isinstance(value, str) for value in columns.values()):
        raise BadRequestError("'text_column' and 'label_column' must be strings")
    return parse_dataset(data, fmt, **columns)


async def _from_form(request: Request, body: bytes) -> tuple[dict[str, Any], list[str], list[str]]:
    """(the JSON-like body without a dataset, texts, labels) from a multipart form with a `file` field."""
    form = await parse_form(request, body)
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadRequestError("the multipart form needs the dataset as a 'file' field (CSV, TSV or JSON lines)")
        fields = {key: value for key, value in form.items() if isinstance(value, str)}
        options: dict[str, Any] = {k: fields[k] for k in ("format", "text_column", "label_column") if k in fields}
        texts, labels = _parse_file(await upload.read(), upload.filename or "", options)
    finally:
        await form.close()
    params = load_json_object(fields["params"].encode(), "the 'params' field") if "params" in fields else {}
    apply = fields.get("apply", "false").lower()
    if apply not in ("true", "false", "1", "0"):
        raise BadRequestError("the 'apply' field must be true or false")
    return {"params": params, "apply": apply in ("true", "1")}, texts, labels


async def train(request: Request) -> Response:
    """POST /v2/models/{model}/train: check everything, then queue the job; 202 with the job."""
    settings = services(request).settings
    name = request.path_params["model"]
    check_model_name(name)
    check_version_writable(settings.model_repository / name)  # a read-only repository: 409 before the body is read
    body = await read_body(request, settings.max_body_bytes)
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        fields, texts, labels = await _from_form(request, body)
    else:
        fields = load_json_object(body, "the request body")
        unknown = set(fields) - _BODY_KEYS
        if unknown:
            raise BadRequestError(f"unknown keys {sorted(unknown)}; expected dataset, params, apply")
        texts, labels = _dataset_from_json(fields.get("dataset"), settings)
    if not isinstance(fields.get("apply", False), bool):
        raise BadRequestError("'apply' must be true or false")
    params = TextTrainingParams.parse(fields.get("params", {}))
    check_dataset(texts, labels)
    check_text_model(settings.model_repository / name)
    job = services(request).jobs().submit(name, texts, labels, params, bool(fields.get("apply", False)))
    return JSONResponse(
        {"job_id": job.id, **job.to_dict()}, status_code=202, headers={"Location": f"/v2/jobs/{job.id}"}
    )


async def list_jobs(request: Request) -> Response:
    """GET /v2/jobs: every job, oldest first."""
    return JSONResponse({"jobs": [job.to_dict() for job in services(request).jobs().jobs()]})


async def get_job(request: Request) -> Response:
    """GET /v2/jobs/{id}."""
    return JSONResponse(services(request).jobs().get(request.path_params["job"]).to_dict())


async def cancel_job(request: Request) -> Response:
    """POST /v2/jobs/{id}/cancel: a queued or running job ends `cancelled` and leaves no version."""
    job = await services(request).jobs().cancel(request.path_params["job"])
    return JSONResponse(job.to_dict())


routes = [
    Route("/v2/models/{model}/train", train, methods=["POST"]),
    Route("/v2/jobs", list_jobs, methods=["GET"]),
    Route("/v2/jobs/{job}", get_job, methods=["GET"]),
    Route("/v2/jobs/{job}/cancel", cancel_job, methods=["POST"]),
]
