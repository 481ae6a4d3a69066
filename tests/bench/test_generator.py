"""`layerserve bench` against a real server: every request is counted by the server, reports are complete."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest

from layerserve.bench.generator import (
    BenchOptions,
    InProcessModel,
    _taking_turns,
    build_workload,
    print_report,
    run_bench,
)
from layerserve.errors import BadRequestError
from tests.live_server import LiveServer, free_port


def _rows_served(server: LiveServer, model: str, version: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf'layerserve_batch_size_sum{{model="{model}",version="{version}"}} (\S+)', text)
    return float(match.group(1)) if match else 0.0


def test_concurrency_1_takes_turns_request_by_request_with_the_model_in_process(
    server: LiveServer, repository: Path
) -> None:
    workload = build_workload(server.url, "multi", "tensor", 3, None, use_cache=False)
    model = InProcessModel(repository, "multi", workload)
    try:
        before = _rows_served(server, "multi", "1")
        answered, calls = _taking_turns(server.url, workload, model, 0.5)
    finally:
        model.close()
    assert len(answered) == len(calls) > 5  # one request, then one call, each timed on its own
    assert _rows_served(server, "multi", "1") - before == 3 * len(answered)  # the server computed every request
    assert all(0 < seconds < 5 for seconds in answered + calls)


def test_bench_tensor_workload_with_bare_baseline_and_ceiling(
    server: LiveServer,
    repository: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options = BenchOptions(
        url=server.url, model="multi", workload="tensor", concurrency=[1, 4], duration_s=0.5, rows=3,
        in_process=repository, batch_sizes=(1, 8), bare=True, output=tmp_path / "r.json", plot=tmp_path / "r.png",
    )  # fmt: skip
    before = _rows_served(server, "multi", "1")
    report = run_bench(options)
    served = _rows_served(server, "multi", "1") - before
    steps = report["steps"]
    assert [s["concurrency"] for s in steps] == [1, 4]
    for step in steps:
        assert step["errors"] == {} and step["requests"] > 0
        assert step["samples_s"] == pytest.approx(3 * step["req_s"])
        assert 0 < step["p50_ms"] <= step["p90_ms"] <= step["p99_ms"]
        assert step["server_cpu_percent"] is not None and step["server_rss_bytes"] > 0
        assert "vs_in_process" in step and 0 < step["vs_bare"] < math.inf  # the median of the paired slices
        assert 0.5 <= step["duration_s"] < 5  # the slices add up to the step (each until its last answer)
        assert step["mean_batch_size"] >= 3  # rows per model call, from the server's /metrics: 3 a request at least
    assert served >= 3 * sum(s["requests"] for s in steps)  # the server saw every row (plus the warm-up)
    # At concurrency 1 only: served p50 over the model's own batch of one, in process (a loopback round trip more).
    assert math.isfinite(steps[0]["p50_over_in_process_ms"]) and "p50_over_in_process_ms" not in steps[1]
    assert report["paired_rounds"] == 4
    assert report["in_process"]["best_batch_size"] in (1, 8)
    assert [s["concurrency"] for s in report["bare"]] == [1, 4]
    assert json.loads((tmp_path / "r.json").read_text())["steps"][0]["concurrency"] == 1
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setenv("COLUMNS", "80")  # a pipe's width: the table is wider, and no figure may be cut short
    capsys.readouterr()
    print_report(report)
    printed = capsys.readouterr().out
    assert "…" not in printed, printed
    for step in steps:
        assert f"{step['req_s']:.1f}" in printed and f"{step['vs_bare']:.2f}" in printed, printed


def test_json_workload_and_errors_by_status(server: LiveServer) -> None:
    workload = build_workload(server.url, "mlp", "tensor-json", 2, None)
    assert json.loads(workload.body)["inputs"][0]["shape"] == [2, 10]
    report = run_bench(
        BenchOptions(url=server.url, model="corrupt", workload="tensor", concurrency=[1], duration_s=0.3)
    )
    assert set(report["steps"][0]["errors"]) == {"503"}


def test_a_server_that_is_down_or_lacks_the_model_is_one_clear_error(server: LiveServer) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    for workload in ("tensor", "text"):
        with pytest.raises(
            BadRequestError, match=rf"^cannot reach the server at {down}/v2/models/mlp: .*; is it running"
        ):
            run_bench(BenchOptions(url=down, model="mlp", workload=workload, concurrency=[1], duration_s=0.3))
    with pytest.raises(
        BadRequestError, match=r"^GET .*/v2/models/nosuch answered 404: unknown model 'nosuch'; models: "
    ):
        run_bench(BenchOptions(url=server.url, model="nosuch", workload="tensor", concurrency=[1], duration_s=0.3))


def test_grpc_protocol_counts_every_request(server: LiveServer) -> None:
    options = BenchOptions(
        url=server.url, model="mlp", workload="tensor", concurrency=[1, 4], duration_s=0.5, rows=2,
        protocol="grpc", grpc_port=server.grpc_port, bare=True,
    )  # fmt: skip
    before = _rows_served(server, "mlp", "2")
    report = run_bench(options)
    served = _rows_served(server, "mlp", "2") - before
    for step in report["steps"]:
        assert step["errors"] == {} and step["requests"] > 0 and step["samples_s"] == pytest.approx(2 * step["req_s"])
        assert "vs_bare" in step and step["mean_batch_size"] >= 2
    assert served >= 2 * sum(s["requests"] for s in report["steps"])
    # The bare gRPC stack answered every call with grpc-status 0 (a status the client could not read counts as 2).
    bare_errors = [step["errors"] for step in report["bare"]]
    assert all(step["errors"] == {} and step["requests"] > 0 for step in report["bare"]), bare_errors
    errors = run_bench(BenchOptions(url=server.url, model="corrupt", workload="tensor", concurrency=[1],
                                    duration_s=0.3, protocol="grpc", grpc_port=server.grpc_port))  # fmt: skip
    assert set(errors["steps"][0]["errors"]) == {"14"}  # UNAVAILABLE
