"""Logging setup: level, text or JSON lines, standard error or a file; the access log is `layerserve.access`."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from layerserve.errors import BadRequestError

_HANDLER_NAME = "layerserve"  # the handler configure_logging installs; log_format changes apply to it
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"
# Attributes every LogRecord has; the others were passed as `extra` and go into the JSON object.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}  # uvicorn adds the last


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, pid, message, the record's extra fields, any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        """The line for one record."""
        line = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
            **{key: value for key, value in record.__dict__.items() if key not in _STANDARD},
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, fmt: str = "text", file: Path | None = None) -> None:
    """Send every log (layerserve's, uvicorn's, the access log) to one handler of this level and format:
    standard error, standard output (`file` is `-`) or a file."""
    handler: logging.Handler
    if file is None or str(file) == "-":
        handler = logging.StreamHandler(sys.stdout if file is not None else sys.stderr)
    else:
        handler = logging.FileHandler(file, encoding="utf-8")
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    handler.set_name(_HANDLER_NAME)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("tf2onnx").setLevel(logging.WARNING)  # it logs every optimizer pass at INFO
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# What TensorFlow's C++ side writes to standard error at import whatever TF_CPP_MIN_LOG_LEVEL says (TF 2.18+).
TF_IMPORT_NOISE = (b"All log messages before absl::InitializeLog() is called", b"oneDNN custom operations are on")


def import_quietly(module: str, noise: tuple[bytes, ...]) -> None:
    """Import `module` with the lines it writes to standard error (file descriptor 2, as C++ code writes) that
    contain one of `noise` left out; anything else written there during the import passes, after it."""
    if module in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            importlib.import_module(module)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().splitlines(keepends=True)
            kept = [line for line in lines if not any(part in line for part in noise)]
            if kept:
                os.write(2, b"".join(kept))


def import_tensorflow_quietly() -> None:
    """Import TensorFlow without its notices (absl's, oneDNN's, and below warnings unless TF_CPP_MIN_LOG_LEVEL is
    set) in the server's log."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import_quietly("tensorflow", TF_IMPORT_NOISE)


_LOG_SETTING_TYPES: dict[str, Any] = {"log_file": str, "log_info": bool, "log_warning": bool, "log_error": bool,
                                       "log_verbose_level": int, "log_format": str}  # fmt: skip
_LEVELS = (("log_info", logging.INFO), ("log_warning", logging.WARNING), ("log_error", logging.ERROR))


def _own_handlers() -> list[logging.Handler]:
    return [handler for handler in logging.getLogger().handlers if handler.get_name() == _HANDLER_NAME]


def log_settings(file: Path | None) -> dict[str, Any]:
    """The log settings in force, as Triton's `GET /v2/logging` names them (from the root logger's level)."""
    level = logging.getLogger().level
    handlers = _own_handlers()
    is_json = bool(handlers) and isinstance(handlers[0].formatter, JsonFormatter)
    return {
        "log_file": "" if file is None else str(file),
        "log_info": level <= logging.INFO,
        "log_warning": level <= logging.WARNING,
        "log_error": level <= logging.ERROR,
        "log_verbose_level": 1 if level <= logging.DEBUG else 0,
        "log_format": "json" if is_json else "text",
    }


def _check_log_setting(key: str, value: Any, current: dict[str, Any]) -> None:
    expected = _LOG_SETTING_TYPES.get(key)
    if expected is None:
        raise BadRequestError(f"unknown log setting '{key}'; settings: {', '.join(_LOG_SETTING_TYPES)}")
    if type(value) is not expected or (key == "log_verbose_level" and value < 0):
        wanted = "a non-negative integer" if expected is int else f"a {expected.__name__}"
        raise BadRequestError(f"log setting '{key}' must be {wanted}, got {value!r}")
    if key == "log_format" and value not in ("text", "json"):
        raise BadRequestError(f"log setting 'log_format' must be 'text' or 'json', got {value!r}")
    if key == "log_format" and value != current[key] and not _own_handlers():
        raise BadRequestError("log setting 'log_format' cannot change: layerserve did not set up logging here")
    if key == "log_file" and value != current[key]:
        raise BadRequestError(f"log setting 'log_file' is fixed at start (--log-file); it is {current[key]!r}")


def update_log_settings(changes: dict[str, Any], file: Path | None) -> dict[str, Any]:
    """Apply Triton-style log settings now: the level becomes the most verbose one enabled
    (`log_verbose_level` > 0: DEBUG, `log_info`: INFO, `log_warning`: WARNING, `log_error`: ERROR, else only
    CRITICAL); `log_format` switches text and JSON lines. Returns the settings in force after.

    Raises:
        BadRequestError: an unknown key, a value of the wrong type, or a change of `log_file`.
    """
    current = log_settings(file)
    for key, value in changes.items():
        _check_log_setting(key, value, current)
    merged = {**current, **changes}
    enabled = (level for key, level in _LEVELS if merged[key])
    is_verbose = int(merged["log_verbose_level"]) > 0
    logging.getLogger().setLevel(logging.DEBUG if is_verbose else next(enabled, logging.CRITICAL))
    if merged["log_format"] != current["log_format"]:
        for handler in _own_handlers():
            handler.setFormatter(JsonFormatter() if merged["log_format"] == "json" else logging.Formatter(_TEXT_FORMAT))
    return log_settings(file)
