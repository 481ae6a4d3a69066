"""The shape the design holds the code to, checked on the source: no import circle anywhere in src/ (deferred and
type-checking imports included), nothing imported from a private module or by a private name of the server stack's
dependencies, no hand-written HTTP/2 frames, and no transport reaching past the data plane."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).parents[1] / "src" / "layerserve"
STACK = ("uvicorn", "starlette", "grpc", "grpc_health", "grpc_reflection", "zttp", "httptools")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in SOURCE.rglob("*.py")}


def _imports(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """Every import of a module, wherever it is (in functions, under TYPE_CHECKING): (module, names, line)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            yield node.module, [alias.name for alias in node.names], node.lineno


def _edges() -> dict[str, set[str]]:
    """layerserve's modules and the layerserve modules each imports."""
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(path):
            if module != "layerserve" and not module.startswith("layerserve."):
                continue
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES] or [module]
            edges[name].update(target for target in targets if target in MODULES and target != name)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_anywhere_in_src() -> None:
    assert _cycles(_edges()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_uses_a_private_module_or_name_of_the_server_stack() -> None:
    offences = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = set()
        for module, names, line in _imports(path):
            if module.split(".")[0] not in STACK:
                continue
            private = [part for part in module.split(".") if part.startswith("_")] or [
                n for n in names if n.startswith("_")
            ]
            if private or module.startswith("uvicorn.protocols"):
                offences.append(f"{name}:{line} imports {module} {names}")
            aliases.update(names or [module.split(".")[0]])
        for node in ast.walk(tree):  # `grpc._cython...`, `zttp._zttp...`: a private attribute of a stack module
            if (
                isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
            ):  # fmt: skip
                offences.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert offences == []


_FRAME_PACKING = re.compile(r"""pack\(\s*["'][<>!]?I?BI|pack\(\s*["'][<>!]HI|to_bytes\(3,""")


def test_no_http2_frame_is_packed_by_hand() -> None:
    # HTTP/2 frames (a 24-bit length, a type and flags, a stream id; SETTINGS entries) are zttp's to write.
    packed = [name for name, path in MODULES.items() if _FRAME_PACKING.search(path.read_text(encoding="utf-8"))]
    assert packed == []


def test_transports_reach_versions_only_through_the_data_plane() -> None:
    barred = ("layerserve.serving", "layerserve.lifecycle.reloader", "layerserve.runtime", "layerserve.engines")
    for name, path in MODULES.items():
        if not name.startswith("layerserve.transports."):
            continue
        for module, names, line in _imports(path):
            assert not module.startswith(barred), (name, line, module)
            assert "ModelVersion" not in names and "ModelRegistry" not in names, (name, line)
