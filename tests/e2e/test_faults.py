"""Faults degrade one thing, loudly: a model file deleted while serving, a read-only repository (served; apply,
unpin and training refused with a 409 before they start), and no unpickling anywhere but the demo's restricted
converter."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import keras
import numpy as np
import pytest

from corpora import rotten_tomatoes
from layerserve.settings import Settings
from layerserve.training.recipe import TextTrainingParams, train_text_classifier, write_version
from tests.live_server import start_server
from tests.models import build_mlp, save_model
from tests.read_only import read_only

X = {"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0.5] * 10}


def test_model_file_deleted_while_serving(tmp_path: Path) -> None:
    save_model(build_mlp(1), tmp_path / "repo" / "mlp" / "1", "model.keras")
    settings = Settings(model_repository=tmp_path / "repo", engine_cache_dir=tmp_path / "cache", reload_interval_s=0.2)
    live = start_server(settings)
    try:
        url = f"{live.url}/v2/models/mlp/infer"
        before = httpx.post(url, json={"inputs": [X]}).json()["outputs"][0]["data"]
        (tmp_path / "repo" / "mlp" / "1" / "model.keras").unlink()
        layer = httpx.post(url, json={"inputs": [X], "outputs": [{"name": "hidden"}]})
        assert layer.status_code == 200, layer.text  # the cut comes out of the export: it needs no model file
        model = build_mlp(1)
        hidden = keras.Model(model.inputs, model.get_layer("hidden").output)(np.array([X["data"]], np.float32))
        np.testing.assert_allclose(layer.json()["outputs"][0]["data"], np.asarray(hidden)[0], atol=1e-5)
        time.sleep(1.0)  # a few polls: the reload of the changed folder fails, the loaded version stays
        after = httpx.post(url, json={"inputs": [X]})
        assert after.status_code == 200 and after.json()["outputs"][0]["data"] == before
        index = httpx.post(f"{live.url}/v2/repository/index").json()
        assert index[0]["state"] == "READY" and "reload failed" in index[0]["reason"]
        assert "holds no model file" in index[0]["reason"]
    finally:
        live.stop()


def test_a_read_only_repository_serves_and_refuses_changes_before_they_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where job records go when the repository is read-only
    repo = tmp_path / "repo"
    texts, labels = rotten_tomatoes(300)
    params = TextTrainingParams(epochs=1)
    write_version(repo / "reviews", train_text_classifier(texts, labels, params), params)
    with (tmp_path / "reviews.csv").open("w", newline="") as data:
        csv.writer(data).writerows([("text", "label"), *zip(texts, labels, strict=True)])
    with read_only(repo):
        live = start_server(Settings(model_repository=repo, engine_cache_dir=tmp_path / "cache"))  # no jobs_dir
        try:
            url = live.url
            assert httpx.get(f"{url}/v2/jobs").json() == {"jobs": []}  # the records live elsewhere
            assert (tmp_path / "home" / ".cache" / "layerserve" / "jobs" / "jobs.sqlite3").is_file()
            for path, body, folder in (
                ("reviews/versions/1/apply", None, repo / "reviews"),
                ("reviews/apply", {"version": "latest"}, repo / "reviews"),
                ("reviews/train", {"dataset": {"texts": texts, "labels": labels}}, repo / "reviews"),
                ("new_model/train", {"dataset": {"texts": texts, "labels": labels}}, repo),
            ):
                answer = httpx.post(f"{url}/v2/models/{path}", json=body)
                assert answer.status_code == 409, (path, answer.text)
                error = answer.json()["error"]
                assert f"folder {folder} cannot be written" in error and "mounted read-write" in error, error
                assert re.search("Read-only file system|Permission denied", error), error
            assert httpx.get(f"{url}/v2/jobs").json() == {"jobs": []}  # no job was started
            assert sorted(p.name for p in repo.iterdir()) == ["reviews"]
            assert sorted(p.name for p in (repo / "reviews").iterdir()) == ["1", "config.yaml"]
            answer = httpx.post(f"{url}/v2/models/reviews/classify", json={"texts": ["a fine film"]})
            assert answer.status_code == 200  # the server serves on
            assert httpx.get(f"{url}/v2/health/ready").status_code == 200
        finally:
            live.stop()
        data_flag = ["--data", str(tmp_path / "reviews.csv")]
        command = [sys.executable, "-m", "layerserve", "train", str(repo), "reviews", *data_flag]
        cli = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        assert cli.returncode == 2 and f"folder {repo / 'reviews'} cannot be written" in cli.stderr, cli.stderr


def test_nothing_is_unpickled_but_the_demo_checkpoint() -> None:
    source = Path(__file__).parents[2] / "src" / "layerserve"
    for path in source.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "allow_pickle=True" not in text, path
        if path.name != "torch_checkpoint.py":
            assert not re.search(r"^\s*(import pickle|from pickle|import dill|import joblib)", text, re.M), path
            assert "pickle.load" not in text and "np.load(" not in text, path


def test_job_records_of_an_older_layerserve_are_read_and_upgraded(tmp_path: Path) -> None:
    import sqlite3

    from layerserve.training.job_store import JobState, JobStore

    old = sqlite3.connect(tmp_path / "jobs.sqlite3")
    old.execute(
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, model TEXT, params TEXT, apply INTEGER, rows INTEGER, state TEXT, "
        "created_at REAL, started_at REAL, finished_at REAL, progress TEXT, history TEXT, version INTEGER, error TEXT)"
    )
    old.execute("INSERT INTO jobs VALUES ('a1', 'reviews', '{}', 0, 10, 'succeeded', 1.0, 2.0, 3.0, '{}', '[]', 4, '')")
    old.commit()
    old.close()
    store = JobStore(tmp_path / "jobs.sqlite3")
    try:
        (job,) = store.all()
        assert (job.id, job.state, job.version, job.owner, job.pid) == ("a1", JobState.SUCCEEDED, 4, None, None)
        store.request_cancel("a1", mark_cancelled=False)
        store.save(job)  # a save leaves the cancel request alone
        assert store.is_cancel_requested("a1") and store.get("a1") == job
    finally:
        store.close()


def test_unusable_job_records_disable_training_only(tmp_path: Path) -> None:
    save_model(build_mlp(1), tmp_path / "repo" / "mlp" / "1", "model.keras")
    (tmp_path / "not-a-folder").write_text("a file where the jobs folder should be")
    settings = Settings(
        model_repository=tmp_path / "repo", engine_cache_dir=tmp_path / "cache",
        jobs_dir=tmp_path / "not-a-folder" / "jobs",
    )  # fmt: skip
    live = start_server(settings)
    try:
        assert httpx.post(f"{live.url}/v2/models/mlp/infer", json={"inputs": [X]}).status_code == 200
        train = httpx.post(
            f"{live.url}/v2/models/new/train", json={"dataset": {"texts": ["a", "b"], "labels": ["x", "y"]}}
        )
        assert train.status_code == 503 and "training jobs are unavailable" in train.json()["error"]
        assert httpx.get(f"{live.url}/v2/jobs").status_code == 503
    finally:
        live.stop()
