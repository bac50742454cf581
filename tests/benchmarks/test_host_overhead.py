"""benchmarks/host_overhead.py runs and prints every path (a smoke test; no speed is asserted)."""


def test_host_overhead_script_runs(capsys, benchmark_script):
    benchmark_script("host_overhead").main(["--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("transformers", "assistant", "hf"))]
    names = [row[:26].strip() for row in rows]
    assert names == ["transformers prompt lookup", "hf_specdec ngram", "assistant_model[random]",
                     "hf_specdec draft[random]", "assistant_model[copy]", "hf_specdec draft[copy]"]
    # each hf_specdec path has its forward-bound ratio to transformers' path; transformers' own paths have none
    assert all(row.split()[-1].endswith("x") == row.startswith("hf_specdec") for row in rows)
