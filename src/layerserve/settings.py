"""Settings (server-wide: flags, LAYERSERVE_* environment, config file) and ModelConfig (per model)."""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from layerserve.errors import ConfigError, NotFoundError

EngineChoice = Literal["auto", "onnx", "keras"]
Interpolation = Literal["nearest", "bilinear", "bicubic", "lanczos", "box", "hamming"]
ENV_PREFIX = "LAYERSERVE_"
_VERSION_LABEL = re.compile(r"[a-z][a-z0-9_-]*")
_BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*", re.IGNORECASE)
_BYTE_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def parse_byte_size(value: object) -> object:
    """`512MB`, `1.5GB`, `2GiB` or a plain number of bytes -> bytes (KB, MB, GB and TB are binary: MB = 1024²);
    anything else is left for the field's own check to refuse."""
    if not isinstance(value, str):
        return value
    match = _BYTE_SIZE.fullmatch(value)
    if match is None:
        raise ValueError(f"expected a number of bytes, optionally with KB, MB, GB or TB (binary), got {value!r}")
    unit = (match[2] or "B").upper().replace("IB", "B")
    return int(float(match[1]) * _BYTE_UNITS[unit])


ByteSize = Annotated[int, BeforeValidator(parse_byte_size)]


class Settings(BaseModel):
    """Every server setting; each is a CLI flag, a LAYERSERVE_<FIELD> variable and a config-file key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_repository: Path = Field(
        Path("models"), description="Folder of models: `<repo>/<model>/<version>/` (the REPOSITORY argument)."
    )
    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 for every interface).")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    grpc_port: int = Field(
        8001, ge=0, le=65535, description="TCP port of the gRPC (V2, Triton-compatible) service, on `host` (0: off)."
    )
    models: str = Field(
        "",
        description="Serve only the model folders matching these comma-separated shell patterns (`!pattern` "
        "excludes; e.g. `efficientnet*` or `!efficientnet*`); empty: every folder.",
    )
    reload_interval_s: float = Field(
        2.0, ge=0, description="Seconds between polls of the repository for new, changed or removed versions (0: off)."
    )
    engine: EngineChoice = Field(
        "auto", description="auto: ONNX Runtime, else the Keras compiled call; onnx or keras to force one."
    )
    engine_cache_dir: Path = Field(
        Path.home() / ".cache" / "layerserve" / "onnx",
        description="Where exported ONNX graphs are kept, keyed by the model file's hash.",
    )
    preparer_idle_s: float = Field(
        60.0,
        ge=0,
        description="How long the preparer's child process (Keras and TensorFlow, for exports and their checks) "
        "stays after its last work (0: it exits as soon as no preparation is pending, e.g. once the start's "
        "loads are done).",
    )
    verify_atol: float = Field(
        1e-4,
        gt=0,
        description="Largest absolute difference allowed between ONNX and Keras on the probe batch.",
    )
    intra_op_threads: int = Field(0, ge=0, description="Threads per model call (0: one per core).")
    engine_process_min_mb: float = Field(
        8.0,
        ge=0,
        description="ONNX graphs of at least this many MB run in an engine process, so that loading, "
        "reloading or unloading one never stalls the other models (0: every graph).",
    )
    engine_processes: int = Field(
        2,
        ge=0,
        description="Engine processes at most, each holding the sessions of several big models (0: one per "
        "session, so that a crashed process fails one version only).",
    )
    engine_lanes: int = Field(
        2,
        ge=1,
        le=8,
        description="Batches of one version its engine process computes at once, on the one session (1: one at a "
        "time); a second keeps the cores busy while a batch's answer goes back and the next is sent.",
    )
    model_memory_budget: ByteSize = Field(
        0,
        ge=0,
        description="Memory the loaded versions may take, per worker (per replica under Ray), e.g. `2GB`: models "
        "are listed at start and loaded on their first request, and the least recently used idle ones are "
        "unloaded to make room (0: every model loads at start and stays). See docs/many-models.md.",
    )
    keep_loaded: str = Field(
        "",
        description="Under `model_memory_budget`, models loaded at start and never unloaded to make room: "
        "comma-separated shell patterns of model names (as `models`; also `keep_loaded: true` in a config.yaml).",
    )
    watch_resident_memory: bool = Field(
        True,
        description="Under `model_memory_budget`, also hold each worker's real resident memory (its process and "
        "engine processes) within its base and the budget: what the versions' own figures miss is counted as "
        "theirs, and more idle versions are unloaded for it. Turn off where layerserve runs inside another "
        "program's process, whose memory is not the server's.",
    )
    max_cuts_per_version: int = Field(
        32, ge=1, description="Cut sub-graphs (layer outputs, cut inputs) kept built per version (LRU)."
    )
    max_batch_size: int = Field(
        16, ge=1, description="Default largest batch a batcher sends (models without a free batch dim: 1)."
    )
    max_delay_ms: float = Field(
        0.0,
        ge=0,
        description="Default wait for a fuller batch once the model is free (0: send at once, at most half the "
        "rows not yet answered).",
    )
    max_queue_size: int = Field(256, ge=1, description="Default requests waiting per version; beyond it, 503.")
    request_timeout_ms: int = Field(
        30_000, ge=1, description="Default deadline of a request; past it, 504 (request parameter timeout_ms)."
    )
    inline_max_ms: float = Field(
        0.5, ge=0, description="Models whose largest batch runs faster than this run on the event loop (0: never)."
    )
    max_body_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Largest request body accepted (413 above).")
    header_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long an HTTP request's line and headers may take to arrive, from their first byte (408 "
        "after, and the connection closes).",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long an HTTP request's body may bring no byte while the server reads it (408 after, and "
        "the connection closes).",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest HTTP request head (request line and headers) accepted (431 above, and the "
        "connection closes).",
    )
    compress_min_bytes: int = Field(
        1024,
        ge=0,
        description="Answers at least this large are compressed (gzip or deflate, level 1) for "
        "clients whose Accept-Encoding asks (0: never).",
    )
    max_image_pixels: int = Field(
        40_000_000, gt=0, description="Largest image (width x height) decoded; larger ones get 413."
    )
    decode_threads: int = Field(0, ge=0, description="Threads decoding and resizing images (0: one per core).")
    redis_url: str | None = Field(
        None, description="Redis for the feature cache and store (redis://host:port/db); none: in process memory."
    )
    redis_timeout_ms: float = Field(50.0, gt=0, description="Redis socket timeout; slower answers count as misses.")
    cache_ttl_s: float = Field(3600.0, ge=0, description="Lifetime of a feature cache entry (0: no expiry).")
    cache_max_bytes: int = Field(
        256 * 1024 * 1024, gt=0, description="Memory of the in-process feature cache (least recently used dropped)."
    )
    cache_key_prefix: str = Field("layerserve:", description="Prefix of every Redis key layerserve writes.")
    feature_store_bytes: int = Field(
        256 * 1024 * 1024, gt=0, description="Memory for feature vectors stored by id (least recently used dropped)."
    )
    trust_models: bool = Field(
        False,
        description="Load models that contain Lambda layers or custom code (never for untrusted files).",
    )
    jobs_dir: Path | None = Field(
        None,
        description="Where training job records (SQLite; in Redis with `redis_url`) and their data live (none: "
        "`<repository>/.jobs`, or `~/.cache/layerserve/jobs` when the repository cannot be written).",
    )
    data_dir: Path | None = Field(
        None, description="The folder training jobs may read server-side datasets from (none: uploads only)."
    )
    training_threads: int = Field(1, ge=1, description="CPU threads of each training job's process.")
    workers: int = Field(
        1, ge=1, le=64, description="Server processes on the one port; each loads every model itself (after start)."
    )
    shutdown_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long requests in flight may take to finish before the exit."
    )
    keep_alive_timeout_s: int = Field(
        75, ge=1, description="How long an idle kept-alive HTTP connection stays open (longer than clients' own)."
    )
    grpc_idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A gRPC connection without a call for this long (up to twice it) is sent GOAWAY and closed; one "
        "without its HTTP/2 preface within 10 s (or this, if shorter) is closed.",
    )
    admin_token: str | None = Field(
        None, description="Bearer token the management routes require (load, unload, apply, train, jobs)."
    )
    api_token: str | None = Field(None, description="Bearer token every route except health requires.")
    tls_cert_file: Path | None = Field(
        None,
        description="PEM certificate chain of the server (with `tls_key_file`: both doors speak TLS; re-read when "
        "the file changes).",
    )
    tls_key_file: Path | None = Field(None, description="PEM private key of `tls_cert_file`.")
    tls_key_password: str | None = Field(None, description="Password of an encrypted `tls_key_file`.")
    tls_client_ca_file: Path | None = Field(
        None,
        description="PEM CA certificates that sign the clients' certificates: mutual TLS (a client without a "
        "certificate signed by one is refused at the handshake).",
    )
    tls_min_version: Literal["1.2", "1.3"] = Field("1.2", description="Oldest TLS version a client may use.")
    grpc_tls_cert_file: Path | None = Field(
        None, description="The gRPC door's own certificate chain, instead of `tls_cert_file` (with its key)."
    )
    grpc_tls_key_file: Path | None = Field(None, description="The private key of `grpc_tls_cert_file`.")
    grpc_tls_client_ca_file: Path | None = Field(
        None, description="The gRPC door's own client CA (mutual TLS on gRPC), instead of `tls_client_ca_file`."
    )
    access_log: bool = Field(False, description="Log one line per request: route, model, version, status, latency.")
    log_format: Literal["text", "json"] = Field("text", description="text lines, or JSON lines.")
    log_file: Path | None = Field(
        None, description="Append logs to this file; `-`: standard output; none: standard error."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    otlp_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector that gets a trace of each request (http(s)://host:port; OTLP/HTTP "
        "posts protobuf to `/v1/traces` on it); none: no traces.",
    )
    otlp_protocol: Literal["http/protobuf", "grpc"] = Field(
        "http/protobuf", description="How traces go to `otlp_endpoint`: OTLP/HTTP (port 4318) or OTLP/gRPC (4317)."
    )
    trace_sampling_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of the requests without a caller's `traceparent` that are traced (with one, its "
        "sampled flag decides).",
    )
    gpu_devices: str | None = Field(
        None, description="GPUs this server may use, as CUDA_VISIBLE_DEVICES (e.g. 0,1; empty: none; none: all)."
    )
    gpu_memory_growth: bool = Field(
        True, description="TensorFlow allocates GPU memory as needed instead of all of it at start."
    )
    gpu_memory_limit_mb: int = Field(
        0, ge=0, description="GPU memory each process may use per device, TensorFlow and ONNX Runtime (0: no limit)."
    )

    @field_validator(
        "model_repository", "engine_cache_dir", "jobs_dir", "data_dir", "log_file", "tls_cert_file", "tls_key_file",
        "tls_client_ca_file", "grpc_tls_cert_file", "grpc_tls_key_file", "grpc_tls_client_ca_file", mode="after",
    )  # fmt: skip
    @classmethod
    def _expand_user(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @field_validator("otlp_endpoint", mode="after")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        if value and not re.match(r"https?://[^/]", value):
            raise ValueError(f"expected an http:// or https:// URL of an OpenTelemetry collector, got {value!r}")
        return value or None

    @model_validator(mode="after")
    def _distinct_ports(self) -> Settings:
        if self.port and self.port == self.grpc_port:
            raise ValueError(
                f"'port' and 'grpc_port' are both {self.port}: the HTTP and gRPC services need a port each "
                "(grpc_port 0 turns gRPC off)"
            )
        return self

    @model_validator(mode="after")
    def _tls_pairs(self) -> Settings:
        for prefix in ("tls", "grpc_tls"):
            cert, key = getattr(self, f"{prefix}_cert_file"), getattr(self, f"{prefix}_key_file")
            if (cert is None) != (key is None):
                given, missing = (f"{prefix}_cert_file", f"{prefix}_key_file")[:: 1 if cert else -1]
                raise ValueError(f"'{given}' is set without '{missing}': a certificate and its key go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError(
                f"'tls_client_ca_file' ({self.tls_client_ca_file}) is set without 'tls_cert_file': mutual TLS needs "
                "the server's own certificate and key"
            )
        grpc_cert = self.grpc_tls_cert_file or self.tls_cert_file
        if self.grpc_tls_client_ca_file is not None and grpc_cert is None:
            raise ValueError(
                f"'grpc_tls_client_ca_file' ({self.grpc_tls_client_ca_file}) is set without a certificate for the "
                "gRPC door ('grpc_tls_cert_file' or 'tls_cert_file')"
            )
        return self

    def serves_model(self, name: str) -> bool:
        """Whether the model folder `name` is served (see `models`): it matches an including pattern (or there
        is none) and no excluding one."""
        return matches_patterns(self.models, name, empty=True)

    @property
    def loads_on_demand(self) -> bool:
        """Whether models load on their first request under a memory budget (`model_memory_budget`)."""
        return self.model_memory_budget > 0

    def keeps_loaded(self, name: str) -> bool:
        """Whether the setting `keep_loaded` names the model (its config.yaml may too: `ModelConfig.keep_loaded`)."""
        return matches_patterns(self.keep_loaded, name, empty=False)


def matches_patterns(patterns: str, name: str, empty: bool) -> bool:
    """Whether `name` matches comma-separated shell patterns: an including pattern (or none, then `empty`) and no
    excluding (`!pattern`) one."""
    split = [p.strip() for p in patterns.split(",") if p.strip()]
    included = [p for p in split if not p.startswith("!")]
    excluded = [p[1:] for p in split if p.startswith("!")]
    is_included = any(fnmatch.fnmatchcase(name, p) for p in included) if included else empty
    return is_included and not any(fnmatch.fnmatchcase(name, p) for p in excluded)


def _format_default(value: object) -> str:
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Path):
        home = str(Path.home())
        return f"`{str(value).replace(home, '~', 1) if str(value).startswith(home) else value}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def settings_table() -> str:
    """The table of settings in docs/cli.md, made from the Settings fields (a test keeps the page equal)."""
    rows = ["| setting | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        rows.append(f"| `{name}` | {_format_default(field.default)} | {field.description} |")
    return "\n".join(rows) + "\n"


def _env_values(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        name: environ[f"{ENV_PREFIX}{name.upper()}"]
        for name in Settings.model_fields
        if f"{ENV_PREFIX}{name.upper()}" in environ
    }


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML or TOML settings file into a dict of field values.

    Raises:
        ConfigError: the file cannot be read or is not a mapping.
    """
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, tomllib.TOMLDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"config file {path}: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


