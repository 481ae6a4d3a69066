"""TemplateCache: what a request's repeated part (a V2 binary JSON header, a gRPC ModelInferRequest less its raw
contents) says, parsed and checked once for one version, found again by the part's bytes. Each version has its
own caches (see VersionView.parse_state), so a template never outlives the version it was checked for."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

Template = TypeVar("Template")


class TemplateCache(Generic[Template]):
    """Templates by key; at most `size`, the least recently used dropped first."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._templates: OrderedDict[bytes, Template] = OrderedDict()

    def get(self, key: bytes) -> Template | None:
        """The template kept under `key`, or None."""
        found = self._templates.get(key)
        if found is not None:
            self._templates.move_to_end(key)
        return found

    def put(self, key: bytes, template: Template) -> None:
        """Keep `template` under `key`."""
        self._templates[key] = template
        self._templates.move_to_end(key)
        if len(self._templates) > self._size:
            self._templates.popitem(last=False)

    def __len__(self) -> int:
        return len(self._templates)
