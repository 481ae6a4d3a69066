"""Logging setup: level, text or JSON lines, standard error or a file; the access log is `layerserve.access`."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

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
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("tf2onnx").setLevel(logging.WARNING)  # it logs every optimizer pass at INFO
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
