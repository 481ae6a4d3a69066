"""Labelled photos for an image-classifier job: from a zip or tar of `label/*.jpg|png` folders, a folder of them
under `--data-dir`, or a JSON list of base64 images with labels; each photo read once here, so that an unreadable
one is refused (by name) before any job starts."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import struct
import tarfile
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from layerserve.errors import BadRequestError
from layerserve.settings import ModelConfig

IMAGE_READING = ("resize", "interpolation", "preprocess", "scale", "offset")  # config.yaml settings that make features
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
_MAX_UNPACKED_BYTES = 1 << 30  # what an archive may unpack to: a bomb is refused before it is read


@dataclass(frozen=True)
class LabelledPhoto:
    """One photo: where it came from (for messages), its encoded bytes and its class."""

    name: str
    data: bytes
    label: str

    @property
    def digest(self) -> str:
        """The SHA-256 of its bytes: its features' key in the feature store."""
        return hashlib.sha256(self.data).hexdigest()


def photos_from_archive(data: bytes, filename: str) -> list[LabelledPhoto]:
    """Photos from a zip or tar (gzip, bz2 or xz) whose folders are the classes: each photo's label is the name of
    the folder that holds it (`cat/1.jpg`, or `photos/cat/1.jpg`).

    Raises:
        BadRequestError: not a zip or tar, a photo outside a folder, a file that is not a photo, too large.
    """
    try:
        if zipfile.is_zipfile(io.BytesIO(data)):
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                members = [m for m in archive.infolist() if not m.is_dir()]
                _check_unpacked(sum(m.file_size for m in members), filename)
                return _labelled([(m.filename, lambda m=m: archive.read(m)) for m in members])
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tarred:  # a stream: read in its own order
            files, unpacked = [], 0
            for member in tarred:
                unpacked += member.size
                _check_unpacked(unpacked, filename)  # as it goes: a bomb is refused before it is all inflated
                if member.isfile():
                    content = _read_member(tarred, member)
                    files.append((member.name, lambda content=content: content))
            return _labelled(files)
    except (zipfile.BadZipFile, tarfile.TarError, zlib.error, EOFError, OSError) as error:
        raise BadRequestError(
            f"{filename or 'the uploaded file'} is not a readable zip or tar archive ({error}): upload the photos as "
            "a zip or tar of one folder per class (cat/1.jpg, dog/2.png, ...)"
        ) from None


def photos_from_folder(folder: Path) -> list[LabelledPhoto]:
    """Photos from a folder whose subfolders are the classes (`folder/cat/1.jpg`).

    Raises:
        BadRequestError: as photos_from_archive.
    """
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    _check_unpacked(sum(p.stat().st_size for p in files), str(folder))
    return _labelled([(p.relative_to(folder).as_posix(), p.read_bytes) for p in files])


def photos_from_json(images: Any, labels: Any) -> list[LabelledPhoto]:
    """Photos from `[{"b64": ...}, ...]` and one label per image.

    Raises:
        BadRequestError: not lists of the same length, an image without base64, a label that is not a string.
    """
    if not isinstance(images, list) or not isinstance(labels, list):
        raise BadRequestError("the dataset needs 'images' ([{\"b64\": \"...\"}, ...]) and 'labels' lists")
    if len(images) != len(labels):
        raise BadRequestError(f"{len(images)} images but {len(labels)} labels: give one label per image")
    photos = []
    for number, (image, label) in enumerate(zip(images, labels, strict=True)):
        if not isinstance(image, dict) or not isinstance(image.get("b64"), str):
            raise BadRequestError(f'image {number} must be {{"b64": "<base64 of a JPEG or PNG>"}}')
        if not isinstance(label, (str, int)) or isinstance(label, bool):
            raise BadRequestError(f"label {number} must be a string")
        try:
            data = base64.b64decode(image["b64"], validate=True)
        except (binascii.Error, ValueError):
            raise BadRequestError(f"image {number} is not valid base64") from None
        photos.append(LabelledPhoto(f"image {number}", data, str(label)))
    return photos


