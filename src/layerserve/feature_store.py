"""FeatureStore: feature vectors stored by id per model, in process memory, bounded by bytes (LRU)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from layerserve.errors import BadRequestError, NotFoundError
from layerserve.tensors import Array

_MAX_ID_LENGTH = 256


@dataclass(frozen=True)
class StoredFeature:
    """One stored vector with where it came from."""

    id: str
    model_version: int
    layer: str
    array: Array


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
    """Feature vectors by (model, id); the least recently used are dropped beyond `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str], StoredFeature] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, model: str, feature: StoredFeature) -> None:
        """Store (or replace) one vector."""
        key = (model, feature.id)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.array.nbytes
            self._items[key] = feature
            self._bytes += feature.array.nbytes
            while self._bytes > self._max_bytes and self._items:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.array.nbytes

    def get(self, model: str, feature_id: str) -> StoredFeature:
        """A stored vector.

        Raises:
            NotFoundError: no vector under this id for this model.
        """
        with self._lock:
            try:
                self._items.move_to_end((model, feature_id))
                return self._items[(model, feature_id)]
            except KeyError:
                raise NotFoundError(f"model '{model}' has no stored feature '{feature_id}'") from None
