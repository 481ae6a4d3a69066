"""The command line: `layerserve serve | ray serve | models | export | bench | train | demo build`; every setting is
also a flag."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BeforeValidator

from layerserve import __version__
from layerserve.errors import ConfigError, LayerserveError
from layerserve.logs import configure_logging, import_tensorflow_quietly
from layerserve.settings import RAY_SECTION, Settings, load_settings, read_config_file
from layerserve.training.recipe import TextTrainingParams

log = logging.getLogger("layerserve")


def _flag_kwargs(annotation: Any, metadata: list[Any]) -> dict[str, Any]:
    if any(isinstance(rule, BeforeValidator) for rule in metadata):
        return {"type": str}  # the field reads its own text (`512MB`)
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": typing.get_args(annotation)}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if isinstance(annotation, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return {"type": annotation}


def add_settings_flags(parser: argparse.ArgumentParser, skip: set[str]) -> None:
    """One `--field-name` flag per Settings field (defaults stay None so lower sources can apply)."""
    group = parser.add_argument_group("settings (also LAYERSERVE_<FIELD> variables or --config FILE)")
    for name, field in Settings.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        kwargs = _flag_kwargs(field.annotation, field.metadata)
        group.add_argument(flag, dest=name, default=None, help=field.description, **kwargs)
    parser.add_argument("--config", type=Path, default=None, help="a YAML or TOML file of settings")


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    flags = {name: getattr(args, name, None) for name in Settings.model_fields}
    flags.update(overrides)
    return load_settings(flags, args.config)


def _serve(args: argparse.Namespace) -> int:
    from layerserve.engines.process.usage import limit_heap_arenas
    from layerserve.gpu import apply_settings
    from layerserve.transports.ports import check_can_listen
    from layerserve.transports.tls import check_tls

    settings = _settings(args, model_repository=args.repository)
    configure_logging(settings.log_level, settings.log_format, settings.log_file)
    if not settings.model_repository.is_dir():
        raise LayerserveError(f"model repository {settings.model_repository} is not a folder")
    apply_settings(settings)
    check_can_listen(settings.host, settings.port, "--port")
    check_can_listen(settings.host, settings.grpc_port, "--grpc-port (0: no gRPC service)")
    check_tls(settings)
    limit_heap_arenas()
    if settings.workers > 1:
        from layerserve.workers import Supervisor

        return Supervisor(settings).run()
    from layerserve.server import Server

    Server(settings).run()
    return 0


def _ray_serve(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
        import ray.serve  # noqa: F401
    except ImportError as error:
        missing = (error.name or "ray").split(".")[0]
        raise LayerserveError(
            f"layerserve ray serve needs the ray extra ({missing} is not installed): in a checkout, "
            "scripts/install --dev, or .venv/bin/pip install -c constraints.txt -e '.[ray]'"
        ) from None
    from layerserve.transports.ray.launch import launch
    from layerserve.transports.ray.options import parse_group, ray_options

    settings = _settings(args, model_repository=args.repository, port=args.http_port)  # its HTTP proxy's
    configure_logging(settings.log_level, settings.log_format, settings.log_file)
    if not settings.model_repository.is_dir():
        raise LayerserveError(f"model repository {settings.model_repository} is not a folder")
    section = read_config_file(args.config).get(RAY_SECTION, {}) if args.config else {}
    if not isinstance(section, dict):
        raise ConfigError(f"{args.config}: the `ray:` section must be a mapping of Ray options")
    given = {"replicas": args.replicas, "replica_cpus": args.replica_cpus, "replica_gpus": args.replica_gpus,
             "job_cpus": args.job_cpus, "direct_port": args.direct_port,
             "proxy_location": args.proxy_location}  # fmt: skip
    values = {**section, **{key: value for key, value in given.items() if value is not None}}
    values["groups"] = {**section.get("groups", {}), **dict(parse_group(flag) for flag in args.group or ())}
    options = ray_options(values)
    return launch(settings, options, args.address, args.http_port, args.ready_timeout_s)


def _models(args: argparse.Namespace) -> int:
    from layerserve.errors import ModelLoadError
    from layerserve.lifecycle.model import find_model_file, load_model, read_signature
    from layerserve.lifecycle.repository import scan

    settings = _settings(args, model_repository=args.repository)
    found = scan(settings.model_repository)
    if not found:
        repository = settings.model_repository
        raise LayerserveError(f"{repository} has no model folders: expected {repository}/<model>/<version>/model.keras")
    import_tensorflow_quietly()
    for spec in found:
        print(f"{spec.name}{'  INVALID: ' + spec.error if spec.error else ''}")
        if spec.config.pipeline is not None:
            print("  pipeline: " + " -> ".join(f"{s.model} ({s.output or 'its output'})" for s in spec.config.pipeline))
            continue
        for number, path in sorted(spec.versions.items()):
            try:
                model = load_model(find_model_file(path), trust=settings.trust_models)
                signature = read_signature(model)
            except ModelLoadError as error:
                print(f"  version {number}: FAILED: {error.message}")
                continue
            print(f"  version {number}: {len(model.layers)} layers{_budget_note(settings, path)}")
            for kind, specs in (("input", signature.inputs), ("output", signature.outputs)):
                for tensor in specs:
                    print(f"    {kind:6} {tensor.name}: {tensor.datatype} {list(tensor.shape)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from layerserve.lifecycle.export import export_repository, summary

    settings = _settings(args, model_repository=args.repository)
    configure_logging("warning")
    outcomes = export_repository(settings, lambda outcome: print(outcome.line(), flush=True))
    print(summary(outcomes, settings))
    return 1 if any(outcome.state == "failed" for outcome in outcomes) else 0


def _budget_note(settings: Settings, version_folder: Path) -> str:
    """Under a memory budget, what a version is expected to take, and whether it can ever load."""
    if not settings.loads_on_demand:
        return ""
    from layerserve.lifecycle.budget import first_load_estimate, megabytes

    process_min_bytes = int(settings.engine_process_min_mb * 1_000_000)
    need, budget = first_load_estimate(version_folder, process_min_bytes), settings.model_memory_budget
    note = f"; needs about {megabytes(need)} of the {megabytes(budget)} model_memory_budget"
    return note + (": LARGER THAN THE BUDGET, it cannot load" if need > budget else "")


def _bench(args: argparse.Namespace) -> int:
    from layerserve.bench.generator import BenchOptions, print_report, run_bench

    if args.tls_ca_file is not None:  # for every client, its load-generating processes too
        os.environ["SSL_CERT_FILE"] = str(args.tls_ca_file)
    options = BenchOptions(
        url=args.url.rstrip("/"), model=args.model, workload=args.workload, concurrency=args.concurrency,
        duration_s=args.duration_s, rows=args.rows, image=args.image, outputs=tuple(args.outputs),
        use_cache=not args.no_cache, text=args.text,
        in_process=args.in_process,
        bare=args.bare, client_processes=args.client_processes, output=args.output, plot=args.plot,
        protocol=args.protocol, grpc_port=args.grpc_port,
    )  # fmt: skip
    print_report(run_bench(options))
    return 0


def _train(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from layerserve.lifecycle.repository import check_model_name, write_pin
    from layerserve.training.datasets import format_of, parse_dataset
    from layerserve.training.recipe import (
        TextTrainingParams,
        check_dataset,
        check_text_model,
        check_version_writable,
        train_text_classifier,
        write_version,
    )

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    configure_logging("warning")
    check_model_name(args.model)
    fmt = format_of(args.data.name, args.format)
    try:
        data = args.data.read_bytes()
    except OSError as error:
        raise LayerserveError(f"cannot read the dataset {args.data}: {error.strerror or error}") from None
    texts, labels = parse_dataset(data, fmt, args.text_column, args.label_column)
    check_dataset(texts, labels)
    model_dir = args.repository / args.model
    check_text_model(model_dir)
    check_version_writable(model_dir)
    given = {name: getattr(args, name) for name in TextTrainingParams.model_fields if getattr(args, name) is not None}
    params = TextTrainingParams.parse(given)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task("epoch 1", total=params.epochs)

        def report(update: dict[str, Any]) -> None:
            done = update["epoch"] - (0 if "loss" in update else 1) + update["step"] / max(1, update["steps"])
            scores = "  ".join(f"{k} {v:.3f}" for k, v in update.items() if "loss" in k or "accuracy" in k)
            progress.update(task, completed=min(done, update["epoch"]), description=f"epoch {update['epoch']} {scores}")

        trained = train_text_classifier(texts, labels, params, report)
        progress.update(task, completed=params.epochs)
    number = write_version(model_dir, trained, params)
    if args.apply:
        write_pin(model_dir, number)
    accuracy = trained.metrics.get("val_accuracy", trained.metrics.get("accuracy", [float("nan")]))
    ran = len(trained.metrics["loss"])
    print(f"{args.model} version {number}{' (pinned)' if args.apply else ''}: {len(texts)} rows, "
          f"{len(trained.labels)} labels, {ran} of at most {params.epochs} epochs, the weights of epoch "
          f"{trained.best_epoch}: {'validation ' if 'val_accuracy' in trained.metrics else ''}accuracy "
          f"{accuracy[trained.best_epoch - 1]:.3f}; written to {model_dir / str(number)}")  # fmt: skip
    return 0


def _demo_build(args: argparse.Namespace) -> int:
    from layerserve.demo import build_demo_repository

    configure_logging("info")
    import_tensorflow_quietly()
    build_demo_repository(args.directory)
    print(f"demo repository written to {args.directory}; serve it with: layerserve serve {args.directory}")
    return 0


def _demo_photos(args: argparse.Namespace) -> int:
    from layerserve.demo import write_demo_photos

    written = write_demo_photos(args.directory)
    print(f"demo photos written: {', '.join(str(path) for path in written)}")
    return 0


def _add_ray_commands(commands: Any) -> None:
    """`layerserve ray serve`."""
    ray_command = commands.add_parser("ray", help="run on Ray Serve (pip install 'layerserve[ray]')")
    ray_commands = ray_command.add_subparsers(dest="ray_command", required=True)
    ray_serve = ray_commands.add_parser("serve", help="deploy a model repository as Ray Serve replicas")
    ray_serve.add_argument("repository", type=Path, help="a folder every node sees: <repo>/<model>/<version>/")
    ray_serve.add_argument("--address", default="local",
                           help="local (start Ray here, serve until stopped), auto, HOST:PORT or ray://HOST:PORT "
                                "(deploy to that cluster and return once ready)")  # fmt: skip
    ray_serve.add_argument("--replicas", type=int, help="replicas, each serving every model in no group (1)")
    ray_serve.add_argument("--replica-cpus", type=float, help="CPUs each replica reserves (1)")
    ray_serve.add_argument("--replica-gpus", type=float, help="GPUs each replica reserves (0)")
    ray_serve.add_argument(
        "--job-cpus", type=float, help="CPUs each training job (a Ray task, on any node) reserves (1)"
    )
    ray_serve.add_argument("--group", action="append", metavar="PATTERNS:REPLICAS[:CPUS]",
                           help="models (comma-separated shell patterns) served by replicas of their own, e.g. "
                           "'efficientnet*:2'; repeatable; more in the config file's `ray:` section")  # fmt: skip
    ray_serve.add_argument("--http-port", type=int, default=8000, help="the port of Ray Serve's HTTP proxy")
    ray_serve.add_argument("--direct-port", type=int,
                           help="also serve HTTP on this port of every node, from each replica itself (no proxy: "
                           "faster, but a request dies with its replica; see docs/scale.md)")  # fmt: skip
    ray_serve.add_argument("--proxy-location", choices=("HeadOnly", "EveryNode"),
                           help="where Ray Serve's HTTP and gRPC proxies run: HeadOnly (the default: a node lost "
                           "takes no client connection with it) or EveryNode (behind your load balancer)")  # fmt: skip
    ray_serve.add_argument("--ready-timeout-s", type=float, default=600.0, help="how long to wait for every model")
    add_settings_flags(ray_serve, skip={"model_repository", "port", "workers"})  # grpc_port: Ray's gRPC proxy
    ray_serve.set_defaults(run=_ray_serve)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="layerserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"layerserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model repository over HTTP and gRPC")
    serve.add_argument("repository", type=Path, help="folder of models: <repo>/<model>/<version>/")
    add_settings_flags(serve, skip={"model_repository"})
    serve.set_defaults(run=_serve)

    _add_ray_commands(commands)

    models = commands.add_parser("models", help="list each model's versions, inputs, outputs and layer count")
    models.add_argument("repository", type=Path)
    add_settings_flags(models, skip={"model_repository"})
    models.set_defaults(run=_models)

    _add_export_command(commands)

    bench = commands.add_parser("bench", help="closed-loop load test of a running server")
    bench.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (https: both doors over TLS)")
    bench.add_argument("--model", required=True)
    bench.add_argument("--workload", default="tensor", choices=["tensor", "tensor-json", "image", "text"],
                       help="tensor: V2 binary; tensor-json: V2 JSON; image, text: /classify")  # fmt: skip
    bench.add_argument("--image", type=Path, default=None, help="the photo sent by the image workload")
    bench.add_argument("--text", default="a short text to classify", help="the text sent by the text workload")
    bench.add_argument("--rows", type=int, default=1, help="rows per tensor request")
    bench.add_argument("--outputs", nargs="*", default=[], help="outputs or layers (image: /features of a layer)")
    bench.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    bench.add_argument("--duration-s", type=float, default=10.0, help="seconds per concurrency")
    bench.add_argument("--no-cache", action="store_true", help="ask the server to bypass its feature cache")
    bench.add_argument("--in-process", type=Path, default=None, metavar="REPOSITORY",
                       help="also measure the model in process (best batch, same engine): the ceiling")  # fmt: skip
    bench.add_argument(
        "--bare", action="store_true",
        help="also measure the bare HTTP stack returning a constant, in slices alternating with the server's",
    )  # fmt: skip
    bench.add_argument("--client-processes", type=int, default=1, help="processes generating load")
    bench.add_argument("--output", type=Path, default=None, help="write the report as JSON")
    bench.add_argument("--plot", type=Path, default=None, help="write throughput and p99 vs concurrency as PNG")
    bench.add_argument("--protocol", choices=["http", "grpc"], default="http",
                       help="REST (binary tensors), or the gRPC door (ModelInfer, own HTTP/2 client)")  # fmt: skip
    bench.add_argument("--grpc-port", type=int, default=8001, help="the gRPC port of the server at URL's host")
    bench.add_argument("--tls-ca-file", type=Path, default=None,
                       help="CA certificates an https server's certificate is checked against (default: the "
                       "system's, or SSL_CERT_FILE's)")  # fmt: skip
    bench.set_defaults(run=_bench)

    train = commands.add_parser("train", help="train a text classifier version without a server")
    train.add_argument("repository", type=Path, help="the model repository the version is written to")
    train.add_argument("model", help="the model name (created as a text model when new)")
    train.add_argument("--data", type=Path, required=True, help="CSV, TSV or JSON lines with texts and labels")
    train.add_argument("--format", choices=["csv", "tsv", "jsonl"], default=None, help="default: by file name")
    train.add_argument("--text-column", default="text")
    train.add_argument("--label-column", default="label")
    train.add_argument("--apply", action="store_true", help="pin the new version as the active one")
    params = train.add_argument_group("training parameters (defaults in parentheses)")
    for name, field in TextTrainingParams.model_fields.items():
        text = f"{field.description or ''} ({field.default})".strip()
        kwargs = _flag_kwargs(field.annotation, field.metadata)
        params.add_argument("--" + name.replace("_", "-"), dest=name, help=text, **kwargs)
    train.set_defaults(run=_train)

    _add_demo_commands(commands)
    return parser


def _add_export_command(commands: Any) -> None:
    """`layerserve export`."""
    export = commands.add_parser(
        "export",
        help="fill the export cache for the versions a server would load (before it starts: an image build, an "
        "init container); exit status 1 if one failed",
    )
    export.add_argument("repository", type=Path, help="folder of models: <repo>/<model>/<version>/")
    add_settings_flags(export, skip={"model_repository"})
    export.set_defaults(run=_export)


def _add_demo_commands(commands: Any) -> None:
    demo = commands.add_parser("demo", help="the built-in demo repository and photos to send it")
    demo_commands = demo.add_subparsers(dest="demo_command", required=True)
    build = demo_commands.add_parser("build", help="write the demo repository into DIRECTORY")
    build.add_argument("directory", type=Path)
    build.set_defaults(run=_demo_build)
    photos = demo_commands.add_parser("photos", help="write photos to send the demo's image models into DIRECTORY")
    photos.add_argument("directory", type=Path)
    photos.set_defaults(run=_demo_photos)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.run(args)
    except LayerserveError as error:
        print(f"layerserve: {error.message}", file=sys.stderr)
        return 2
    return status
