"""Training jobs over HTTP: start one (JSON or an uploaded file), list, watch and cancel them."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.errors import BadRequestError, NotFoundError
from layerserve.lifecycle.repository import check_model_name
from layerserve.protocols.v2 import load_json_object
from layerserve.settings import Settings
from layerserve.training.datasets import format_of, parse_dataset, resolve_data_path
from layerserve.training.image_data import (
    LabelledPhoto,
    check_image_model,
    check_photos,
    photos_from_archive,
    photos_from_folder,
    photos_from_json,
    reading_digest,
)  # fmt: skip
from layerserve.training.image_job import BaseLayer, ImageData, feature_layer
from layerserve.training.image_recipe import ImageTrainingParams
from layerserve.training.job_store import Job
from layerserve.training.jobs import TextData
from layerserve.training.recipe import TextTrainingParams, check_dataset, check_text_model, check_version_writable
from layerserve.transports.http.bodies import JSONResponse, parse_form, read_body
from layerserve.transports.http.services import services

_BODY_KEYS = {"dataset", "params", "apply"}
_DATASET_KEYS = {"texts", "images", "labels", "path", "format", "text_column", "label_column"}
_ARCHIVES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")

Dataset = tuple[list[str], list[str]] | list[LabelledPhoto]  # texts and labels, or labelled photos


async def _dataset_from_json(dataset: Any, settings: Settings) -> Dataset:
    if not isinstance(dataset, dict):
        raise BadRequestError(
            '\'dataset\' must be {"texts": [...], "labels": [...]}, {"images": [{"b64": ...}], "labels": [...]} or '
            '{"path": "..."}'
        )
    unknown = set(dataset) - _DATASET_KEYS
    if unknown:
        raise BadRequestError(f"unknown dataset keys {sorted(unknown)}; expected some of {sorted(_DATASET_KEYS)}")
    if "path" in dataset:
        if not isinstance(dataset["path"], str):
            raise BadRequestError("dataset 'path' must be a string")
        path = resolve_data_path(settings.data_dir, dataset["path"], folders=True)
        if path.is_dir():
            return await asyncio.to_thread(photos_from_folder, path)  # reading and unpacking: off the loop
        if path.name.lower().endswith(_ARCHIVES):
            return await asyncio.to_thread(lambda: photos_from_archive(path.read_bytes(), path.name))
        return _parse_file(path.read_bytes(), path.name, dataset)
    if "images" in dataset:
        return await asyncio.to_thread(photos_from_json, dataset["images"], dataset.get("labels"))
    texts, labels = dataset.get("texts"), dataset.get("labels")
    if not isinstance(texts, list) or not isinstance(labels, list):
        raise BadRequestError(
            "the dataset needs 'texts' and 'labels' lists, or 'images' and 'labels' (or a 'path', or an uploaded file)"
        )
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


async def _from_form(request: Request, body: bytes) -> tuple[dict[str, Any], Dataset]:
    """(the JSON-like body without a dataset, the dataset) from a multipart form with a `file` field: a CSV, TSV or
    JSON lines file of texts, or a zip or tar of photos in one folder per class."""
    form = await parse_form(request, body)
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadRequestError(
                "the multipart form needs the dataset as a 'file' field (CSV, TSV or JSON lines of texts; a zip or "
                "tar of photos in one folder per class)"
            )
        fields = {key: value for key, value in form.items() if isinstance(value, str)}
        filename = upload.filename or ""
        dataset: Dataset
        if filename.lower().endswith(_ARCHIVES):
            dataset = await asyncio.to_thread(photos_from_archive, await upload.read(), filename)
        else:
            options: dict[str, Any] = {k: fields[k] for k in ("format", "text_column", "label_column") if k in fields}
            dataset = _parse_file(await upload.read(), filename, options)
    finally:
        await form.close()
    params = load_json_object(fields["params"].encode(), "the 'params' field") if "params" in fields else {}
    apply = fields.get("apply", "false").lower()
    if apply not in ("true", "false", "1", "0"):
        raise BadRequestError("the 'apply' field must be true or false")
    return {"params": params, "apply": apply in ("true", "1")}, dataset


async def train(request: Request) -> Response:
    """POST /v2/models/{model}/train: check everything, then queue the job; 202 with the job."""
    settings = services(request).settings
    name = request.path_params["model"]
    check_model_name(name)
    check_version_writable(settings.model_repository / name)  # a read-only repository: 409 before the body is read
    body = await read_body(request, settings.max_body_bytes)
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        fields, dataset = await _from_form(request, body)
    else:
        fields = load_json_object(body, "the request body")
        unknown = set(fields) - _BODY_KEYS
        if unknown:
            raise BadRequestError(f"unknown keys {sorted(unknown)}; expected dataset, params, apply")
        dataset = await _dataset_from_json(fields.get("dataset"), settings)
    apply = fields.get("apply", False)
    if not isinstance(apply, bool):
        raise BadRequestError("'apply' must be true or false")
    if isinstance(dataset, list):
        job = await _image_job(request, name, dataset, fields.get("params", {}), apply)
    else:
        texts, labels = dataset
        params = TextTrainingParams.parse(fields.get("params", {}))
        check_dataset(texts, labels)
        check_text_model(settings.model_repository / name)
        job = services(request).jobs().submit(name, TextData(texts, labels), params.model_dump(), apply)
    return JSONResponse(
        {"job_id": job.id, **job.to_dict()}, status_code=202, headers={"Location": f"/v2/jobs/{job.id}"}
    )


async def _image_job(request: Request, name: str, photos: list[LabelledPhoto], values: Any, apply: bool) -> Job:
    """Check an image-classifier job (its params, photos, base and layer) and queue it."""
    found = services(request)
    params = ImageTrainingParams.parse(values)
    classes = await asyncio.to_thread(check_photos, photos, found.settings.max_image_pixels)  # ms a photo
    try:
        base = found.data.open(params.base, params.base_version)
    except NotFoundError as error:
        raise BadRequestError(f"params.base: {error.message}") from None
    async with base:
        if base.config.input != "image":
            raise BadRequestError(
                f"params.base: model '{params.base}' is not an image model (its config.yaml has input: "
                f"{base.config.input}); train on one that says input: image"
            )
        check_image_model(found.settings.model_repository / name, params.base, base.config)
        tensor, keras_layer = feature_layer(base.graph, params.layer)
        where = BaseLayer(base.model, base.version, tensor, base.model_digest, reading_digest(base.config))
        data = ImageData(
            found.data, where, keras_layer, base.folder, base.config.model_dump(mode="json"), photos, classes, params,
            found.settings.trust_models,
        )  # fmt: skip
    resolved = params.model_copy(update={"base_version": base.version, "layer": tensor})
    return found.jobs().submit(name, data, resolved.model_dump(), apply)


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
