"""Open Inference Protocol (V2) JSON and the binary tensor data extension <-> numpy arrays."""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from layerserve.errors import BadRequestError
from layerserve.messages import InferRequest, InferResponse, ModelMetadata, RepositoryEntry, RequestedOutput
from layerserve.protocols.templates import TemplateCache
from layerserve.tensors import (
    Array,
    array_from_json,
    datatype_of,
    dtype_of,
    parse_shape,
    reshape_checked,
)

HEADER_LENGTH = "inference-header-content-length"
_U32 = struct.Struct("<I")

LITTLE_ENDIAN = sys.byteorder == "little"  # V2 binary tensor data (and gRPC raw contents) is little-endian


def parse_version_number(raw: str | None) -> int | None:
    """A version given as text (a path's `{version}`, a gRPC `model_version`): None if absent or empty.

    Raises:
        BadRequestError: the version is not a positive integer.
    """
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise BadRequestError(f"version must be a positive integer, got {raw!r}")
    return int(raw)


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """Split a body into its JSON header and a view of its binary tail (not a copy: the arrays are views of the
    body) per `Inference-Header-Content-Length`.

    Raises:
        BadRequestError: the header is not an integer within the body's length.
    """
    if header_length is None:
        return body, memoryview(b"")
    if not (header_length.strip().isascii() and header_length.strip().isdigit()):
        raise BadRequestError(f"Inference-Header-Content-Length must be a non-negative integer, got {header_length!r}")
    length = int(header_length)
    if length > len(body):
        raise BadRequestError(f"Inference-Header-Content-Length {length} is larger than the body ({len(body)} bytes)")
    return body[:length], memoryview(body)[length:]


MAX_JSON_DEPTH = 100


def _json_depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))
    return deepest


def load_json_object(raw: bytes, what: str) -> dict[str, Any]:
    """Parse a JSON object nested at most MAX_JSON_DEPTH deep.

    Raises:
        BadRequestError: invalid JSON, nested too deep, or not an object.
    """
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        if not raw.strip():
            raise BadRequestError(f"{what} is empty: expected a JSON object") from None
        if "recursion" in str(error).lower():
            raise BadRequestError(f"{what} nests JSON too deep (more than {MAX_JSON_DEPTH} levels)") from None
        raise BadRequestError(f"{what} is not valid JSON: {error}") from None
    # Fewer brackets than the limit cannot nest past it; only bodies with many are walked.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _json_depth(value) > MAX_JSON_DEPTH:
        raise BadRequestError(f"{what} nests JSON too deep (more than {MAX_JSON_DEPTH} levels)")
    if not isinstance(value, dict):
        raise BadRequestError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _parameters(item: dict[str, Any], what: str) -> dict[str, Any]:
    parameters = item.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequestError(f"{what}: parameters must be an object")
    return check_parameters(parameters, what)


def check_parameters(parameters: dict[str, Any], what: str) -> dict[str, Any]:
    """The parameters of a request, an input or an output, refused where they name shared memory.

    Raises:
        BadRequestError: a shared-memory parameter.
    """
    if "shared_memory_region" in parameters:
        raise BadRequestError(
            f"{what}: shared memory (shared_memory_region) is not supported by layerserve; "
            "send tensors in the request body (binary tensor data)"
        )
    return parameters


