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
    from layerserve.training.recipe import TextTrainingParams, train_text_classifier, write_version

    exit_with_parent()
    lower_priority()  # before TensorFlow starts its threads: they inherit it
    import_tensorflow_quietly()
    import tensorflow as tf

    from layerserve.gpu import configure_tensorflow

    configure_tensorflow()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    texts, labels = [], []
    with (job_dir / DATA_FILE).open(encoding="utf-8") as data:
        for line in data:
            row = json.loads(line)
            texts.append(row["text"])
            labels.append(row["label"])
    params = TextTrainingParams.model_validate(job["params"])
    tracer = _job_tracer(job)

    def report(progress: dict[str, Any]) -> None:
        if tracer is not None:
            tracer.progress(progress)
        _say({"progress": progress})

    try:
        trained = train_text_classifier(texts, labels, params, report)
        _say({"summary": {"best_epoch": trained.best_epoch, "epochs_run": len(trained.metrics["loss"])}})
        number = write_version(Path(job["model_dir"]), trained, params, tag=job["tag"])
    except LayerserveError as error:
        _say({"error": error.message})
        if tracer is not None:
            tracer.close(error.message)
        return 1
    if tracer is not None:
        tracer.close()
    _say({"version": number})
    return 0


def _job_tracer(job: dict[str, Any]) -> JobTracer | None:
    """The job's tracer when the request that submitted it was traced (its spans: `training job`, an `epoch` each);
    else None."""
    if not job.get("trace"):
        return None
    from layerserve.tracing import JobTracer

    return JobTracer(job["trace"], {"layerserve.model": Path(job["model_dir"]).name, "layerserve.job.id": job["tag"]})


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
