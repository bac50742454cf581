"""Imports point one way: the per-step data types sit below the proposers and the verifier, and the decode loop
sits on top; nothing below the loop imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_specdec

PACKAGE = Path(hf_specdec.__file__).parent
# package -> the hf_specdec packages it must not import
FORBIDDEN = {
    "tree": ("step", "verify", "proposers", "cache", "decoding"),
    "step": ("verify", "proposers", "cache", "decoding"),
    "verify": ("proposers", "cache", "decoding"),
    "cache": ("proposers", "verify", "decoding"),
    "proposers": ("decoding",),
}


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_imports_point_one_way():
    found = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((PACKAGE / package).glob("*.py")):
            for module in _imported_modules(path):
                parts = module.split(".")
                if parts[0] == "hf_specdec" and len(parts) > 1 and parts[1] in forbidden:
                    found.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not found, found
