"""Every benchmark, one after the other, and the figures the docs show, generated from their JSON results.

    .venv/bin/python benchmarks/figures.py [--only NAME ...] [--skip NAME ...] [--quick] [--render-only]

Each benchmark script runs in a process of its own with `--json benchmarks/figures/NAME.json`; then each result
is rendered by its script's `render(result)` into `benchmarks/figures/NAME.md` (a stamp line, then tables), which
the docs include (`--8<-- "NAME.md"`), and by its `plot(result, path)`, where it has one, into
`docs/img/figures/NAME.png`. The stamp says when, on which commit, on which machine and by which command. Run it on
a quiet machine: nothing else may take the cores meanwhile. `--quick` runs every benchmark briefly, to check that
the command works (its figures are not for the docs); `--render-only` renders the JSON already there.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from results import ROOT, read_result, stamp_line

HERE = Path(__file__).resolve().parent
FIGURES = HERE / "figures"
IMAGES = ROOT / "docs" / "img" / "figures"


@dataclass(frozen=True)
class Benchmark:
    """A script and its arguments for the docs' figures (`quick`: for a short check run)."""

    script: str
    args: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()


BENCHMARKS: dict[str, Benchmark] = {
    "classify": Benchmark("classify.py", ("--duration-s", "10"), ("--duration-s", "1")),
    "tensor_ceiling": Benchmark(
        "serve_vs_inprocess.py", ("--duration-s", "10", "--concurrency", "1", "8", "32"), ("--duration-s", "1")
    ),
    "small_model": Benchmark("small_model.py", ("--duration-s", "10"), ("--duration-s", "1")),
    "grpc_vs_rest": Benchmark("grpc_vs_rest.py", ("--duration-s", "10"), ("--duration-s", "1")),
    "tls_cost": Benchmark("tls_cost.py", ("--duration-s", "10"), ("--duration-s", "1")),
    "feature_cache": Benchmark("feature_cache.py", ("--duration-s", "10"), ("--duration-s", "1")),
    "layers": Benchmark("layers.py", ("--duration-s", "10"), ("--duration-s", "1")),
    "reload_stall": Benchmark(
        "reload_stall.py", ("--duration-s", "30", "--rounds", "6"), ("--duration-s", "4", "--rounds", "1")
    ),
    "poisoned_batch": Benchmark("poisoned_batch.py", (), ("--rounds", "1")),
    "overload": Benchmark("overload.py", ("--duration-s", "60"), ("--duration-s", "5")),
    "workers": Benchmark("workers.py", ("--duration-s", "8"), ("--duration-s", "1")),
    "train_accuracy": Benchmark("train_accuracy.py", (), ("--quick",)),
    "image_head": Benchmark("image_head.py", (), ("--quick",)),
    "train_stall": Benchmark("train_stall.py", ("--duration-s", "12"), ("--duration-s", "3")),
    "memory": Benchmark("memory.py", (), ("--quick",)),
    "cold_start": Benchmark("cold_start.py", ("--rounds", "20", "--warm", "50"), ("--rounds", "2", "--warm", "5")),
    "warmup": Benchmark("warmup.py", ("--rounds", "3", "--requests", "100"), ("--rounds", "1", "--requests", "32")),
    "first_start": Benchmark("first_start.py", ("--after-s", "5"), ("--after-s", "1")),
    "ray_scale": Benchmark(
        "ray_scale.py",
        ("--duration-s", "6", "--ingress", "proxy", "haproxy-lean", "direct"),
        ("--duration-s", "1", "--ingress", "direct"),
    ),
    "soak": Benchmark("soak.py", ("--duration-s", "600"), ("--duration-s", "60", "--warmup-s", "20")),
    "many_models": Benchmark("many_models.py", ("--duration-s", "300"), ("--quick",)),
    "many_models_ray": Benchmark("many_models_ray.py", ("--duration-s", "180"), ("--quick",)),
}


def run(name: str, benchmark: Benchmark, quick: bool, results: Path) -> bool:
    """Run one benchmark into `results/NAME.json`; whether it succeeded."""
    args = benchmark.quick if quick else benchmark.args
    command = [sys.executable, benchmark.script, *args, "--json", str(results / f"{name}.json")]
    print(f"== {name}: {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    code = subprocess.run(command, cwd=HERE, check=False).returncode
    print(f"== {name}: {'done' if code == 0 else f'FAILED (exit {code})'} in {time.monotonic() - started:.0f} s")
    return code == 0


def render(name: str, benchmark: Benchmark, results: Path) -> bool:
    """Render one result (if there is one) into its Markdown and plot (the docs' images for the docs' results);
    whether there was one."""
    path = results / f"{name}.json"
    if not path.exists():
        return False
    result = read_result(path)
    module = importlib.import_module(Path(benchmark.script).stem)
    (results / f"{name}.md").write_text(f"{stamp_line(result['stamp'])}\n\n{module.render(result)}\n")
    if hasattr(module, "plot"):
        images = IMAGES if results == FIGURES else results / "img"
        images.mkdir(parents=True, exist_ok=True)
        module.plot(result, images / f"{name}.png")
    return True


def main() -> None:
    """Run the benchmarks asked for, then render every result there is."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these")
    parser.add_argument("--skip", nargs="+", choices=list(BENCHMARKS), default=[], help="run all but these")
    parser.add_argument("--quick", action="store_true", help="brief runs, into a scratch folder, to check it works")
    parser.add_argument("--render-only", action="store_true", help="render the results already there")
    parser.add_argument("--results", type=Path, help="where results go (default: benchmarks/figures)")
    args = parser.parse_args()
    results = args.results or (HERE / "figures-quick" if args.quick else FIGURES)
    results.mkdir(parents=True, exist_ok=True)
    names = [n for n in (args.only or list(BENCHMARKS)) if n not in args.skip]
    failed = []
    if not args.render_only:
        failed = [name for name in names if not run(name, BENCHMARKS[name], args.quick, results)]
    rendered = [name for name in BENCHMARKS if render(name, BENCHMARKS[name], results)]
    print(f"rendered {len(rendered)} into {results}: {', '.join(rendered)}")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
