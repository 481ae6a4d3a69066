"""benchmarks/small_model.py: one of its runs against a real server, rendered, so that a broken script fails here
rather than on the quiet machine the figures are made on; and its TextCNN is the peer harness's."""

from __future__ import annotations

from pathlib import Path

import pytest

from small_model import CEILING_BATCH, build_textcnn, measure, render
from tests.live_server import LiveServer


def test_textcnn_is_the_peer_harness_size() -> None:
    model = build_textcnn()
    assert (tuple(model.input.shape), model.input.dtype, tuple(model.output.shape)) == ((None, 64), "int32", (None, 4))
    assert model.get_layer("embedding").output_dim == 64
    assert [model.get_layer(f"conv{k}").filters for k in (3, 4, 5)] == [64, 64, 64]
    assert model.count_params() == 20000 * 64 + sum(k * 64 * 64 + 64 for k in (3, 4, 5)) + 3 * 64 * 4 + 4


@pytest.mark.slow
def test_a_grpc_run_has_both_ceilings_and_renders(server: LiveServer, repository: Path) -> None:
    run = measure(server.url, server.grpc_port, repository, "gRPC", "mlp", [1, 4], 0.4)
    report = run["report"]
    assert report["options"]["protocol"] == "grpc" and report["options"]["in_process_threads"] == 2
    assert [step["concurrency"] for step in report["bare"]] == [1, 4]  # the bare gRPC stack, taking turns
    assert list(report["in_process"]["samples_s"]) == [CEILING_BATCH]
    for step in report["steps"]:
        assert step["errors"] == {} and step["vs_bare"] > 0 and step["vs_in_process"] > 0
        assert step["mean_batch_size"] >= 1  # the server's batches over the step, from its /metrics
        assert run["at_batch"][str(max(1, round(step["mean_batch_size"])))] > 0
    # A text run as the script makes it: the bare stack only, no ceiling in process.
    steps = [{k: v for k, v in step.items() if k != "vs_in_process"} for step in report["steps"]]
    text = {"label": "text /classify", "model": "reviews", "report": {"steps": steps, "bare": report["bare"]}}
    rendered = render({"runs": [run, text]})
    header, _, *rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in rendered.splitlines()[:6]]
    grpc, plain = [dict(zip(header, row, strict=True)) for row in rows[:4:2]]
    assert "-" not in grpc.values(), rendered
    first = report["steps"][0]
    assert grpc["server cores"] == f"{first['server_cpu_percent'] / 100:.2f}", rendered
    assert grpc["served / ORT b32 x2"] == f"{first['vs_in_process']:.2f}", rendered
    ceilings = ("ORT at batch rows/s", "served / ORT at batch", "ORT b32 x2 rows/s", "served / ORT b32 x2")
    assert [plain[column] for column in ceilings] == ["-"] * 4, rendered
    assert "-" not in (plain["served / bare"], plain["batch"]), rendered
