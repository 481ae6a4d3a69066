"""The many-models benchmark (benchmarks/many_models.py) in its CI size (`--quick`): 80 small models served under a
memory budget of 8% of what they take, a Zipf mix over HTTP and gRPC with one worker and two; nothing fails but the
budget's documented 503s (with Retry-After, naming the budget), versions load and are evicted, and the server's
processes stay within their base plus, per worker, the budget and ONNX Runtime's own cost. (The benchmark itself
serves 1,000 models for 5 minutes a run.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from many_models import QUICK, TOLERANCE_PER_WORKER_BYTES, Options, render, run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_80_models_under_a_budget(tmp_path: Path) -> None:
    options = Options(tmp_path / "many-models", protocols=("http", "grpc"), workers=(1, 2), **QUICK)
    result = run_benchmark(options)
    print(render({"parameters": {"zipf_s": options.zipf_s, **QUICK}, **result}))
    assert result["budget_bytes"] < 0.1 * result["figures_total_bytes"]
    assert [(run["protocol"], run["workers"]) for run in result["scenarios"]] == [
        ("http", 1), ("grpc", 1), ("http", 2), ("grpc", 2),
    ]  # fmt: skip
    for run in result["scenarios"]:
        where = f"{run['protocol']}, {run['workers']} worker(s), log {run['log']}"
        assert run["failed"] == 0, (where, run["failure_examples"])
        assert run["refusals_without_retry_after"] == 0, where
        assert run["ok"] > 100, where
        assert run["warm"] > 0 and run["cold"] > 0, where
        assert run["loads"] > 0 and run["evictions"] > 0, where
        # The limit: the base, and per worker the budget and ONNX Runtime's first session (see many_models.py).
        tolerance = run["workers"] * TOLERANCE_PER_WORKER_BYTES
        assert run["peak_pss_bytes"] <= run["limit_bytes"] + tolerance, (where, run["peak_by_role"])
        assert run["server_alive"], where
