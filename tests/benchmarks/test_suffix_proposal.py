"""benchmarks/suffix_proposal.py runs and prints every cell (a smoke test; no speed is asserted)."""


def test_suffix_proposal_script_runs(capsys, benchmark_script):
    benchmark_script("suffix_proposal").main(["--requests", "0", "6", "--contexts", "64", "200", "--steps", "5", "--output-tokens", "40"])
    lines = capsys.readouterr().out.splitlines()
    cells = [line.split()[:3] for line in lines if line.split()[0].isdigit()]
    assert cells == [["0", "64", "novel"], ["0", "200", "novel"], ["6", "64", "novel"], ["6", "64", "repeat"],
                     ["6", "200", "novel"], ["6", "200", "repeat"]]
    assert any(line.startswith("-- 6 cached requests, ") for line in lines)
    assert any(line.startswith("full cache: adding an output and evicting the oldest") for line in lines)
    assert not any(line.startswith("goal:") for line in lines)  # only judged at 8k context and 10k requests
