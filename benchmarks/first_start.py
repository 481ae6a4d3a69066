"""Peak memory of a server's first start, on a cold export cache and on one filled by `layerserve export`: the demo
token classifier and EfficientNet-Lite0.

    .venv/bin/python benchmarks/first_start.py [--after-s 5] [--json PATH]

Each start is `layerserve serve REPO --models token_classifier,efficientnet_lite0` on an export cache of its own.
Every 50 ms, from the start until `--after-s` seconds after each model answered its first request (one V2 infer of
a row of zeros), the resident memory of the server's whole process tree (the server, its engine processes, the
preparer's child) is summed: RSS, which counts pages shared by processes in each, and PSS, which shares them out
(closer to what a container's memory limit counts). Three starts: cold (the preparer's child exports both models,
then stays `preparer_idle_s`, 60 s by default), cold with `--preparer-idle-s 0` (it exits once the start's loads are
done), and warm, on a cache that `layerserve export` filled beforehand (its own peak and duration are reported too:
in an image build or an init container, not in the serving pod).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import httpx

from cold_start import infer_body
from demo_server import wait_ready
from many_models_load import sample_memory
from results import arguments, table, write_result
from soak_server import free_port

MODELS = ("token_classifier", "efficientnet_lite0")
_EVERY_S = 0.05


@dataclass
class TreeSampler:
    """Samples the summed memory of a process and its descendants on a thread, keeping the peaks."""

    root: int
    peak_rss_kb: int = 0
    peak_pss_kb: int = 0
    last_rss_kb: int = 0
    last_pss_kb: int = 0
    last_roles: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        """One sample of every live process of the tree."""
        now = sample_memory(self.root, False, 0.0)
        rss, pss = now.rss_bytes // 1024, now.pss_bytes // 1024
        self.peak_rss_kb, self.peak_pss_kb = max(self.peak_rss_kb, rss), max(self.peak_pss_kb, pss)
        self.last_rss_kb, self.last_pss_kb = rss, pss
        self.last_roles = {role for role, taken in now.by_role.items() if taken}

    def run(self) -> None:
        """Sample until `stop`."""
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(_EVERY_S)

    def stop(self) -> None:
        """End the sampling."""
        self._stop.set()


@contextlib.contextmanager
def sampled(process: subprocess.Popen[bytes]) -> Iterator[TreeSampler]:
    """Sample the process's tree while the block runs; yields the sampler."""
    sampler = TreeSampler(process.pid)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        yield sampler
    finally:
        sampler.stop()
        thread.join()


def export(repository: Path, cache: Path) -> dict[str, Any]:
    """`layerserve export` into `cache`: its duration and the peak of its process tree."""
    command = [sys.executable, "-m", "layerserve", "export", str(repository), "--engine-cache-dir", str(cache)]
    started = time.monotonic()
    process = subprocess.Popen([*command, "--models", ",".join(MODELS)], stdout=subprocess.PIPE)
    with sampled(process) as sampler:
        output, _ = process.communicate()
    assert process.returncode == 0, output.decode()
    return {
        "seconds": time.monotonic() - started, "peak_rss_mib": sampler.peak_rss_kb / 1024,
        "peak_pss_mib": sampler.peak_pss_kb / 1024, "summary": output.decode().splitlines()[-1],
    }  # fmt: skip


def first_start(repository: Path, cache: Path, after_s: float, *flags: str) -> dict[str, Any]:
    """Serve until each model answered a first request and `after_s` more seconds: the peaks and the memory then."""
    port = free_port()
    command = [sys.executable, "-m", "layerserve", "serve", str(repository), "--port", str(port), "--grpc-port", "0"]
    command += ["--engine-cache-dir", str(cache), "--log-level", "warning", "--models", ",".join(MODELS), *flags]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        with sampled(process) as sampler:
            wait_ready(url)
            ready_s = time.monotonic() - started
            with httpx.Client(base_url=url, timeout=120) as client:
                for model in MODELS:
                    body = infer_body(client.get(f"/v2/models/{model}").raise_for_status().json())
                    client.post(f"/v2/models/{model}/infer", json=body).raise_for_status()
            answered_s = time.monotonic() - started
            peak_rss, peak_pss = sampler.peak_rss_kb, sampler.peak_pss_kb
            time.sleep(after_s)
    finally:
        process.terminate()
        process.wait(timeout=60)
    return {
        "ready_s": ready_s, "answered_s": answered_s, "peak_rss_mib": peak_rss / 1024,
        "peak_pss_mib": peak_pss / 1024, "after_rss_mib": sampler.last_rss_kb / 1024,
        "after_pss_mib": sampler.last_pss_kb / 1024,
        "roles_after": sorted(sampler.last_roles),
    }  # fmt: skip


def render(result: dict[str, Any]) -> str:
    """One row per start: time to ready and to the first answers, the peak, and the memory some seconds later."""
    after = result["parameters"]["after_s"]
    header = ["start", "ready s", "first answers s", "peak RSS MiB", "peak PSS MiB", f"RSS {after:g} s later MiB",
              f"PSS {after:g} s later MiB", "preparer's child then"]  # fmt: skip
    rows = [
        [row["start"], row["ready_s"], row["answered_s"], row["peak_rss_mib"], row["peak_pss_mib"],
         row["after_rss_mib"], row["after_pss_mib"], "running" if "preparer" in row["roles_after"] else "gone"]
        for row in result["rows"]
    ]  # fmt: skip
    ahead = result["export"]
    return (
        f"`layerserve serve` of `{', '.join(MODELS)}`, sampled every {_EVERY_S * 1000:.0f} ms from its start until "
        f"{after:g} s after each model answered its first request; memory summed over the server's process tree. "
        f"The warm start's cache was filled by `layerserve export` beforehand, in {ahead['seconds']:.0f} s, peaking "
        f"at {ahead['peak_rss_mib']:,.0f} MiB RSS ({ahead['peak_pss_mib']:,.0f} MiB PSS): "
        f"{re.sub(' into [^:]+:', ':', ahead['summary'])}.\n\n"
        f"{table(header, rows)}"
    )


def main() -> None:
    """Build the demo repository; a cold start, a cold start with preparer_idle_s 0, an export and a warm start."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--after-s", type=float, default=5.0, help="how long to sample after the first answers")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layerserve-first-start-"))
    try:
        result = measure(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(render(result))
    if args.json:
        write_result(args.json, result)


def measure(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The demo repository in `work`, and the starts (see the module)."""
    repository = work / "repo"
    subprocess.run([sys.executable, "-m", "layerserve", "demo", "build", str(repository)], check=True)
    rows = [
        {"start": "cold", **first_start(repository, work / "cold", args.after_s)},
        {"start": "cold, preparer_idle_s 0", **first_start(repository, work / "cold-0", args.after_s,
                                                           "--preparer-idle-s", "0")},
    ]  # fmt: skip
    ahead = export(repository, work / "warm")
    rows.append({"start": "warm (after layerserve export)", **first_start(repository, work / "warm", args.after_s)})
    return {"parameters": arguments(args), "export": ahead, "rows": rows}


if __name__ == "__main__":
    main()