def _decode_bytes_elements(raw: bytes | memoryview, count: int, what: str) -> Array:
    elements: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise BadRequestError(f"{what}: truncated BYTES length prefix at offset {offset}")
        (size,) = _U32.unpack_from(raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise BadRequestError(f"{what}: BYTES element of {size} bytes runs past the end of its data")
        elements.append(bytes(raw[offset : offset + size]))
        offset += size
    if len(elements) != count:
        raise BadRequestError(f"{what}: binary data holds {len(elements)} BYTES elements, shape needs {count}")
    array = np.empty(count, dtype=object)
    array[:] = elements
    return array


def decode_binary(raw: bytes | memoryview, datatype: str, shape: tuple[int, ...], what: str) -> Array:
    """One tensor's binary data (little-endian values, or length-prefixed BYTES elements) as an array.

    Raises:
        BadRequestError: the data does not hold the shape's elements.
    """
    count = math.prod(shape)
    dtype = dtype_of(datatype, what)
    if datatype == "BYTES":
        return _decode_bytes_elements(raw, count, what).reshape(shape)
    if len(raw) != count * dtype.itemsize:
        raise BadRequestError(
            f"{what}: binary_data_size {len(raw)} does not match shape {list(shape)} of {datatype} "
            f"({count * dtype.itemsize} bytes expected)"
        )
    if LITTLE_ENDIAN:  # the wire's byte order already: a view of the body, no conversion
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


CheckDeclared = Callable[[str, str, tuple[int, ...]], None]


def _decode_input(
    item: Any, binary: memoryview, offset: int, check: CheckDeclared | None, may_hold_bools: bool
) -> tuple[str, Array, int, bool]:
    """One entry of 'inputs': its name, array, the offset past its binary data, and whether it came as JSON."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise BadRequestError("each entry of 'inputs' must be an object with a string 'name'")
    name = item["name"]
    what = f"input '{name}'"
    parameters = _parameters(item, what)
    shape = parse_shape(item.get("shape"), what)
    datatype = item.get("datatype")
    dtype = dtype_of(datatype, what)
    if check is not None:
        check(name, str(datatype), shape)
    size = parameters.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0 or offset + size > len(binary):
            raise BadRequestError(f"{what}: binary_data_size {size!r} runs past the binary data")
        return name, decode_binary(binary[offset : offset + size], str(datatype), shape, what), offset + size, False
    if "data" not in item:
        raise BadRequestError(f"{what}: needs 'data' or a binary_data_size parameter")
    values = array_from_json(item["data"], dtype, what, may_hold_bools)
    return name, reshape_checked(values, shape, what), offset, True


def _requested_outputs(raw: Any) -> tuple[RequestedOutput, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise BadRequestError("'outputs' must be a list of objects with a 'name'")
    requested = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadRequestError("each entry of 'outputs' must be an object with a string 'name'")
        requested.append(requested_output(item["name"], _parameters(item, f"output '{item['name']}'")))
    return tuple(requested)


def requested_output(name: str, parameters: dict[str, Any]) -> RequestedOutput:
    """One requested output with its binary_data and classification parameters.

    Raises:
        BadRequestError: classification is not a positive integer.
    """
    binary = bool_parameter(parameters, "binary_data", f"output '{name}': ")
    classes = parameters.get("classification")
    if classes is not None and (type(classes) is not int or classes < 1):
        raise BadRequestError(f"output '{name}': classification must be a positive integer")
    return RequestedOutput(name, binary, classes)


def parse_infer_request(
    body: bytes,
    header_length: str | None,
    model: str = "",
    version: int | None = None,
    check: CheckDeclared | None = None,
) -> InferRequest:
    """A V2 infer request (JSON, or JSON + binary tensor data) for `model` as the data plane's InferRequest.

    BYTES data in JSON comes as strings (`base64_inputs` names those inputs: encoded images there are base64).
    The data plane checks the request against its version; `check` (RequestChecks.declared) sees each input's
    name, datatype and shape before its data is read.

    Raises:
        BadRequestError: naming the bad field or input and what was expected.
    """
    header, binary = split_body(body, header_length)
    return _parse_infer_request(header, binary, model, version, check)[0]


_Layout = list[tuple[str, int, int, bool]]  # per input: its name, where its binary data starts and ends, whether JSON


def _parse_infer_request(
    header: bytes, binary: memoryview, model: str, version: int | None, check: CheckDeclared | None
) -> tuple[InferRequest, _Layout, bool]:
    """`parse_infer_request` of a body split already, with where each input's data was and whether the header has
    an `id`."""
    request = load_json_object(header, "the request body")
    raw_inputs = request.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequestError("'inputs' must be a non-empty list")
    inputs: dict[str, Array] = {}
    as_text: set[str] = set()
    layout: _Layout = []
    offset = 0
    may_hold_bools = b"true" in header or b"false" in header
    for item in raw_inputs:
        name, array, end, is_json = _decode_input(item, binary, offset, check, may_hold_bools)
        if name in inputs:
            raise BadRequestError(f"input '{name}' is given twice")
        inputs[name] = array
        layout.append((name, offset, end, is_json))
        offset = end
        if is_json and array.dtype == object:
            as_text.add(name)
    request_id = request.get("id")
    parameters = _parameters(request, "request")
    parsed = InferRequest(
        model=model,
        inputs=inputs,
        outputs=_requested_outputs(request.get("outputs")),
        version=version,
        id=None if request_id is None else str(request_id),
        timeout_ms=timeout_ms_parameter(parameters),
        use_cache=bool_parameter(parameters, "cache") is not False,
        binary_output=bool_parameter(parameters, "binary_data_output") is True,
        base64_inputs=frozenset(as_text),
    )
    return parsed, layout, request_id is not None


@dataclass(frozen=True)
class _Template:
    """A V2 binary request's JSON header, parsed and checked once: each input's name, dtype, shape and place in the
    binary data, and the rest of the request (outputs, parameters)."""

    inputs: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...]  # name, dtype, shape, count, offset
    end: int  # where the last input's data ends
    outputs: tuple[RequestedOutput, ...]
    timeout_ms: int | None
    use_cache: bool
    binary_output: bool

    def apply(self, binary: memoryview, model: str, version: int | None) -> InferRequest:
        """The request whose binary data is `binary` (at least `end` bytes long)."""
        inputs = {
            name: np.frombuffer(binary, dtype, count, offset).reshape(shape)
            for name, dtype, shape, count, offset in self.inputs
        }
        return InferRequest(
            model, inputs, self.outputs, version, None, self.timeout_ms, self.use_cache, self.binary_output
        )

    def apply_json(self, data: bytes, model: str, version: int | None) -> InferRequest | None:
        """The request whose one input's JSON data is the list `data`, or None where `data` is not a flat list of
        plain numbers that fits the input's dtype and shape (the full parse then says what is wrong)."""
        ((name, dtype, shape, count, _),) = self.inputs
        if data.translate(None, _INTEGER_TEXT if dtype.kind in "iu" else _NUMBER_TEXT):
            return None  # anything but digits, signs, points and exponents: the full parse decides
        try:
            # An integer dtype refuses an out-of-range value (OverflowError); floats take array_from_json's way.
            values = np.array(orjson.loads(data), dtype) if dtype.kind in "iu" else np.asarray(orjson.loads(data))
        except (orjson.JSONDecodeError, OverflowError, ValueError, TypeError):
            return None
        if values.ndim != 1 or values.size != count or values.dtype.kind not in "iuf":
            return None
        inputs = {name: values.astype(dtype, copy=False).reshape(shape)}
        return InferRequest(
            model, inputs, self.outputs, version, None, self.timeout_ms, self.use_cache, self.binary_output
        )


_INTEGER_TEXT = b"[0123456789-, \t\r\n]"  # what a flat JSON list of integers is written with
_NUMBER_TEXT = _INTEGER_TEXT + b".eE+"


def _json_data_slot(body: bytes) -> tuple[bytes, int, int] | None:
    """Where a JSON request's one flat `data` list lies (its `[` and `]`), and the body without the list's contents
    (the key of its template); None for a body with no such single list."""
    start = body.find(b'"data"')
    if start < 0 or body.find(b'"data"', start + 6) >= 0:
        return None  # no data, or "data" twice (two inputs, or the word elsewhere): parsed in full
    opening = body.find(b"[", start + 6)
    if opening < 0 or body[start + 6 : opening].strip() != b":":
        return None
    closing = body.find(b"]", opening)
    if closing < 0 or body.find(b"[", opening + 1, closing) >= 0:
        return None  # nested lists
    return body[: opening + 1] + body[closing:], opening, closing


class HeaderTemplates:
    """One version's V2 infer requests parsed once per shape: a JSON header seen before is not parsed or checked
    again (a VersionView keeps one per version, see `parse_state`).

    Clients send the same header for every request of one shape (names, datatypes, shapes, binary sizes, outputs);
    only the binary data differs. A header whose inputs all come as binary numbers (no JSON data, no BYTES) and that
    has no `id` is kept as a template; the next request with the same header bytes takes its arrays straight from
    the binary data. A JSON request (no binary data) whose one input's numbers come as one flat `data` list is kept
    the same way, keyed by its body without the list's contents; the next one with that key reads only its list.
    Anything else (a new header, too little binary data, data that is not plain numbers of the right count) is
    parsed by `parse_infer_request`, errors included. At most `size` headers of each kind are kept, the least
    recently used dropped first.
    """

    def __init__(self, size: int = 256, max_header_bytes: int = 8192) -> None:
        self._max_header_bytes = max_header_bytes
        self._templates: TemplateCache[_Template] = TemplateCache(size)
        self._json_templates: TemplateCache[_Template] = TemplateCache(size)

    def parse(
        self, body: bytes, header_length: str | None, model: str, version: int, check: CheckDeclared
    ) -> InferRequest:
        """`parse_infer_request` for this templates' version (whose `check` the request must pass).

        Raises:
            BadRequestError: as `parse_infer_request`.
        """
        if header_length is None:
            return self._parse_json(body, model, version, check)
        if not LITTLE_ENDIAN:
            return parse_infer_request(body, header_length, model, version, check)
        header, binary = split_body(body, header_length)
        found = self._templates.get(header)
        if found is not None and len(binary) >= found.end:
            return found.apply(binary, model, version)
        request, layout, has_id = _parse_infer_request(header, binary, model, version, check)
        if not has_id and len(header) <= self._max_header_bytes:
            template = _template(request, layout)
            if template is not None:
                self._templates.put(header, template)
        return request

    def _parse_json(self, body: bytes, model: str, version: int, check: CheckDeclared) -> InferRequest:
        """`parse` of a JSON request (no binary data)."""
        slot = _json_data_slot(body)
        if slot is None:
            return parse_infer_request(body, None, model, version, check)
        key, opening, closing = slot
        found = self._json_templates.get(key)
        if found is not None:
            request = found.apply_json(body[opening : closing + 1], model, version)
            if request is not None:
                return request
        request, layout, has_id = _parse_infer_request(body, memoryview(b""), model, version, check)
        if not has_id and len(key) <= self._max_header_bytes and len(layout) == 1 and layout[0][3]:
            template = _json_template(request, body[opening : closing + 1])
            if template is not None:
                self._json_templates.put(key, template)
        return request


def _template(request: InferRequest, layout: _Layout) -> _Template | None:
    """The template of a parsed request whose inputs all came as binary numbers, else None."""
    inputs = []
    for name, start, end, is_json in layout:
        array = request.inputs[name]
        if is_json or array.dtype.kind not in "biuf" or array.nbytes != end - start:
            return None
        inputs.append((name, array.dtype, tuple(array.shape), array.size, start))
    end = layout[-1][2] if layout else 0
    return _Template(
        tuple(inputs), end, request.requested, request.timeout_ms, request.use_cache, request.binary_output
    )


def _json_template(request: InferRequest, data: bytes) -> _Template | None:
    """The template of a parsed JSON request with one input of numbers, if its data is the list `data` (the word
    "data" found in the body might not be the input's key: JSON keys may be written with escapes), else None."""
    ((name, array),) = request.inputs.items()
    if array.dtype.kind not in "iuf":
        return None
    template = _Template(
        ((name, array.dtype, tuple(array.shape), array.size, 0),), 0, request.requested, request.timeout_ms,
        request.use_cache, request.binary_output,
    )  # fmt: skip
    again = template.apply_json(data, request.model, request.version)
    if again is None or not np.array_equal(again.inputs[name], array, equal_nan=array.dtype.kind == "f"):
        return None
    return template


def timeout_ms_parameter(parameters: dict[str, Any]) -> int | None:
    """The request parameter `timeout_ms`, if given.

    Raises:
        BadRequestError: not a positive integer.
    """
    timeout = parameters.get("timeout_ms")
    if timeout is not None and (type(timeout) is not int or timeout < 1):
        raise BadRequestError(f"parameter timeout_ms must be a positive integer (milliseconds), got {timeout!r}")
    return timeout


def bool_parameter(parameters: dict[str, Any], name: str, where: str = "") -> bool | None:
    """A parameter that is true or false, or None where it is not given (`where` prefixes the error).

    Raises:
        BadRequestError: given, but not a boolean.
    """
    value = parameters.get(name)
    if value is not None and type(value) is not bool:
        raise BadRequestError(f"{where}parameter {name} must be true or false, got {value!r}")
    return value


def encode_bytes_elements(array: Array) -> bytes:
    """BYTES elements as binary data: each a 4-byte little-endian length and its bytes."""
    parts = []
    for element in array.reshape(-1):
        raw = element if isinstance(element, bytes) else str(element).encode("utf-8")
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


def _json_data(array: Array) -> Any:
    if array.dtype.kind in "OSU":
        return [e.decode("utf-8", "replace") if isinstance(e, bytes) else str(e) for e in array.reshape(-1)]
    return np.ascontiguousarray(array.reshape(-1))


def is_binary(request: InferRequest, name: str) -> bool:
    """Whether output `name` goes as binary data: its own `binary_data` parameter, else the request's default."""
    for wanted in request.requested:
        if wanted.name == name and wanted.binary is not None:
            return wanted.binary
    return request.binary_output


_LITTLE_ENDIAN = sys.byteorder == "little"


def tensor_bytes(array: Array) -> bytes:
    """One tensor's binary data: little-endian values, or length-prefixed BYTES elements."""
    if array.dtype.kind in "OSU":
        return encode_bytes_elements(array)
    if _LITTLE_ENDIAN and array.dtype.isnative:
        return array.tobytes()  # C order, as `ascontiguousarray` below gives it, without a new dtype each time
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def encode_infer_response(request: InferRequest, response: InferResponse) -> tuple[bytes, int | None]:
    """Encode a V2 response; returns the body and the JSON header's length when binary data follows."""
    entries, tails = [], []
    for name, array in response.outputs.items():
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(array.dtype), "shape": list(array.shape)}
        if is_binary(request, name):
            raw = tensor_bytes(array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            tails.append(raw)
        else:
            entry["data"] = _json_data(array)
        entries.append(entry)
    answer: dict[str, Any] = {
        "model_name": response.model,
        "model_version": str(response.version),
        "outputs": entries,
    }
    if response.id is not None:
        answer["id"] = response.id
    header = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    if not tails:
        return header, None
    return header + b"".join(tails), len(header)


def metadata_json(metadata: ModelMetadata) -> dict[str, Any]:
    """The V2 model metadata of a version, with layerserve's state, engine and version fields."""
    return {
        "name": metadata.name,
        "versions": [str(v) for v in metadata.versions],
        "active_version": str(metadata.active_version or ""),
        "pinned_version": str(metadata.pinned_version or ""),
        "version_labels": {label: str(number) for label, number in metadata.version_labels.items()},
        "platform": "keras_tensorflow",
        "inputs": [spec.to_dict() for spec in metadata.inputs],
        "outputs": [spec.to_dict() for spec in metadata.outputs],
        "version": str(metadata.version),
        "state": metadata.state,
        "reason": metadata.reason,
        "engine": metadata.engine,
        "engine_reason": metadata.engine_reason,
        "layer_count": metadata.layer_count,
        "cuts": metadata.cuts,
        "batching": metadata.batching,
        "description": metadata.description,
        "input": metadata.input,
        "cache": metadata.cache,
        "memory": metadata.memory,
        "last_used": metadata.last_used,
    }


def index_json(entries: list[RepositoryEntry]) -> list[dict[str, str]]:
    """The repository index as Triton's rows (a model without versions has version "")."""
    return [
        {"name": e.name, "version": "" if e.version is None else str(e.version), "state": e.state, "reason": e.reason}
        for e in entries
    ]


def parse_load_request(body: bytes) -> dict[str, Any] | None:
    """The config of a Triton load request `{"parameters": {"config": "<JSON object>"}}`, if it has one.

    Raises:
        BadRequestError: not that shape, or another parameter (such as Triton's `file:` overrides).
    """
    parameters = load_json_object(body or b"{}", "the request body").get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequestError("the load request's parameters must be an object")
    unknown = [key for key in parameters if key != "config"]
    if unknown:
        raise BadRequestError(f"load parameter '{unknown[0]}' is not supported; the only parameter is 'config'")
    config = parameters.get("config")
    if config is None or isinstance(config, dict):
        return config
    if not isinstance(config, str):
        raise BadRequestError("load parameter 'config' must be a JSON object, or a string holding one")
    return load_json_object(config.encode(), "load parameter 'config'")
