"""heads/ is layered by its imports, with no cycle: `adapter.py` imports no head; a method's `config.py` imports no
other part of heads/; its converters (`convert.py`) only the adapter module and its own config; no module of heads/
hides an import inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hf_specdec.heads

HEADS = Path(hf_specdec.heads.__file__).parent
METHODS = sorted(p.name for p in HEADS.iterdir() if (p / "__init__.py").is_file())


def _imports(path: Path) -> tuple[set[str], list[int]]:
    """The hf_specdec.heads modules `path` imports at module level, and the lines of imports inside functions."""
    tree = ast.parse(path.read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_specdec.heads"):
            top.add(node.module)
        elif isinstance(node, ast.Import):
            top.update(a.name for a in node.names if a.name.startswith("hf_specdec.heads"))
    nested = [node.lineno for function in ast.walk(tree) if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
              for node in ast.walk(function) if isinstance(node, ast.Import | ast.ImportFrom)]
    return top, nested


def test_every_method_has_its_folder():
    assert METHODS == ["eagle", "medusa", "mlp_speculator"]


def test_adapter_imports_no_head():
    assert _imports(HEADS / "adapter.py")[0] == set()


@pytest.mark.parametrize("method", METHODS)
def test_config_and_converters_import_only_the_adapter_module_and_the_config(method):
    assert _imports(HEADS / method / "config.py")[0] == set()
    allowed = {"hf_specdec.heads.adapter", f"hf_specdec.heads.{method}.config"}
    assert _imports(HEADS / method / "convert.py")[0] <= allowed


@pytest.mark.parametrize("path", sorted(HEADS.rglob("*.py")), ids=lambda p: str(p.relative_to(HEADS)))
def test_no_import_inside_a_function(path):
    assert _imports(path)[1] == []
