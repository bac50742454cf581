"""benchmarks/host_overhead.py runs and prints both paths (a smoke test; no speed is asserted)."""

import importlib.util
from pathlib import Path


def test_host_overhead_script_runs(capsys):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py"
    spec = importlib.util.spec_from_file_location("host_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--repeats", "1"])
    out = capsys.readouterr().out
    assert "transformers prompt lookup" in out and "hf_specdec ngram" in out
