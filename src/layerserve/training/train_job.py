"""One training job, in its own process: `python -m layerserve.training.train_job JOB_DIR`.

Reads `job.json` (model folder, params, tag, threads) and `data.jsonl` from JOB_DIR, trains at idle CPU
priority on `threads` threads, writes the version atomically, and reports on stdout, one JSON object a
line: `{"progress": {...}}` during training, `{"summary": {"best_epoch", "epochs_run"}}` once it ends, then
`{"version": N}`, or `{"error": "..."}` (exit code 1).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layerserve.tracing import JobTracer

JOB_FILE = "job.json"
DATA_FILE = "data.jsonl"


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def run(job_dir: Path) -> int:
    """Run the job described in `job_dir`; the process exit code."""
    job = json.loads((job_dir / JOB_FILE).read_text(encoding="utf-8"))
    threads = int(job["threads"])
    for name in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ[name] = str(threads)

    from layerserve.errors import LayerserveError
    from layerserve.lifecycle.prepare import exit_with_parent, lower_priority
    from layerserve.logs import import_tensorflow_quietly

    exit_with_parent()
    lower_priority()  # before TensorFlow starts its threads: they inherit it
    import_tensorflow_quietly()
    import tensorflow as tf

    from layerserve.gpu import configure_tensorflow

    configure_tensorflow()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    tracer = _job_tracer(job)

    def report(progress: dict[str, Any]) -> None:
        if tracer is not None:
            tracer.progress(progress)
        _say({"progress": {"phase": "training", **progress}})

    try:
        if job.get("recipe") == "image":
            number = _train_image(job, job_dir, report)
        else:
            number = _train_text(job, job_dir, report)
    except LayerserveError as error:
        _say({"error": error.message})
        if tracer is not None:
            tracer.close(error.message)
        return 1
    if tracer is not None:
        tracer.close()
    _say({"version": number})
    return 0


def _train_text(job: dict[str, Any], job_dir: Path, report: Callable[[dict[str, Any]], None]) -> int:
    """The text recipe on data.jsonl; the version written."""
    from layerserve.training.recipe import TextTrainingParams, train_text_classifier, write_version

    texts, labels = [], []
    with (job_dir / DATA_FILE).open(encoding="utf-8") as data:
        for line in data:
            row = json.loads(line)
            texts.append(row["text"])
            labels.append(row["label"])
    params = TextTrainingParams.model_validate(job["params"])
    trained = train_text_classifier(texts, labels, params, report)
    _say({"summary": {"best_epoch": trained.best_epoch, "epochs_run": len(trained.metrics["loss"])}})
    return write_version(Path(job["model_dir"]), trained, params, tag=job["tag"])


def _train_image(job: dict[str, Any], job_dir: Path, report: Callable[[dict[str, Any]], None]) -> int:
    """The image recipe on the features the server computed (read_features): the head, then the base cut at its
    layer with the head on top, written as the version."""
    from layerserve.lifecycle.model import find_model_file, load_model
    from layerserve.training.image_recipe import (
        ImageTrainingParams,
        read_features,
        served_model,
        train_head,
        write_image_version,
    )  # fmt: skip

    params = ImageTrainingParams.model_validate(job["params"])
    features = read_features(job_dir)
    trained = train_head(features, job["classes"], params, report)
    _say({"summary": {"best_epoch": trained.best_epoch, "epochs_run": len(trained.metrics["loss"])}})
    base = load_model(find_model_file(Path(job["base_folder"])), trust=bool(job["trust"]))
    model = served_model(base, job["layer"], trained.model)
    summary = {"params": params.model_dump(), **job["summary"]}
    return write_image_version(Path(job["model_dir"]), model, trained, summary, job["config_yaml"], tag=job["tag"])


def _job_tracer(job: dict[str, Any]) -> JobTracer | None:
    """The job's tracer when the request that submitted it was traced (its spans: `training job`, an `epoch` each);
    else None."""
    if not job.get("trace"):
        return None
    from layerserve.tracing import JobTracer

    return JobTracer(job["trace"], {"layerserve.model": Path(job["model_dir"]).name, "layerserve.job.id": job["tag"]})


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
