"""TemplateCache: what a request's repeated part (a V2 binary JSON header, a gRPC ModelInferRequest less its raw
contents) says, parsed and checked once for one version, found again by the part's bytes."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Generic, TypeVar

Template = TypeVar("Template")


class TemplateCache(Generic[Template]):
    """Templates by key, each with the version (`owner`) whose checks it passed, weakly referenced so that a
    retired version is not kept alive; at most `size`, the least recently used dropped first."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._templates: OrderedDict[bytes, tuple[weakref.ref[Any], Template]] = OrderedDict()

    def get(self, key: bytes) -> tuple[object | None, Template] | None:
        """The owner (None once it is gone) and template kept under `key`, or None."""
        found = self._templates.get(key)
        if found is None:
            return None
        self._templates.move_to_end(key)
        return found[0](), found[1]

    def put(self, key: bytes, owner: object, template: Template) -> None:
        """Keep `template`, checked for `owner`, under `key`."""
        self._templates[key] = (weakref.ref(owner), template)
        self._templates.move_to_end(key)
        if len(self._templates) > self._size:
            self._templates.popitem(last=False)

    def __len__(self) -> int:
        return len(self._templates)
