"""Pooling a layer's output into one feature vector per input."""

from __future__ import annotations

from layerserve.errors import BadRequestError
from layerserve.tensors import Array

POOLS = ("none", "avg", "max")


def pool_features(output: Array, pool: str | None) -> Array:
    """`avg`/`max` over every axis between the batch and the last (spatial or time); `none` keeps the shape.

    The default (None, or "default") is `avg` for maps with such axes and `none` for vectors.
    """
    axes = tuple(range(1, output.ndim - 1))
    chosen = pool if pool in POOLS else ("avg" if axes else "none")
    if chosen == "none" or not axes:
        return output
    pooled: Array = output.mean(axis=axes) if chosen == "avg" else output.max(axis=axes)
    return pooled


def check_pool(pool: str, what: str = "pool") -> None:
    """Raises BadRequestError unless `pool` is one of POOLS ("" and "default" pick per output, see above)."""
    if pool not in ("", "default", *POOLS):
        raise BadRequestError(f"{what} must be one of {', '.join(POOLS)}, got {pool!r}")
