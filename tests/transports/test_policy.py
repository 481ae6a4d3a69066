"""RequestPolicy alone: tokens, statuses in each door's terms, the error boundary, records and cancellation (the same
cases against every door, end to end: tests/transports/test_doors.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from layerserve.errors import LayerserveError, NotReadyError
from layerserve.settings import Settings
from layerserve.transports.policy import (
    CLIENT_CLOSED,
    Access,
    Exchange,
    Refusal,
    RequestPolicy,
    grpc_access,
    grpc_code_name,
    http_access,
)


def _policy(**values: object) -> RequestPolicy:
    return RequestPolicy(Settings(model_repository=".", **values))  # type: ignore[arg-type]


def test_paths_and_rpcs_need_their_tokens() -> None:
    assert http_access("/v2/health/ready") is Access.PUBLIC and http_access("/console/app.js") is Access.PUBLIC
    assert http_access("/v2/models/m/infer") is Access.API and http_access("/metrics") is Access.API
    for path in ("/v2/repository/index", "/v2/models/m/versions/2/apply", "/v2/models/m/train", "/v2/jobs/x"):
        assert http_access(path) is Access.ADMIN, path
    assert grpc_access("ServerLive") is Access.PUBLIC and grpc_access("RepositoryModelLoad") is Access.ADMIN
    assert grpc_access("ModelInfer") is Access.API


def test_tokens_are_checked_in_constant_time_and_refused_as_401_or_403() -> None:
    policy = _policy(admin_token="admin", api_token="api")
    assert policy.needs_tokens
    assert policy.authorize(Access.PUBLIC, None) is None
    assert policy.authorize(Access.API, b"Bearer api") is None and policy.authorize(Access.API, b"bearer admin") is None
    assert policy.authorize(Access.ADMIN, b"Bearer admin") is None
    refused = policy.authorize(Access.API, None)
    assert refused is not None and refused.status == 401 and "needs an API token" in refused.message
    refused = policy.authorize(Access.ADMIN, b"Bearer api")
    assert refused is not None and refused.status == 403 and "not an admin token" in refused.message
    refused = policy.authorize(Access.API, b"Basic YWxhZGRpbjpvcGVuc2VzYW1l")
    assert refused is not None and refused.status == 401
    open_policy = _policy()
    assert not open_policy.needs_tokens and open_policy.authorize(Access.ADMIN, None) is None


def test_every_status_has_its_grpc_code() -> None:
    codes = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
             409: "FAILED_PRECONDITION", 413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT",
             CLIENT_CLOSED: "CANCELLED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
             418: "INVALID_ARGUMENT", 502: "UNAVAILABLE"}  # fmt: skip
    for status, name in codes.items():
        assert grpc_code_name(status) == name, status


def test_deadlines_take_the_sooner() -> None:
    assert RequestPolicy.deadline_ms(None, None) is None and RequestPolicy.deadline_ms(50, None) == 50
    assert RequestPolicy.deadline_ms(None, 0.2) == 200 and RequestPolicy.deadline_ms(50, 0.2) == 50
    assert RequestPolicy.deadline_ms(500, 0.0001) == 1


def test_our_errors_are_refusals_and_a_bug_is_one_logged_500(caplog: pytest.LogCaptureFixture) -> None:
    policy = _policy()

    async def not_ready() -> None:
        raise NotReadyError("loading")

    async def bug() -> None:
        raise RuntimeError("a bug")

    async def ours_of_the_500_class() -> None:
        raise LayerserveError("also a bug")

    exchange = Exchange("POST", "/v2/models/m/infer", "v2.infer", Access.API, None)
    assert asyncio.run(policy.run(exchange, not_ready)) == Refusal(503, "loading") and exchange.status == 503
    with caplog.at_level(logging.ERROR, "layerserve.transports"):
        for failing in (bug, ours_of_the_500_class):
            exchange = Exchange("GRPC", "/inference.GRPCInferenceService/ModelInfer", "grpc.ModelInfer", Access.API,
                                None, is_grpc=True)  # fmt: skip
            refused = asyncio.run(policy.run(exchange, failing))
            assert isinstance(refused, Refusal) and refused.status == 500 and exchange.status == 500
            assert refused.message.startswith("internal error ")
            logged = [r for r in caplog.records if refused.message.removeprefix("internal error ") in r.getMessage()]
            assert len(logged) == 1 and logged[0].exc_info is not None


def test_every_exchange_is_written_to_the_access_log_in_its_door_s_terms(caplog: pytest.LogCaptureFixture) -> None:
    policy = _policy(access_log=True)

    async def answer() -> str:
        return "answer"

    grpc_call = Exchange("GRPC", "/inference.GRPCInferenceService/ModelMetadata", "grpc.ModelMetadata", Access.API,
                         None, is_grpc=True)  # fmt: skip
    http_request = Exchange("GET", "/v2/models/m", "v2.model_metadata", Access.API, None)
    with caplog.at_level(logging.INFO, "layerserve.access"):
        assert asyncio.run(policy.run(grpc_call, answer)) == "answer"

        async def http_answer() -> str:
            http_request.status = 200  # an HTTP door sets the status of the answer it wrote
            return "answer"

        asyncio.run(policy.run(http_request, http_answer))
    grpc_record, http_record = [r for r in caplog.records if r.name == "layerserve.access"]
    assert grpc_record.getMessage().startswith(
        "GRPC /inference.GRPCInferenceService/ModelMetadata route=grpc.ModelMetadata"
    )
    assert grpc_record.status == "OK" and grpc_record.route == "grpc.ModelMetadata"  # type: ignore[attr-defined]
    assert http_record.status == 200 and http_record.route == "v2.model_metadata"  # type: ignore[attr-defined]


def test_a_cancelled_exchange_is_recorded_with_the_status_its_door_gave(caplog: pytest.LogCaptureFixture) -> None:
    policy = _policy(access_log=True)

    async def scenario(status: int | None) -> Exchange:
        exchange = Exchange("GRPC", "/x/ModelInfer", "grpc.ModelInfer", Access.API, None, is_grpc=True)
        started = asyncio.Event()

        async def waits() -> None:
            started.set()
            await asyncio.Event().wait()

        task = asyncio.create_task(policy.run(exchange, waits))
        await started.wait()
        if status is None:
            task.cancel()  # the host cancelled it (the client went, or a shutdown)
        else:
            exchange.cancel(status)
        with pytest.raises(asyncio.CancelledError):
            await task
        return exchange

    with caplog.at_level(logging.INFO, "layerserve.access"):
        assert asyncio.run(scenario(None)).status == CLIENT_CLOSED
        assert asyncio.run(scenario(504)).status == 504
    statuses = [r.status for r in caplog.records if r.name == "layerserve.access"]  # type: ignore[attr-defined]
    assert statuses == ["CANCELLED", "DEADLINE_EXCEEDED"]
