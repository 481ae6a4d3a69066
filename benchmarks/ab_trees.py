"""A change's effect on served speed: the tree before it and the checkout as it is now, served side by side and
measured in turns.

    .venv/bin/python benchmarks/ab_trees.py REF [--model token_classifier] [--workload tensor [tensor-json ...]]
                                                [--concurrency 8 [32 ...]] [--slice-s 3] [--rounds 8] [--json PATH]
                                                [--protocol http|grpc]

REF (a commit, branch or tag) is checked out into a temporary git worktree and served from there (its `src` first on
PYTHONPATH, with this checkout's virtual environment); this checkout, uncommitted changes included, is served beside
it. Both serve one copy of the demo repository, with a text model of its own (`reviews`, as `small_model.py` trains
it) for the `text` workload and `textcnn` (as `small_model.py` builds it) when it is the model; the `image` workload
sends scikit-image's chelsea as a JPEG (as `classify.py` does) to `/classify`. Then slices of `layerserve bench` load
(feature cache bypassed) take turns on the two servers, the order alternating from round to round: this machine's
speed drifts by up to 2x within minutes, so only slices measured side by side compare. With `--protocol grpc` the
slices are gRPC ModelInfer calls to each server's gRPC door (its HTTP port + 100) instead of REST. Printed: each
round's requests a second and server CPU per request for both, and the median of the rounds' ratios (now / REF). Run
it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server, sample_jpeg
from layerserve.bench.generator import WORKLOADS, BenchOptions, run_bench
from layerserve.demo import build_demo_repository
from results import ROOT, arguments, table, write_result
from small_model import TEXT, text_model, textcnn_model


def worktree(ref: str, target: Path) -> None:
    """Check `ref` out into `target` (a detached git worktree of this checkout).

    Raises:
        SystemExit: `ref` names no commit.
    """

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)

    if git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode != 0:
        raise SystemExit(f"{ref!r} names no commit of this checkout")
    added = git("worktree", "add", "--detach", str(target), ref)
    if added.returncode != 0:
        raise SystemExit(f"git worktree add failed: {added.stderr.strip()}")


def slice_of_load(
    url: str, args: argparse.Namespace, workload: str, concurrency: int, image: Path | None
) -> tuple[float, float | None]:
    """One slice of load on one server: its requests a second and the server's CPU microseconds per request."""
    port = int(url.rsplit(":", 1)[1])
    options = BenchOptions(
        url, args.model, workload, [concurrency], args.slice_s, image=image, use_cache=False,
        text=TEXT if workload == "text" else "", protocol=args.protocol, grpc_port=int(_grpc(port)[1]),
    )  # fmt: skip
    (step,) = run_bench(options)["steps"]
    cpu = step["server_cpu_percent"]
    per_request = None if cpu is None or not step["req_s"] else cpu / 100 / step["req_s"] * 1e6
    return step["req_s"], per_request


def _grpc(port: int) -> tuple[str, str]:
    """The gRPC port flag of the server on HTTP `port`: two servers must not both take the default."""
    return "--grpc-port", str(port + 100)


def render(result: dict[str, Any]) -> str:
    """Each workload and concurrency: the median of each tree's rounds, and the median of the rounds' ratios."""
    ref = result["parameters"]["ref"]
    header = ["protocol", "workload", "concurrency", f"{ref} req/s", "now req/s", "now / ref (median of rounds)",
              "range", f"{ref} server us/request", "now server us/request"]  # fmt: skip
    protocol = result["parameters"].get("protocol", "http")
    rows: list[list[Any]] = []
    for step in result["steps"]:
        before, after = step["ref"], step["now"]
        ratios = [a[0] / b[0] for b, a in zip(before, after, strict=True)]
        cpu = [[r[1] for r in rounds if r[1] is not None] for rounds in (before, after)]
        rows.append([
            protocol, step["workload"], step["concurrency"], statistics.median(r[0] for r in before),
            statistics.median(r[0] for r in after), step["median_ratio"], f"{min(ratios):.2f}-{max(ratios):.2f}",
            statistics.median(cpu[0]) if cpu[0] else "-", statistics.median(cpu[1]) if cpu[1] else "-",
        ])  # fmt: skip
    return table(header, rows)


def main() -> None:
    """Serve both trees, take turns measuring them; print the table (and write the result as JSON with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ref", help="the commit, branch or tag to compare this checkout with")
    parser.add_argument("--model", default="token_classifier")
    parser.add_argument("--workload", choices=WORKLOADS, nargs="+", default=["tensor"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--slice-s", type=float, default=3.0, help="seconds of load per slice")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of one slice on each server")
    parser.add_argument("--port", type=int, default=8781, help="the REF server's port; now's is the next one")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http", help="REST, or the gRPC door")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layerserve-ab-"))
    worktree(args.ref, work / "ref")
    try:
        repository = work / "repo"
        build_demo_repository(repository)
        if "text" in args.workload:
            text_model(repository)
        if args.model == "textcnn":
            textcnn_model(repository)
        image = sample_jpeg(work / "chelsea.jpg") if "image" in args.workload else None
        with contextlib.ExitStack() as servers:
            ref_server = demo_server(args.port, repository, *_grpc(args.port), source=work / "ref" / "src")
            ref_url, _ = servers.enter_context(ref_server)
            now_url, _ = servers.enter_context(demo_server(args.port + 1, repository, *_grpc(args.port + 1)))
            steps = []
            for workload in args.workload:
                for concurrency in args.concurrency:
                    figures: dict[str, list[tuple[float, float | None]]] = {"ref": [], "now": []}
                    for round_number in range(args.rounds):
                        order = [("ref", ref_url), ("now", now_url)]
                        for name, url in order if round_number % 2 == 0 else reversed(order):
                            figures[name].append(slice_of_load(url, args, workload, concurrency, image))
                    ratios = [a[0] / b[0] for b, a in zip(figures["ref"], figures["now"], strict=True)]
                    steps.append({"workload": workload, "concurrency": concurrency, **figures,
                                  "median_ratio": statistics.median(ratios)})  # fmt: skip
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(work / "ref")], cwd=ROOT, check=False)
    result = {"parameters": arguments(args), "steps": steps}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
