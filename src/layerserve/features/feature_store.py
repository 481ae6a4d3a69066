"""FeatureStore: feature vectors stored by id, namespaced by model, version and layer, on a cache backend."""

from __future__ import annotations

from dataclasses import dataclass

from layerserve.errors import BadRequestError, NotFoundError, NotReadyError
from layerserve.features.cache import CacheBackend, decode_arrays, encode_arrays
from layerserve.tensors import Array

_MAX_ID_LENGTH = 256


@dataclass(frozen=True)
class StoredFeature:
    """One stored vector with where it came from."""

    id: str
    model_version: int
    layer: str
    array: Array

    def to_dict(self) -> dict[str, object]:
        """The JSON form."""
        return {"id": self.id, "model_version": str(self.model_version), "layer": self.layer,
                "datatype": str(self.array.dtype), "shape": list(self.array.shape), "data": self.array}  # fmt: skip


def check_ids(ids: list[str], rows: int) -> None:
    """Ids are non-empty, distinct, at most 256 characters, one per input row.

    Raises:
        BadRequestError: naming what is wrong.
    """
    if len(ids) != rows:
        raise BadRequestError(f"'ids' has {len(ids)} ids for {rows} inputs: give one id per input")
    if len(set(ids)) != len(ids) or any(not i or len(i) > _MAX_ID_LENGTH for i in ids):
        raise BadRequestError(f"ids must be distinct, non-empty and at most {_MAX_ID_LENGTH} characters")


class FeatureStore:
    """Vectors under `<prefix>feature:<model>:<version>:<layer>:<id>`, plus a pointer per (model, id) to the
    latest (version, layer) stored under it. Never expires; a backend failure is a 503, never a silent loss."""

    def __init__(self, backend: CacheBackend, prefix: str) -> None:
        self._backend = backend
        self._prefix = prefix

    def _key(self, model: str, version: int, layer: str, feature_id: str) -> str:
        return f"{self._prefix}feature:{model}:{version}:{layer}:{feature_id}"

    def _pointer(self, model: str, feature_id: str) -> str:
        return f"{self._prefix}feature:{model}:latest:{feature_id}"

    async def put_many(self, model: str, features: list[StoredFeature]) -> None:
        """Store vectors (and their pointers) in one round trip.

        Raises:
            NotReadyError: the backend failed (503); nothing is reported as stored.
        """
        items = []
        for feature in features:
            items.append(
                (self._key(model, feature.model_version, feature.layer, feature.id), encode_arrays([feature.array]))
            )
            items.append((self._pointer(model, feature.id), f"{feature.model_version}/{feature.layer}".encode()))
        try:
            await self._backend.set_many(items, 0)
        except Exception as error:  # fail-soft boundary: the client learns the ids were not stored
            raise NotReadyError(f"feature store unavailable, nothing stored: {type(error).__name__}: {error}") from None

    async def get_many(
        self, model: str, ids: list[str], version: int | None = None, layer: str | None = None
    ) -> list[StoredFeature | None]:
        """Stored vectors by id (None where absent); without version and layer, the latest stored under each id.

        Raises:
            NotReadyError: the backend failed (503).
        """
        try:
            if version is None or layer is None:
                pointers = await self._backend.get_many([self._pointer(model, i) for i in ids])
                places = [_place(p, version, layer) for p in pointers]
            else:
                places = [(version, layer)] * len(ids)
            keys = [self._key(model, *place, i) if place else "" for place, i in zip(places, ids, strict=True)]
            values = await self._backend.get_many([k for k in keys if k]) if any(keys) else []
        except Exception as error:  # fail-soft boundary
            raise NotReadyError(f"feature store unavailable: {type(error).__name__}: {error}") from None
        found = iter(values)
        results: list[StoredFeature | None] = []
        for place, feature_id, key in zip(places, ids, keys, strict=True):
            value = next(found) if key else None
            arrays = decode_arrays(value, 1) if value is not None else None
            results.append(StoredFeature(feature_id, place[0], place[1], arrays[0]) if arrays and place else None)
        return results

    async def get(self, model: str, feature_id: str, version: int | None, layer: str | None) -> StoredFeature:
        """One stored vector.

        Raises:
            NotFoundError: nothing stored under this id (for this version and layer, when given).
            NotReadyError: the backend failed (503).
        """
        (feature,) = await self.get_many(model, [feature_id], version, layer)
        if feature is None:
            raise NotFoundError(f"model '{model}' has no stored feature '{feature_id}'")
        return feature


def _place(pointer: bytes | None, version: int | None, layer: str | None) -> tuple[int, str] | None:
    """(version, layer) from a pointer value, with the caller's version or layer taking precedence."""
    if pointer is None:
        return None
    stored_version, _, stored_layer = pointer.decode("utf-8", "replace").partition("/")
    if not (stored_version.isascii() and stored_version.isdigit()):
        return None
    return (version or int(stored_version), layer or stored_layer)
