"""25 s of the soak benchmark (benchmarks/soak.py) against `layerserve serve --workers 2`: mixed load, a new version
every 2.5 s, Redis restarted twice, a training job; nothing fails and no serving process grows. (The benchmark itself
runs for 30 minutes by default; this is its smoke test, sized for CI's time, on the session's demo ONNX cache.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from soak import KINDS, SERVING_ROLES, SoakOptions, run_soak


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_25_seconds_of_mixed_load(demo_repository: Path, demo_engine_cache: Path, tmp_path: Path) -> None:
    options = SoakOptions(
        duration_s=25, new_version_every_s=2.5, redis_restarts=2, train_rows=20, train_epochs=1,
        train_at_fraction=0.1, warmup_s=8, repository=demo_repository, work_dir=tmp_path,
        engine_cache_dir=demo_engine_cache,
    )  # fmt: skip
    report = run_soak(options)
    assert report.failure_count == 0, report.failures[:5]
    for kind in KINDS:
        assert report.ok_count(kind) > 0, (kind, report.counts)
    assert [e["event"] for e in report.events].count("redis restarted") == 2
    assert report.versions_created >= 8
    assert len(report.versions["v2_json"]) > 5  # new versions were served, not only copied in
    serving = [p for p in report.processes if p.role in SERVING_ROLES and p.growth_mb is not None]
    assert {p.role for p in serving} >= {"supervisor", "worker", "engine process"}
    assert len([p for p in serving if p.role == "worker"]) == 2
    for process in serving:
        assert process.growth_mb is not None and process.growth_mb < 50, (process.role, process.pid, process.samples)
    assert report.training["state"] == "succeeded", report.training
    assert report.training["served"], report.versions["text_classify"]
    assert report.ready_at_end
    assert report.problems() == []
