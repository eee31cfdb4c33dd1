"""The layers of docs/architecture.md hold in the code: no module imports from a layer above its own.

The table under "## Layers" in docs/architecture.md is read here, so the document and the
code cannot drift apart: a new module must be given a layer there, and an import that
runs up (a stage importing the dataset, measurement importing an application) fails.
Imports inside functions count as much as those at the top of a file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpuload"


def layers() -> dict[str, int]:
    """``{unit: layer}`` from the document's table (``| 3 | `gpu/`, `decode` | ... |``)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out = {}
    for number, units in re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", section, flags=re.M):
        for unit in re.findall(r"`([\w.]+)/?`", units):
            out[unit] = int(number)
    return out


def unit(module: str) -> str:
    """The unit a module belongs to: its package below gpuload, else itself (``gpuload.sources.fetch``
    -> ``sources``; ``gpuload.reader`` -> ``reader``; ``gpuload`` -> ``__init__``)."""
    parts = module.split(".")[1:]
    return parts[0] if parts else "__init__"


def imports() -> list[tuple[str, str, int]]:
    """``(module, imported gpuload module, line)`` for every import of gpuload in the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_pkg else parts)
        package = module if is_pkg else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            out += [(module, n, node.lineno) for n in names if n == "gpuload" or n.startswith("gpuload.")]
    return out


def test_the_document_places_every_module():
    known = layers()
    assert len(set(known.values())) >= 5, "the layer table of docs/architecture.md was not found"
    units = {unit(".".join(p.relative_to(ROOT).with_suffix("").parts).replace(".__init__", ""))
             for p in PACKAGE.rglob("*.py")}
    assert not units - set(known), f"give these a layer in docs/architecture.md: {sorted(units - set(known))}"


def test_no_import_runs_up():
    known = layers()
    up = []
    for module, target, line in imports():
        a, b = unit(module), unit(target)
        if b in known and a in known and known[b] > known[a]:
            up.append(f"{module}:{line} imports {target} (layer {known[b]} above {known[a]})")
    assert not up, "\n".join(up)


@pytest.mark.parametrize("module, target", [("gpuload.pipeline", "gpuload.dataset"),
                                            ("gpuload.observe.watch", "gpuload.tools.demo")])
def test_an_import_that_runs_up_would_be_found(module, target):
    known = layers()
    assert known[unit(target)] > known[unit(module)]


def test_the_readme_names_every_module():
    """The README's "Layout" names each module of the package (a user's trial found ten missing)."""
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`(\w+)`", text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]))
    modules = {p.stem for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__")}
    assert not modules - named, f"name these in the README's Layout: {sorted(modules - named)}"