def check_photos(photos: list[LabelledPhoto], max_pixels: int) -> list[str]:
    """The classes, sorted, once every photo decodes within `max_pixels` and there are at least two classes of two
    photos each.

    Raises:
        BadRequestError: no photos, a label that is empty or spans lines, one class, a class with fewer than 2 photos,
            a photo that does not decode or is too large (named).
    """
    from PIL import Image, UnidentifiedImageError

    if not photos:
        raise BadRequestError("the dataset has no photos")
    for photo in photos:
        if not photo.label.strip() or "\n" in photo.label or "\r" in photo.label:
            raise BadRequestError(f"{photo.name} has the label {photo.label!r}: a label is one non-empty line")
    counts = Counter(photo.label for photo in photos)
    if len(counts) < 2:
        raise BadRequestError(f"the dataset has a single class {photos[0].label!r}: a classifier needs at least two")
    few = sorted(label for label, count in counts.items() if count < 2)
    if few:
        raise BadRequestError(f"class {few[0]!r} has {counts[few[0]]} photo: give every class at least 2 photos")
    for photo in photos:
        try:
            with Image.open(io.BytesIO(photo.data)) as image:
                if image.width * image.height > max_pixels:
                    raise BadRequestError(
                        f"{photo.name} has {image.width}x{image.height} pixels, over the server's max_image_pixels "
                        f"({max_pixels})"
                    )
                image.load()
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, struct.error,
                Image.DecompressionBombError) as error:  # fmt: skip
            raise BadRequestError(f"{photo.name} is not a readable image: {error}") from None
    return sorted(counts)


def check_image_model(model_dir: Path, base: str, base_config: ModelConfig) -> None:
    """Image training adds versions to an image model other than its base that reads images as the base does, or
    creates a new one.

    Raises:
        BadRequestError: the model is the base itself, or exists and its config.yaml is invalid, not `input: image`,
            or reads images otherwise than the base (its features would not be the served ones).
    """
    from layerserve.lifecycle.repository import scan_model

    if model_dir.name == base:
        raise BadRequestError(
            f"model '{base}' is the base: name a new model for the classifier (its versions would change the base's)"
        )
    if not model_dir.exists():
        return
    spec = scan_model(model_dir)
    if spec.error:
        raise BadRequestError(f"model '{model_dir.name}' has an invalid config.yaml: {spec.error}")
    if spec.config.input != "image":
        raise BadRequestError(
            f"model '{model_dir.name}' is not an image model (its config.yaml has input: {spec.config.input}); "
            "train a new model name, or one whose config.yaml says input: image"
        )
    for setting in IMAGE_READING:
        if getattr(spec.config, setting) != getattr(base_config, setting):
            raise BadRequestError(
                f"model '{model_dir.name}' reads images with {setting}: {getattr(spec.config, setting)}, its base "
                f"'{base}' with {getattr(base_config, setting)}: train a new model name, or set it as the base's"
            )


def reading_digest(config: ModelConfig) -> str:
    """A short digest of how a model reads images (its IMAGE_READING settings)."""
    reading = {setting: str(getattr(config, setting)) for setting in IMAGE_READING}
    return hashlib.sha256(json.dumps(reading, sort_keys=True).encode()).hexdigest()[:12]


def _check_unpacked(size: int, where: str) -> None:
    if size > _MAX_UNPACKED_BYTES:
        raise BadRequestError(
            f"{where or 'the dataset'} unpacks to {size / (1 << 20):.0f} MB, over the {_MAX_UNPACKED_BYTES >> 20} MB "
            "a dataset may: give fewer or smaller photos"
        )


def _read_member(archive: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = archive.extractfile(member)
    assert handle is not None  # a regular file
    return handle.read()


def _labelled(files: list[tuple[str, Any]]) -> list[LabelledPhoto]:
    """(path in the dataset, a function that reads it) -> photos labelled by their folder; hidden files and macOS
    resource forks are skipped."""
    photos = []
    for name, read in files:  # in the archive's own order (a compressed tar reads forward), sorted below
        path = PurePosixPath(name)
        if any(part.startswith(".") or part == "__MACOSX" for part in path.parts):
            continue
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise BadRequestError(
                f"{name} is not a photo: the dataset holds one folder per class of {', '.join(IMAGE_SUFFIXES)} files"
            )
        if len(path.parts) < 2:
            raise BadRequestError(f"{name} is in no class folder: put each photo in a folder named after its class")
        try:
            data = read()
        except (
            zipfile.BadZipFile,
            tarfile.TarError,
            zlib.error,
            EOFError,
            OSError,
            NotImplementedError,
            RuntimeError,
        ) as error:
            raise BadRequestError(f"{name} cannot be read from the dataset: {error}") from None
        photos.append(LabelledPhoto(name, data, path.parent.name))
    return sorted(photos, key=lambda photo: photo.name)
