"""benchmarks/suffix_replay.py: the replay's acceptance walks draft trees as verification does, its steps are the
engine's (prefill first, no draft past the output), and the cross-request cache shows on a repeated output."""

from __future__ import annotations

import json

import pytest


def test_accepted_length_follows_the_longest_drafted_path(benchmark_script):
    module = benchmark_script("suffix_replay")
    # root -> 5 -> 6 -> 7, and a branch root -> 5 -> 9
    tokens, parents = (5, 6, 9, 7), (-1, 0, 0, 1)
    assert module.accepted_length(tokens, parents, [5, 9, 1]) == 2
    assert module.accepted_length(tokens, parents, [5, 6, 7, 8]) == 3
    assert module.accepted_length(tokens, parents, [6]) == 0
    assert module.accepted_length(tokens, parents, [5]) == 1  # the output ends


def test_a_repeated_output_drafts_from_the_cache(benchmark_script):
    module = benchmark_script("suffix_replay")
    answer = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    prompts, outputs = [[3, 4], [3, 4]], [answer, answer]  # the second request repeats the first
    ngram = module.replay(prompts, outputs, "ngram", k=4)
    suffix = module.replay(prompts, outputs, "suffix", k=4)
    # nothing in either prompt to look up: n-gram lookup never drafts, every token is a forward
    assert [(c.tokens, c.forwards, c.drafts) for c in ngram] == [(12, 12, 0), (12, 12, 0)]
    assert suffix[0] == ngram[0]  # the first pass has nothing cached
    # the second: the prefill, then steps drafting from the first answer (capped at the match length: 1, 2, 4...)
    assert suffix[1].drafts > 0 and suffix[1].forwards < 12
    assert suffix[1].tokens == 12 and suffix[1].accepted == 12 - suffix[1].forwards
    # withholding every draft that scores under 100 makes it a plain run again
    assert module.replay(prompts, outputs, "suffix", k=4, min_score=100.0)[1] == ngram[1]


def test_replay_prints_and_writes_every_part(benchmark_script, tmp_path, capsys):
    module = benchmark_script("suffix_replay")
    answer = [11, 12, 13, 14, 15, 16]
    session = {"num_per_part": 1, "prompts": [[3, 4], [5, 6], [3, 4, 7], [5, 6, 11, 12]],
               "outputs": [answer, [7, 7, 7, 7], answer, answer]}
    path = tmp_path / "session.json"
    path.write_text(json.dumps(session))
    module.main(["replay", str(path), "-k", "3", "--min-score", "0", "1.5", "--json", str(tmp_path / "out.json")])
    printed = capsys.readouterr().out
    assert "second turns" in printed and "suffix" in printed
    report = json.loads((tmp_path / "out.json").read_text())
    assert [(case["method"], case["min_score"]) for case in report["results"]] == [
        ("ngram", None), ("suffix", 0.0), ("suffix", 1.5)]
    # the third request is the varied-code part
    forwards = module.replay(session["prompts"], session["outputs"], "suffix", 3)[2].forwards
    assert report["results"][1]["varied code"]["tokens_per_forward"] == pytest.approx(6 / forwards)
    assert report["settings"]["k"] == [3]
