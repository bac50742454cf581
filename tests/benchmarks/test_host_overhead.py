"""benchmarks/host_overhead.py runs and prints every path (a smoke test; no speed is asserted)."""

import importlib.util
from pathlib import Path


def test_host_overhead_script_runs(capsys):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py"
    spec = importlib.util.spec_from_file_location("host_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("transformers", "assistant", "hf"))]
    names = [row[:26].strip() for row in rows]
    assert names == ["transformers prompt lookup", "hf_specdec ngram", "assistant_model[random]",
                     "hf_specdec draft[random]", "assistant_model[copy]", "hf_specdec draft[copy]"]
    # each hf_specdec path has its forward-bound ratio to transformers' path; transformers' own paths have none
    assert all(row.split()[-1].endswith("x") == row.startswith("hf_specdec") for row in rows)