RAY_SECTION = "ray"


def load_settings(
    flags: Mapping[str, Any] | None = None,
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build Settings; precedence: flags, then LAYERSERVE_* environment, then config file, then defaults.

    Raises:
        ConfigError: a value is invalid or a key unknown; the message names it.
    """
    values: dict[str, Any] = read_config_file(config_file) if config_file else {}
    values.pop(RAY_SECTION, None)  # `layerserve ray serve`'s (transports/ray/options.py), not a setting
    values.update(_env_values(os.environ if environ is None else environ))
    values.update({key: value for key, value in (flags or {}).items() if value is not None})
    try:
        return Settings(**values)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, "setting")) from error


def describe_validation_error(error: ValidationError, what: str) -> str:
    """One line per problem: `<what> 'key': message`."""
    problems = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        if not key and item["type"] == "value_error":
            problems.append(str(item["ctx"]["error"]))  # a check of several keys names them itself
        else:
            problems.append(f"{what} '{key or '(root)'}': {message}")
    return "; ".join(problems)


class VersionPolicy(BaseModel):
    """Which versions of a model are served: the newest `latest`, `all`, or a `specific` list."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    latest: int | None = Field(None, ge=1, description="Serve the N newest versions.")
    all: bool = Field(False, description="Serve every version.")
    specific: list[int] | None = Field(None, description="Serve exactly these versions.")

    def select(self, versions: list[int]) -> list[int]:
        """The versions to load out of those present, ascending."""
        ordered = sorted(versions)
        if self.all:
            return ordered
        if self.specific is not None:
            return [v for v in ordered if v in set(self.specific)]
        return ordered[-(self.latest or 1) :]


# A pipeline reads its requests as its first step's model does and batches in each step's model: none of its own.
_STEP_KEYS = (
    "engine", "input", "resize", "interpolation", "preprocess", "scale", "offset", "warmup_batch_size",
    "max_batch_size", "max_delay_ms", "cache",
)  # fmt: skip


class PipelineStep(BaseModel):
    """One step of a pipeline: a model (and version), the input that takes the previous step's output, and the
    output (or layer) handed on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="The step's model (a model of the repository).")
    version: int | None = Field(None, ge=1, description="Its version (default: the one a request without one gets).")
    input: str | None = Field(
        None,
        description="The input (or layer, a cut) that takes the previous step's output (default: the model's only "
        "input); the first step takes the pipeline's inputs and names none.",
    )
    output: str | None = Field(None, description="The output or layer handed on (default: the model's only output).")

    @field_validator("model", mode="after")
    @classmethod
    def _check_model(cls, model: str) -> str:
        if not model or model.startswith(".") or any(c in model for c in "/\\\0"):
            raise ValueError(f"invalid model name {model!r}: expected a folder name of the repository")
        return model


class ModelConfig(BaseModel):
    """A model's optional `config.yaml`; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = Field("", description="Free text shown in the model's metadata.")
    engine: EngineChoice | None = Field(None, description="Overrides the server's `engine` for this model.")
    version_policy: VersionPolicy = Field(
        default_factory=lambda: VersionPolicy(latest=1), description="Which versions are loaded."
    )
    warmup_batch_size: int = Field(2, ge=1, description="Rows of the probe batch run before a version is READY.")
    max_batch_size: int | None = Field(None, ge=1, description="Largest batch (default: the server's).")
    max_delay_ms: float | None = Field(None, ge=0, description="Wait for a fuller batch (default: the server's).")
    max_queue_size: int | None = Field(None, ge=1, description="Requests waiting (default: the server's).")
    cache: bool = Field(False, description="Serve repeated inputs from the feature cache (row by row).")
    input: Literal["tensor", "image", "text"] = Field(
        "tensor",
        description="image: /classify, /features and V2 BYTES inputs take encoded images; text: UTF-8 texts, "
        "tokenized with the version's tokenizer.json.",
    )
    resize: Literal["center_crop", "squash", "pad"] = Field(
        "center_crop", description="How an image meets the input size: crop the centre, stretch, or pad."
    )
    interpolation: Interpolation = Field("bilinear", description="Resampling filter used to resize images.")
    preprocess: Literal["raw", "tf", "torch", "caffe"] = Field(
        "raw", description="raw 0..255, tf -1..1, torch ImageNet mean/std, caffe BGR minus mean."
    )
    scale: float | None = Field(None, description="Explicit preprocessing x * scale + offset (replaces preprocess).")
    offset: float = Field(0.0, description="Offset of the explicit preprocessing.")
    labels: str | None = Field(None, description="'imagenet', or a file in the model folder: one label per line.")
    classify_output: str | None = Field(None, description="Output holding class scores (default: the first).")
    version_labels: dict[str, StrictInt] = Field(
        default_factory=dict, description="Names for versions (`{stable: 1, canary: 2}`), as TF Serving's labels."
    )
    keep_loaded: bool = Field(
        False, description="Under a memory budget: loaded at start and never unloaded to make room for others."
    )
    pipeline: list[PipelineStep] | None = Field(
        None,
        description="Serve a chain of models as this one: each step's output is the next one's input; the "
        "signature is the first step's inputs and the last step's output (version folders are optional).",
    )

    @field_validator("pipeline", mode="after")
    @classmethod
    def _check_pipeline(cls, steps: list[PipelineStep] | None) -> list[PipelineStep] | None:
        if steps is None:
            return None
        if not steps:
            raise ValueError("a pipeline needs at least one step")
        if steps[0].input is not None:
            raise ValueError("step 1 takes the pipeline's inputs: it names no input")
        return steps

    @model_validator(mode="after")
    def _check_pipeline_keys(self) -> ModelConfig:
        if self.pipeline is not None:
            own = [key for key in _STEP_KEYS if key in self.model_fields_set]
            if own:
                raise ValueError(
                    f"a pipeline takes {', '.join(own)} from its first step's model: remove it from its config.yaml"
                )
        return self

    @field_validator("version_labels", mode="after")
    @classmethod
    def _check_version_labels(cls, labels: dict[str, int]) -> dict[str, int]:
        for label, version in labels.items():
            if not _VERSION_LABEL.fullmatch(label):
                raise ValueError(f"label {label!r} must match [a-z][a-z0-9_-]*")
            if version < 1:
                raise ValueError(f"label {label!r}: the version must be a positive integer, got {version}")
        return labels

    def version_for_label(self, model: str, label: str) -> int:
        """The version a label names.

        Raises:
            NotFoundError: the model has no such label; the message lists the known ones.
        """
        try:
            return self.version_labels[label]
        except KeyError:
            known = ", ".join(sorted(self.version_labels)) or "none (set version_labels in its config.yaml)"
            raise NotFoundError(f"model '{model}' has no version label '{label}'; labels: {known}") from None


def read_model_config(path: Path, override: Mapping[str, Any] | None = None) -> ModelConfig:
    """Read and validate a model's config.yaml (a missing file means defaults), with the keys of `override`
    (a load request's config) replacing the file's.

    Raises:
        ConfigError: the YAML is invalid, or a key is unknown or has a wrong value.
    """
    data: Any = None
    if path.exists():
        try:
            # libyaml's loader when PyYAML has it: the reloader reads every config.yaml on the event loop.
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except (OSError, yaml.YAMLError) as error:
            raise ConfigError(f"{path}: {error}") from error
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    data = {**(data or {}), **(override or {})}
    if data.get("version_policy") == "all":
        data["version_policy"] = {"all": True}
    try:
        return ModelConfig(**data)
    except ValidationError as error:
        raise ConfigError(f"{path}: {describe_validation_error(error, 'key')}") from error


def check_config_override(override: Mapping[str, Any]) -> None:
    """Check the config of a load request: config.yaml keys with valid values.

    Raises:
        ConfigError: an unknown key (the message lists the supported ones) or a wrong value (400).
    """
    unknown = [key for key in override if key not in ModelConfig.model_fields]
    if unknown:
        supported = ", ".join(ModelConfig.model_fields)
        raise ConfigError(f"config key '{unknown[0]}' is not supported; supported keys: {supported}")
    values = dict(override)
    if values.get("version_policy") == "all":
        values["version_policy"] = {"all": True}
    try:
        ModelConfig(**values)
    except ValidationError as error:
        raise ConfigError(f"the load request's config: {describe_validation_error(error, 'key')}") from error
