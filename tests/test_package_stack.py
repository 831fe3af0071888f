"""The package stack: imports point one way (DESIGN.md's layout), and no module reaches for another's
private names. Read from the source, imports inside functions included."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "lucebox"

# Lowest first: a package may import packages of its own rank or below, never above.
LAYERS = [
    ("errors", "util", "outputs", "config"),
    ("kernels",),
    ("weights",),
    ("text",),
    ("model",),
    ("default_model", "convert"),
    ("sampling",),
    ("spec",),
    ("train",),
    ("engine",),
    ("bench",),
    ("server", "llm"),
    ("agents",),
    ("cli",),
    ("__init__",),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if parts[-1] == "__init__" else module.rsplit(".", 1)[0]
        yield path, module, package


def _imports(path: Path, package: str):
    """(imported module, names, line) of every lucebox import in the file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "lucebox":
                yield target, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lucebox":
                    yield alias.name, [], node.lineno


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_layer():
    tops = {_top(module) for _, module, _ in _modules()}
    assert tops <= set(RANK), f"packages missing from LAYERS: {sorted(tops - set(RANK))}"


def test_imports_point_down_the_stack():
    upward = []
    for path, module, package in _modules():
        source = _top(module)
        for target, names, line in _imports(path, package):
            top = _top(target)
            if top == "__init__" and names:  # `from lucebox import x`: x is a package or module
                top = names[0] if names[0] in RANK else top
            if top != source and RANK[top] > RANK[source]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({source}) imports {target} ({top})")
    assert not upward, "imports pointing up the stack:\n" + "\n".join(upward)


def test_no_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for path, module, package in _modules():
        for target, _, _ in _imports(path, package):
            if _top(target) != _top(module):
                edges.setdefault(_top(module), set()).add(_top(target))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    cycles = sorted(a for a in edges if reaches(a, a, set()))
    assert not cycles, f"packages on an import cycle: {cycles}"


def test_no_private_name_is_imported_from_another_module():
    private = []
    for path, module, package in _modules():
        for target, names, line in _imports(path, package):
            for name in names:
                if name.startswith("_") and target != module:
                    private.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}.{name}")
    assert not private, "private names used across modules:\n" + "\n".join(private)


@pytest.mark.parametrize("layer", [names for names in LAYERS if names != ("__init__",)])
def test_layer_names_are_real_modules(layer):
    for name in layer:
        assert (ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file(), name
