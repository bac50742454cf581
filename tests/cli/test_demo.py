"""The demo's table rows and its explanation, from made-up timings; bad options."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_specdec import SpeculativeConfig
from hf_specdec.cli.demo import (
    DEFAULT_METHODS,
    METHODS,
    DemoModels,
    MethodRow,
    _methods,
    explain,
    generate_once,
    precision_hint,
    summarize,
)
from hf_specdec.cli.main import build_parser, main
from hf_specdec.cli.runs import Generation
from hf_specdec.cli.timing import Repeats
from hf_specdec.stats import SpecStats
from hf_specdec.suffix import SuffixCache
from hf_specdec.testbed.loading import load_testbed


def generation(forwards: int, forward_seconds: float, sequences: torch.Tensor, drafted: bool) -> Generation:
    """2 rows of 32 new tokens each."""
    stats = SpecStats(num_drafts=10, num_draft_tokens=40, num_accepted_tokens=20, accepted_per_position=[8, 6, 4, 2],
                      target_forward_passes=forwards) if drafted else None
    return Generation(sequences=sequences, new_tokens=64, target_forward_passes=forwards,
                      target_forward_seconds=forward_seconds, stats=stats)


def test_summarize_pairs_rounds_and_splits_the_step_cost():
    tokens = torch.arange(40).reshape(2, 20)
    # plain: 32 forwards, 0.32 s inside them; rounds of 0.4, 0.8 (a slow one) and 0.4 s
    plain = Repeats(seconds=[0.4, 0.8, 0.4], values=[generation(32, 0.32, tokens, False)] * 3)
    # the method: 8 forwards (4x fewer), 0.2, 0.4, 0.2 s, of which 0.12 s in target forwards
    method = Repeats(seconds=[0.2, 0.4, 0.2], values=[generation(8, 0.12, tokens, True)] * 3)
    row = summarize("ngram", method, plain)
    assert row.speedup == pytest.approx(2.0)
    assert row.forwards_saved == pytest.approx(4.0)
    assert row.tokens_per_forward == pytest.approx(4.0)  # 32 tokens per row / 8 forwards
    assert row.step_cost == pytest.approx(2.0)  # 0.2 / 8 s per step against 0.4 / 32: 2 plain steps
    assert row.verify_cost == pytest.approx(1.2)  # 0.12 / 8 s in the verify forward, in 0.0125 s plain steps
    assert row.other_cost == pytest.approx(0.8)
    assert row.tokens_per_second == pytest.approx(64 / 0.2)
    assert row.mean_acceptance_length == pytest.approx(3.0) and row.acceptance_rate == pytest.approx(0.5)
    assert row.identical
    different = Repeats(seconds=method.seconds, values=[generation(8, 0.12, tokens + 1, True)] * 3)
    assert not summarize("ngram", different, plain).identical


PLAIN = MethodRow(name="plain", tokens_per_second=100.0, speedup=1.0, tokens_per_forward=1.0, forwards_saved=1.0,
                  step_cost=1.0, verify_cost=0.95, mean_acceptance_length=None, acceptance_rate=None)


def method(name: str, speedup: float, forwards_saved: float, verify_cost: float) -> MethodRow:
    return dataclasses.replace(PLAIN, name=name, speedup=speedup, tokens_per_forward=forwards_saved,
                               forwards_saved=forwards_saved, step_cost=forwards_saved / speedup,
                               verify_cost=verify_cost, mean_acceptance_length=forwards_saved + 1,
                               acceptance_rate=0.5)


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_explain_names_the_fastest_method_and_its_costs():
    text = one_line(explain([PLAIN, method("draft", 0.8, 2.0, 1.5), method("eagle", 1.6, 3.2, 1.4)]))
    assert text.startswith("why: speculation pays here: the fastest method, eagle (1.60x), needs 3.20x fewer")
    assert "costs 2.00 plain steps (1.40 in the verify forward, 0.60 drafting and bookkeeping)" in text


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        (method("ngram", 0.9, 1.1, 1.0), "acceptance is too low: 1.10 tokens per target forward"),
        (method("eagle3", 0.9, 3.5, 3.6), "the verify forward alone costs more than the forwards saved"),
        (method("eagle3", 0.9, 3.5, 2.5), "the verify forward alone would leave a 1.40x gain, and drafting"),
    ],
)
def test_explain_says_why_speculation_does_not_pay(row, reason):
    text = one_line(explain([PLAIN, method("draft", 0.5, 2.0, 1.5), row]))
    assert text.startswith(f"why: speculation does not pay here: the fastest method, {row.name} (0.90x)")
    assert reason in text


def test_explain_calls_a_speedup_within_the_noise_break_even():
    text = one_line(explain([PLAIN, method("ngram", 1.02, 1.19, 1.0)]))
    assert text.startswith("why: speculation about breaks even here: the fastest method, ngram (1.02x)")
    assert "acceptance is too low: 1.19 tokens per target forward" in text


def test_float32_runs_with_modest_speedups_get_the_bfloat16_note():
    rows = [PLAIN, method("ngram", 1.13, 1.4, 1.25), method("eagle3", 0.95, 1.2, 1.20), PLAIN,
            method("ngram", 0.9, 1.1, 1.3)]
    text = one_line(precision_hint("float32", rows))
    assert text.startswith("note: in float32 the fastest method here reached 1.13x (ngram).")
    assert "The demo's default, bfloat16, shows that regime" in text and "can part from plain generate's" in text
    assert all(len(line) <= 116 for line in precision_hint("float32", rows).splitlines())
    assert precision_hint("bfloat16", rows) is None  # already there
    assert precision_hint("float32", [*rows, method("eagle3", 1.4, 1.8, 1.1)]) is None  # one method paid well


def test_explain_lines_are_wrapped():
    assert all(len(line) <= 116 for line in explain([PLAIN, method("eagle3", 0.9, 3.5, 2.5)]).splitlines())


@pytest.mark.parametrize("option", ["--repeats", "--threads", "--num-prompts", "--max-new-tokens", "-k"])
def test_bad_numbers_are_clear_errors(option):
    with pytest.raises(SystemExit, match=r"must be >= 1, got 0"):
        main(["demo", "--testbed", option, "0"])


def test_too_many_prompts_is_a_clear_error():
    with pytest.raises(SystemExit, match="--num-prompts 1000 is more than the 32 prompts"):
        main(["demo", "--testbed", "--num-prompts", "1000"])


def test_testbed_and_a_model_are_one_choice():
    with pytest.raises(SystemExit, match="--testbed runs the committed test bed in float32; drop --model"):
        main(["demo", "--testbed", "--model", "org/model"])
    with pytest.raises(SystemExit, match="--testbed runs the committed test bed in float32; drop --model"):
        main(["demo", "--testbed", "--dtype", "float32"])


def test_a_chat_model_runs_in_bfloat16_unless_asked_and_the_test_bed_in_float32():
    from hf_specdec.cli.demo import _check

    parser = build_parser()
    chat = parser.parse_args(["demo"])
    _check(chat)
    assert chat.dtype == "bfloat16"
    asked = parser.parse_args(["demo", "--dtype", "float32"])
    _check(asked)
    assert asked.dtype == "float32"
    testbed = parser.parse_args(["demo", "--testbed"])
    _check(testbed)
    assert testbed.dtype == "float32"


def test_chat_workloads_show_the_question_and_go_through_the_template():
    from hf_specdec.cli.demo import CHAT_WORKLOADS, chat_workloads
    from hf_specdec.testbed.loading import load_testbed

    tokenizer = load_testbed()[0]
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    workloads = chat_workloads(tokenizer, 2)
    assert [w.name for w in workloads] == [name for name, _ in CHAT_WORKLOADS]
    code = workloads[-1]
    assert len(code.prompts) == 2 and code.shown.startswith("(the question)\nWrite a Python")
    assert tokenizer.decode(code.prompts[0]).endswith("<|im_start|>assistant\n")


def _demo_args(*argv: str):
    return build_parser().parse_args(["demo", *argv])


def test_default_methods_are_a_few_and_all_runs_every_one():
    assert _methods(_demo_args()) == list(DEFAULT_METHODS)  # SmolLM2 has every drafter they need
    assert _methods(_demo_args("--testbed")) == list(DEFAULT_METHODS)
    assert _methods(_demo_args("--model", "org/model")) == ["ngram", "suffix"]  # no drafters committed for it
    assert _methods(_demo_args("--testbed", "--methods", "all")) == list(METHODS)
    assert _methods(_demo_args("--model", "org/model", "--methods", "all")) == ["ngram", "ngram-tree", "suffix",
                                                                                "recycling"]
    assert _methods(_demo_args("--testbed", "--methods", "eagle", "ngram", "eagle")) == ["eagle", "ngram"]


def test_a_method_without_its_drafter_is_a_clear_error_before_loading():
    with pytest.raises(SystemExit, match=r"--methods eagle3 draft: no committed drafter for 'org/model' \(draft, "
                                         r"eagle3\); its methods are ngram, ngram-tree, suffix"):
        main(["demo", "--model", "org/model", "--methods", "eagle3", "draft"])
    with pytest.raises(SystemExit, match="--methods all already names every method; drop the others"):
        main(["demo", "--testbed", "--methods", "all", "ngram"])


def test_suffix_decoding_starts_every_call_with_an_empty_cache():
    """Each timed call answers the prompt an earlier call answered: its cache must not hold that answer."""
    tokenizer, target, _ = load_testbed()
    models = DemoModels(tokenizer, target, None, None, None, None)
    ids = torch.tensor([tokenizer("def parse_args(argv):\n")["input_ids"]])
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=3, suffix_cache=SuffixCache())
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    sizes = []
    for _ in range(2):
        generate_once(models, ids, torch.ones_like(ids), kwargs, config)
        sizes.append(config.suffix_cache.info().num_tokens)
    assert sizes[0] > 0 and sizes[1] == sizes[0]
