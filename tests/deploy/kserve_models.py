"""Deserializes KServe manifests into the kserve SDK's generated models, strictly: a field its model does not know, a
value of the wrong type or a required field missing is an error. Run by tests/deploy/test_manifests.py in the SDK's
own virtual environment (`.venv-kserve`: the SDK pins protobuf < 7), never imported by the suite:

    .venv-kserve/bin/python tests/deploy/kserve_models.py FILE...

Prints one JSON object: {"checked": ["FILE#N Kind", ...], "errors": ["FILE#N path: problem", ...]}.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import kserve.models
import kubernetes.client.models
import yaml

# The kinds checked, by apiVersion and kind: the SDK's model of each.
MODELS = {
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "V1alpha1ClusterServingRuntime",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
}
_SCALARS: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float), "bool": bool}
# The SDK writes `list[X]` and `dict(str, X)`, the Kubernetes client (which holds the core kinds) `List[X]` and
# `Dict[str, X]`.
_LIST = re.compile(r"[lL]ist\[(.+)\]")
_DICT = re.compile(r"(?:dict\(|Dict\[)\w+, (.+)[)\]]")


def build(value: Any, type_name: str, path: str, errors: list[str]) -> Any:
    """The SDK object `value` deserializes to as `type_name` (an openapi_types entry); problems go to `errors`."""
    if match := _LIST.fullmatch(type_name):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return None
        return [build(item, match[1], f"{path}[{i}]", errors) for i, item in enumerate(value)]
    if match := _DICT.fullmatch(type_name):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return None
        return {key: build(item, match[1], f"{path}.{key}", errors) for key, item in value.items()}
    if type_name == "object":  # int-or-string and free-form fields
        return value
    if type_name in _SCALARS:
        if not isinstance(value, _SCALARS[type_name]) or (isinstance(value, bool) and type_name != "bool"):
            errors.append(f"{path}: expected {type_name}, got {type(value).__name__} {value!r}")
        return value
    if type_name in ("datetime", "date"):
        return value
    return _build_model(value, type_name, path, errors)


def _build_model(value: Any, type_name: str, path: str, errors: list[str]) -> Any:
    model = getattr(kserve.models, type_name, None) or getattr(kubernetes.client.models, type_name)
    if not isinstance(value, dict):
        errors.append(f"{path}: expected a mapping ({type_name}), got {type(value).__name__}")
        return None
    attributes = {key: attribute for attribute, key in model.attribute_map.items()}
    arguments = {}
    known = len(errors)
    for key, item in value.items():
        if key not in attributes:
            errors.append(f"{path}.{key}: unknown field of {type_name}")
            continue
        attribute = attributes[key]
        arguments[attribute] = build(item, model.openapi_types[attribute], f"{path}.{key}", errors)
    if len(errors) > known:
        return None  # named already: building it would only repeat its part's error
    try:
        return model(**arguments)  # the SDK's setters (the client's pydantic models) check required fields
    except (ValueError, TypeError) as error:
        errors.append(f"{path}: {type_name}: {' '.join(str(error).split())}")
        return None


def check(paths: list[str]) -> dict[str, list[str]]:
    """Every KServe document of the files at `paths` built strictly; other kinds are left to other checks."""
    checked: list[str] = []
    errors: list[str] = []
    for path in paths:
        for number, document in enumerate(yaml.safe_load_all(Path(path).read_text(encoding="utf-8"))):
            if not isinstance(document, dict):
                continue
            model = MODELS.get((document.get("apiVersion"), document.get("kind")))
            if model is None:
                continue
            where = f"{path}#{number}"
            checked.append(f"{where} {document['kind']}")
            build(document, model, where, errors)
    return {"checked": checked, "errors": errors}


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1:])))
