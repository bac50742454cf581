"""benchmarks/lookup_rules.py: each rule drafts what it says (transformers' rule is its own class's earliest match,
hf_specdec's the most recent one), the replay counts the forwards a fixed-k run takes, and the report is written."""

from __future__ import annotations

import json

import numpy as np


def test_rules_draft_the_earliest_and_the_most_recent_match(benchmark_script):
    rules = benchmark_script("lookup_rules").RULES
    # "5 6" follows 5 early in the text, "5 7" late; the text ends on 5
    text = np.array([1, 5, 6, 8, 9, 2, 5, 7, 3, 4, 5])
    assert rules["transformers"](text, 2).tolist() == [6, 8]
    assert rules["hf_specdec"](text, 2).tolist() == [7, 3]
    # transformers' continuation stops at the text's end; hf_specdec's copies on (a run of 4s)
    run = np.array([3, 4, 4])
    assert rules["transformers"](run, 3).tolist() == [4]
    assert rules["hf_specdec"](run, 3).tolist() == [4, 4, 4]


def test_replay_counts_the_forwards_a_fixed_k_run_takes(benchmark_script):
    module = benchmark_script("lookup_rules")
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    # the answer repeats the prompt: after the first token every draft of k = 3 is kept whole (4 tokens a step)
    forwards = module.replay(prompt, prompt[:], module.RULES["hf_specdec"], 3)
    assert forwards == 3  # prefill (1 token), then 4, then the last 3 (a draft cut to what is left)
    # nothing to match: one token a forward
    assert module.replay([1, 2, 3], [4, 5, 6, 7], module.RULES["transformers"], 5) == 4


def test_replay_writes_every_rule_per_category(benchmark_script, tmp_path):
    module = benchmark_script("lookup_rules")
    rows = [{"category": "qa", "prompt": [10, 11, 12, 13], "answer": [10, 11, 12, 13, 20]},
            {"category": "code", "prompt": [5, 6], "answer": [7, 8, 9]}]
    outputs, report = tmp_path / "outputs.json", tmp_path / "report.json"
    outputs.write_text(json.dumps({"rows": rows, "max_new_tokens": 5}))
    module.main(["replay", str(outputs), "-k", "2", "4", "--json", str(report)])
    results = json.loads(report.read_text())["results"]
    assert [(r["k"], r["rule"]) for r in results] == [(k, rule) for k in (2, 4) for rule in module.RULES]
    for result in results:
        assert set(result["tokens_per_forward"]) == {"qa", "code", "overall"}
        assert result["target_forwards"]["code"] == 3  # nothing repeats there
        assert result["target_forwards"]["overall"] == result["target_forwards"]["qa"] + 3
