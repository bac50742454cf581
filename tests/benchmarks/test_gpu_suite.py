"""The GPU command's pieces run where there is no GPU (smoke sizes; no speed is asserted)."""

import math
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_step_overhead_smoke(tmp_path, benchmark_script):
    report = benchmark_script("step_overhead").main(["--smoke", "--json", str(tmp_path / "overhead.json")])
    cases = {(case["mode"], case["batch"]) for case in report["cases"]}
    assert cases == {("eager", 1), ("eager", 2), ("compiled", 1), ("compiled", 2)}
    # smoke sizes measure nothing (a step can even time below zero): the numbers only have to be there
    assert all(math.isfinite(case["step_ms"]) and case["forward_ms"] > 0 for case in report["cases"])
    assert (tmp_path / "overhead.json").is_file()


def test_gpu_sh_runs_the_suite():
    script = (BENCHMARKS / "gpu.sh").read_text()
    assert "benchmarks/gpu_suite.py" in script and (BENCHMARKS / "gpu.sh").stat().st_mode & 0o111
