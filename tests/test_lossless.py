"""Where an output parts from plain generate's, and whether rounding explains it (`hf_specdec.lossless`), and how
the demo reports it."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.cli.demo import MethodRow, summarize, verdict
from hf_specdec.cli.timing import Repeats
from hf_specdec.lossless import TIE_SPACINGS, Divergence, divergences, first_difference, spacing
from tests.cli.test_demo import PLAIN, generation


def test_spacing_of_each_dtype():
    assert spacing(20.0, torch.bfloat16) == 0.125  # 2^4 * 2^-7
    assert spacing(-20.0, torch.bfloat16) == 0.125
    assert spacing(1.0, torch.float16) == 2.0**-10
    assert spacing(3.0, torch.float32) == 2.0**-22
    # it is the step between neighbours: the next bfloat16 above 20 is 20.125
    assert float(torch.tensor(20.0 + 0.125 * 0.6, dtype=torch.bfloat16)) == 20.125
    with pytest.raises(ValueError, match="spacing: dtype torch.int8"):
        spacing(1.0, torch.int8)


def test_first_difference():
    a = torch.tensor([1, 2, 3, 4])
    assert first_difference(a, a.clone()) is None
    assert first_difference(a, torch.tensor([1, 2, 9, 4])) == 2
    assert first_difference(a, torch.tensor([1, 2])) == 2  # the shorter ends where the longer goes on


def _scores(rows: list[dict[int, float]], vocab: int = 8) -> torch.Tensor:
    """[B, V] scores: -10 everywhere but the given (token: score) per row."""
    scores = torch.full((len(rows), vocab), -10.0)
    for row, values in enumerate(rows):
        for token, value in values.items():
            scores[row, token] = value
    return scores


def test_divergences_measure_the_taken_tokens_score_below_plains_best():
    prompt = [[7, 7], [7, 7], [7, 7]]
    plain = torch.tensor([p + [1, 2, 3] for p in prompt])
    other = torch.tensor([[7, 7, 1, 2, 3],  # identical: not listed
                          [7, 7, 1, 5, 6],  # parts at new token 1, taking 5: 1 bf16 spacing (0.0625 at 10) below
                          [7, 7, 4, 4, 4]])  # parts at new token 0, taking 4: 40 spacings below
    step0 = _scores([{1: 3.0}, {1: 3.0}, {1: 3.0, 4: 0.5}])
    step1 = _scores([{2: 10.0}, {2: 10.0, 5: 9.9375, 6: 9.9375}, {2: 10.0}])
    step2 = _scores([{3: 1.0}] * 3)
    found = divergences(plain, other, 2, [step0, step1, step2], torch.bfloat16)
    assert [(d.row, d.position) for d in found] == [(1, 1), (2, 0)]
    assert found[0].gap_in_spacings == pytest.approx(1.0) and found[0].near_tie
    assert found[1].gap_in_spacings == pytest.approx(2.5 / spacing(3.0, torch.bfloat16)) and not found[1].near_tie
    # in float32 the same scores are 2^16 times as many spacings apart: no near-tie
    assert not divergences(plain, other, 2, [step0, step1, step2], torch.float32)[0].near_tie
    with pytest.raises(ValueError, match="3 plain rows against 2 other rows"):
        divergences(plain, other[:2], 2, [step0, step1, step2], torch.bfloat16)


def test_a_parting_at_an_exact_tie_of_three_tokens_is_a_near_tie():
    """bfloat16 logits tie exactly often enough that the token taken need not be plain's runner-up."""
    plain, other = torch.tensor([[1, 2]]), torch.tensor([[1, 6]])
    found, = divergences(plain, other, 1, [_scores([{2: 16.0, 3: 16.0, 6: 16.0}])], torch.bfloat16)
    assert found.gap_in_spacings == 0.0 and found.near_tie


def test_a_parting_past_plains_scores_is_a_fault():
    found, = divergences(torch.tensor([[1, 2]]), torch.tensor([[1, 2, 3]]), 1, [_scores([{2: 1.0}])], torch.bfloat16)
    assert found.position == 1 and found.gap_in_spacings is None and not found.near_tie


def test_the_demo_marks_near_ties_and_faults_and_exits_on_faults_only():
    tokens = torch.arange(40).reshape(2, 20)
    plain = Repeats(seconds=[0.4], values=[generation(32, 0.32, tokens, False)])
    method = Repeats(seconds=[0.2], values=[generation(8, 0.12, tokens + 1, True)])
    tie = Divergence(row=0, position=3, gap_in_spacings=TIE_SPACINGS)
    fault = Divergence(row=1, position=0, gap_in_spacings=TIE_SPACINGS + 0.5)
    tied = summarize("ngram", method, plain, lambda sequences: [tie])
    assert tied.matches == "tie" and not tied.identical and tied.divergences == (tie,)
    faulty = summarize("ngram", method, plain, lambda sequences: [tie, fault])
    assert faulty.matches == "NO"
    assert summarize("ngram", method, plain).matches == "NO"  # nothing known of where: a fault
    same = summarize("ngram", Repeats(seconds=[0.2], values=[generation(8, 0.12, tokens, True)]), plain,
                     lambda sequences: pytest.fail("an identical output is not looked into"))
    assert same.matches == "yes"
    assert verdict([PLAIN, same]) == "All outputs identical to plain generate."
    assert " ".join(verdict([PLAIN, same, tied]).split()).startswith(
        "All outputs identical to plain generate but for 1 near-tie: answers that part from plain's at a token")
    assert verdict([PLAIN, tied, faulty]).startswith("MISMATCH")


