"""Training datasets: texts and labels from CSV, TSV or JSON lines, inline or from the allowed data folder."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Literal

from layerserve.errors import BadRequestError, NotFoundError

DatasetFormat = Literal["csv", "tsv", "jsonl"]
FORMATS: dict[str, DatasetFormat] = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def format_of(filename: str, given: str | None) -> DatasetFormat:
    """The format asked for, else the one the file name ends with.

    Raises:
        BadRequestError: neither names a known format.
    """
    if given:
        if given not in FORMATS.values():
            raise BadRequestError(f"unknown dataset format {given!r}; expected one of csv, tsv, jsonl")
        return given  # type: ignore[return-value]  # checked just above
    suffix = Path(filename).suffix.lower()
    if suffix not in FORMATS:
        raise BadRequestError(f"cannot tell the format of {filename!r}: name it .csv, .tsv or .jsonl, or give 'format'")
    return FORMATS[suffix]


def parse_dataset(
    data: bytes, fmt: DatasetFormat, text_column: str = "text", label_column: str = "label"
) -> tuple[list[str], list[str]]:
    """Texts and labels from a file's bytes (UTF-8; labels become strings).

    Raises:
        BadRequestError: not UTF-8, a malformed line, or a missing column (the columns found are named).
    """
    try:
        content = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise BadRequestError(f"the dataset is not UTF-8 text (byte {error.start})") from None
    rows = _json_lines(content) if fmt == "jsonl" else _delimited(content, "," if fmt == "csv" else "\t")
    texts, labels = [], []
    for number, row in enumerate(rows, start=1):
        missing = [column for column in (text_column, label_column) if column not in row]
        if missing:
            found = ", ".join(map(str, row)) or "none"
            raise BadRequestError(
                f"dataset row {number} has no column {missing[0]!r} (columns found: {found}); "
                f"set 'text_column' and 'label_column'"
            )
        text, label = row[text_column], row[label_column]
        if not isinstance(text, str) or isinstance(label, (dict, list)) or label is None:
            raise BadRequestError(f"dataset row {number}: the text must be a string and the label a string or number")
        texts.append(text)
        labels.append(str(label))
    return texts, labels


def _delimited(content: str, delimiter: str) -> list[dict[str, object]]:
    try:
        return list(csv.DictReader(io.StringIO(content, newline=""), delimiter=delimiter))
    except csv.Error as error:
        raise BadRequestError(f"malformed {'CSV' if delimiter == ',' else 'TSV'}: {error}") from None


def _json_lines(content: str) -> list[dict[str, object]]:
    rows = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise BadRequestError(f"dataset line {number} is not JSON: {error}") from None
        if not isinstance(row, dict):
            raise BadRequestError(f"dataset line {number} is not a JSON object")
        rows.append(row)
    return rows


def resolve_data_path(data_dir: Path | None, path: str, folders: bool = False) -> Path:
    """A server-side dataset path (a file, or with `folders` also a folder), which must lie inside the allowed data
    folder.

    Raises:
        BadRequestError: no data folder is configured, or the path leaves it.
        NotFoundError: no such file (or folder).
    """
    if data_dir is None:
        raise BadRequestError("server-side datasets are off: start the server with --data-dir to allow a folder")
    if "\0" in path:
        raise BadRequestError("the dataset path holds a NUL character")
    root = data_dir.resolve()
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        raise BadRequestError(f"dataset path {path!r} leaves the data folder; give a path inside it")
    if not target.is_file() and not (folders and target.is_dir()):
        raise NotFoundError(f"no dataset {'file or folder' if folders else 'file'} {path!r} in the data folder")
    return target
