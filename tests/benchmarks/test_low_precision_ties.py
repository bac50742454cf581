"""benchmarks/low_precision_ties.py compares every method, the committed drafters included, with plain generate and
writes its report; float32 outputs must all be identical (a smoke test at tiny sizes)."""

import json


def test_low_precision_ties_script_reports_every_method(tmp_path, benchmark_script):
    out = tmp_path / "ties.json"
    benchmark_script("low_precision_ties").main(["--model", "testbed", "--prompts", "1", "--max-new-tokens", "6", "--json", str(out)])
    report = {}
    for cell in json.loads(out.read_text())["results"]:
        report.setdefault(cell.pop("dtype"), {})[cell.pop("case")] = cell
    names = {"ngram", "ngram_tree", "draft", "medusa_tree", "eagle_tree", "eagle3_tree"}
    expected = {f"{name}/{processors}" for name in names for processors in ("none", "processors")}
    assert set(report["bfloat16"]) == expected
    assert all(cell["prompts"] == 1 and cell["differing"] == 0 for cell in report["float32"].values())
    # every parting is classified, and a near-tie is one within the threshold
    for cell in report["bfloat16"].values():
        assert cell["near_ties"] <= cell["differing"] == len(cell["gap_in_spacings"])
        assert cell["near_ties"] == sum(gap <= 4.0 for gap in cell["gap_in_spacings"])