def test_rows_default_to_identical():
    assert isinstance(PLAIN, MethodRow) and PLAIN.matches == "yes"


def test_the_demo_table_lists_each_parting_once(capsys):
    import dataclasses

    from hf_specdec.cli.demo import print_table

    tie = Divergence(row=1, position=35, gap_in_spacings=1.0)
    row = dataclasses.replace(PLAIN, name="ngram", divergences=(tie, tie))  # two rounds parting alike
    print_table([PLAIN, row])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[-1] == "tie"
    listed = [line for line in lines if line.startswith("  tie: ngram")]
    assert len(listed) == 1 and "answer 2 parts from plain generate's at new token 36" in listed[0]
    assert all(len(line) <= 116 for line in lines)


def test_check_greedy_on_a_padded_batch(monkeypatch):
    """n-gram lookup on a left-padded batch of a tiny Llama in float32: identical; a method whose output is changed
    at one token: a fault, named; the same parting under an unbounded threshold: a near-tie."""
    import math

    import hf_specdec
    from hf_specdec import SpeculativeConfig, check_greedy, lossless
    from tests.conftest import make_model, padded_batch

    model = make_model("llama")
    ids, mask = padded_batch([9, 5], repeat_period=3)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    report = check_greedy(model, ids, config, attention_mask=mask, max_new_tokens=12)
    assert report.identical and report.lossless and str(report) == "identical to plain generate on all 2 rows"
    assert report.plain.shape == report.speculative.shape == (2, ids.shape[1] + 12)
    generate = hf_specdec.generate

    def changed(*args, **kwargs):  # row 1's 4th new token replaced
        sequences = generate(*args, **kwargs).clone()
        sequences[1, ids.shape[1] + 3] = (sequences[1, ids.shape[1] + 3] + 1) % 50
        return sequences

    monkeypatch.setattr(lossless, "generate", changed)
    report = check_greedy(model, ids, config, attention_mask=mask, max_new_tokens=12)
    assert not report.lossless and [(d.row, d.position) for d in report.faults] == [(1, 3)]
    assert "1 of 2 rows part from plain generate's output, 1 where rounding does not explain it" in str(report)
    assert "row 1, new token 3: the token taken scored" in str(report) and "FAULT" in str(report)
    monkeypatch.setattr(lossless, "TIE_SPACINGS", math.inf)
    report = check_greedy(model, ids, config, attention_mask=mask, max_new_tokens=12)
    assert report.lossless and not report.identical and "near-tie" in str(report)


def test_check_greedy_refuses_what_it_cannot_compare():
    from hf_specdec import SpeculativeConfig, check_greedy
    from tests.conftest import make_model

    model, ids = make_model("llama"), torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="do_sample=True: sampled outputs differ from plain generate's by design"):
        check_greedy(model, ids, SpeculativeConfig(method="ngram"), do_sample=True)
    with pytest.raises(ValueError, match="output_scores: set by check_greedy itself"):
        check_greedy(model, ids, SpeculativeConfig(method="ngram"), output_scores=True)
    with pytest.raises(TypeError, match="speculative: expected a SpeculativeConfig, got dict"):
        check_greedy(model, ids, {"method": "ngram"})


def test_plain_scores_are_computed_once_and_refuse_a_plain_generate_that_changed():
    from types import SimpleNamespace

    from hf_specdec.lossless import PlainScores

    calls = []

    class Target:
        def generate(self, ids, **kwargs):
            calls.append(kwargs)
            return SimpleNamespace(sequences=ids + len(calls) - 1, scores=(torch.zeros(1, 4),))

    ids = torch.tensor([[1, 2]])
    scores = PlainScores(Target(), [(ids, torch.ones_like(ids))], {"max_new_tokens": 1})
    scores.outputs = [ids]
    assert scores(0)[0].shape == (1, 4) and scores(0) is scores(0) and len(calls) == 1
    assert calls[0]["output_scores"] and calls[0]["return_dict_in_generate"] and calls[0]["max_new_tokens"] == 1
    scores.scores.clear()  # the next call's plain output differs from the reference
    with pytest.raises(RuntimeError, match="plain generate gave another output when run again"):
        scores(0)


def test_trailing_padding_on_one_side_is_no_difference():
    from hf_specdec.lossless import same_output

    plain, cut = torch.tensor([[4, 5, 0, 0]]), torch.tensor([[4, 5]])
    assert same_output(plain, cut, pad_token_id=0) and same_output(cut, plain, pad_token_id=0)
    assert not same_output(plain, cut)  # padding unknown: the widths differ
    assert not same_output(torch.tensor([[4, 5, 7, 0]]), cut, pad_token_id=0)  # a real token past the end
    assert divergences(plain, cut, 1, [_scores([{5: 1.0}])] * 3, torch.bfloat16, pad_token_id=0) == []
