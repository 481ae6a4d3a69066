"""Benchmark results as JSON, stamped with when, on what code and on which machine they were measured.

Every benchmark script takes `--json PATH` and writes its result with `write_result`; `figures.py` runs them all
and renders the tables the docs include from these files (never from figures typed by hand).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, Any]:
    """Cores, CPU model, memory, Python and the system of this machine."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor()
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gib = 0.0
    return {
        "cores": os.cpu_count() or 0,
        "cpu": model,
        "memory_gib": round(memory_gib, 1),
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }


def commit() -> str:
    """The checkout's commit (short), with `-dirty` when files other than the results differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # The results themselves are left out: a run rewrites them.
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/figures")
    return f"{head}-dirty" if changed else head


def stamp() -> dict[str, Any]:
    """When, on which commit, on which machine and by which command this run was made."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": machine(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write one benchmark's result with its stamp (atomically: a run cut short leaves the last good file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps({"stamp": stamp(), **result}, indent=1, default=_plain) + "\n")
    temporary.replace(path)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def read_result(path: Path) -> dict[str, Any]:
    """A result written by `write_result`."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def stamp_line(stamp: dict[str, Any]) -> str:
    """The stamp as one line of Markdown, put above every generated table."""
    where = stamp["machine"]
    return (
        f"*Measured {stamp['date']} on commit `{stamp['commit']}`, {where['cores']} cores ({where['cpu'] or 'CPU'}), "
        f"{where['memory_gib']} GiB, Python {where['python']}: `{stamp['command']}`.*"
    )


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; floats with up to 2 decimals, thousands separated."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def load_parser(
    doc: str | None, port: int, concurrency: list[int], duration_s: float = 10.0
) -> argparse.ArgumentParser:
    """The arguments of a closed-loop load benchmark: `--duration-s`, `--concurrency`, `--port`, `--json`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=duration_s)
    parser.add_argument("--concurrency", type=int, nargs="+", default=concurrency)
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--json", type=Path, help="write the result here")
    return parser


def arguments(args: object) -> dict[str, Any]:
    """A script's parsed arguments, less `--json` and `--port`: the parameters a result was measured with."""
    return {name: value for name, value in vars(args).items() if name not in ("json", "port")}


def bench_tables(report: dict[str, Any]) -> str:
    """A `run_bench` report read back from JSON: its served steps, and its in-process ceiling per batch size."""

    def optional(value: float | None, scale: float = 1.0) -> Any:
        return "-" if value is None else value / scale

    ceiling = report.get("in_process")
    over = any("p50_over_in_process_ms" in step for step in report["steps"])
    header = ["concurrency", "req/s", "samples/s", "p50 ms", "p90 ms", "p99 ms", "errors", "server CPU %",
              "server RSS MB", "load CPU %"] + (["vs in-process ceiling"] if ceiling else [])  # fmt: skip
    header += ["p50 over in-process batch 1 ms"] if over else []
    rows = [
        [step["concurrency"], step["req_s"], step["samples_s"], step["p50_ms"], step["p90_ms"], step["p99_ms"],
         sum(step["errors"].values()), optional(step["server_cpu_percent"]),
         optional(step["server_rss_bytes"], 2**20), step["client_cpu_percent"]]
        + ([step["vs_in_process"]] if ceiling else [])
        + ([optional(step.get("p50_over_in_process_ms"))] if over else [])
        for step in report["steps"]
    ]  # fmt: skip
    options = report["options"]
    cache = "the feature cache bypassed" if not options["use_cache"] else "the feature cache allowed"
    text = f"`{options['workload']}` workload on `{options['model']}`, {cache}.\n\n{table(header, rows)}"
    if ceiling:
        rates = sorted((int(size), rate) for size, rate in ceiling["samples_s"].items())  # JSON keys are strings
        text += "\n\n" + table(["in-process batch size", "samples/s"], [[size, rate] for size, rate in rates])
        if "paired_rounds" not in report:  # measured before the steps took turns with the ceiling
            return text + (
                f"\n\nIn-process ceiling: {ceiling['best_samples_s']:,.1f} samples/s "
                f"(batch {ceiling['best_batch_size']}); the last column is served samples/s over it."
            )
        text += (
            f"\n\nIn-process ceiling: {ceiling['best_samples_s']:,.1f} samples/s "
            f"(batch {ceiling['best_batch_size']}) before the steps. Each step takes turns with the model in "
            f"process, four slices each: \"vs in-process ceiling\" is the median of the slices' served samples/s "
            f"over the in-process samples/s at batch {ceiling['best_batch_size']} right after"
            + (", and at concurrency 1 \"p50 over in-process batch 1\" the median over the four rounds of the served "
               "p50 minus the in-process p50 of a batch of one, a request and a call taking turns one by one." if over
               else ".")
        )  # fmt: skip
    return text


def by_status(answers: dict[str, int]) -> str:
    """Answer counts by HTTP status, as one table cell: `200: 789, 503: 32,241`."""
    return ", ".join(f"{status}: {count:,}" for status, count in sorted(answers.items()))
