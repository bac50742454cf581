"""The GPU command's pieces run where there is no GPU (smoke sizes; no speed is asserted)."""

import json
import math
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_step_overhead_smoke(tmp_path, benchmark_script):
    cases = benchmark_script("step_overhead").main(["--smoke", "--json", str(tmp_path / "overhead.json")])
    assert json.loads((tmp_path / "overhead.json").read_text())["results"] == cases
    modes = {(case["mode"], case["batch"], case["schedule"]) for case in cases}
    assert modes == {(mode, batch, schedule) for mode in ("eager", "compiled") for batch in (1, 2)
                     for schedule in ("fixed", "adaptive")}
    # smoke sizes measure nothing (a step can even time below zero): the numbers only have to be there
    assert all(math.isfinite(case["step_ms"]) and case["forward_ms"] > 0 for case in cases)
    # float32: the (k + 1)-token forward keeps the one-token forward's greedy choices, so the oracle is never wrong
    assert all(case["accepted_share"] == 1.0 for case in cases)


def test_gpu_sh_runs_the_suite():
    script = (BENCHMARKS / "gpu.sh").read_text()
    assert "benchmarks/gpu_suite.py" in script and (BENCHMARKS / "gpu.sh").stat().st_mode & 0o111


def test_parts_run_alone_and_name_the_json(tmp_path, benchmark_script):
    report = benchmark_script("gpu_suite").main(["--smoke", "--parts", "attention_layout", "--out", str(tmp_path)])
    assert set(report["parts"]) == {"attention_layout"} and report["parts"]["attention_layout"]["returncode"] == 0
    assert report["parts"]["attention_layout"]["results"] is not None
    assert [path.name for path in tmp_path.iterdir()] == ["gpu_cpu-smoke_attention_layout.json"]


def test_the_suite_runs_every_file_of_gpu_marked_tests(benchmark_script):
    root = BENCHMARKS.parent
    marked = {str(path.relative_to(root)) for path in (root / "tests").rglob("test_*.py")
              if re.search(r"^@pytest\.mark\.gpu$", path.read_text(), re.MULTILINE)}
    listed = benchmark_script("gpu_suite").GPU_TEST_FILES
    assert marked == set(listed) and len(listed) == len(set(listed))
