"""One error hierarchy: every error layerserve raises carries its HTTP status code."""

from __future__ import annotations


class LayerserveError(Exception):
    """Base of every layerserve error; `status_code` is what the HTTP layer answers."""

    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequestError(LayerserveError):
    """The request is malformed or does not fit the model (400)."""

    status_code = 400


class NotFoundError(LayerserveError):
    """An unknown model, version or route (404)."""

    status_code = 404


class PayloadTooLargeError(LayerserveError):
    """The body is larger than `max_body_bytes` (413)."""

    status_code = 413


class UnsupportedMediaTypeError(LayerserveError):
    """The body's content type cannot be read by this route (415)."""

    status_code = 415


class NotReadyError(LayerserveError):
    """The model or version exists but cannot serve now (503)."""

    status_code = 503


class BudgetFullError(NotReadyError):
    """No room can be made for a load now: every loaded version is in use or kept loaded (503, with Retry-After)."""


class ModelLoadError(LayerserveError):
    """A version could not be loaded; the message is its FAILED reason."""


class LoadFailedError(LayerserveError):
    """A version asked for by load or apply could not be loaded (409); the previous one still serves."""

    status_code = 409


class ConfigError(LayerserveError):
    """A settings value or a model's config.yaml is invalid."""

    status_code = 400


class QueueFullError(LayerserveError):
    """The version's queue holds `max_queue_size` requests already (503, with Retry-After)."""

    status_code = 503


class DeadlineExceededError(LayerserveError):
    """The request's deadline passed before its answer was ready (504)."""

    status_code = 504


class EngineProcessError(LayerserveError):
    """The process that runs a version's engine is gone; the version is FAILED until loaded again (503)."""

    status_code = 503


class UnauthenticatedError(LayerserveError):
    """The call needs a bearer token and sent none (401; gRPC UNAUTHENTICATED)."""

    status_code = 401


class PermissionDeniedError(LayerserveError):
    """The bearer token is not one this call accepts (403; gRPC PERMISSION_DENIED)."""

    status_code = 403


class ClientClosedError(LayerserveError):
    """The client went away before its request was read or answered: nothing is answered (recorded as 499)."""

    status_code = 499
