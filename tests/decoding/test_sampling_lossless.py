"""Sampling through `generate` with speculation draws from exactly the target's law.

A tiny Llama with 8 tokens and peaked logits; two new tokens under temperature 0.7 and top-k 4. The exact joint
law of the two tokens is computed from the target itself; a batch of N identical prompts gives N independent
draws per proposer (and for plain `generate`, which checks the harness). A chi-square test must accept the law,
and the same test must reject it when the temperature is off by 0.1 (the power check, done two ways: measured on
draws, and computed from the non-central chi-square distribution).
"""

from __future__ import annotations

import copy

import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

import hf_specdec
from hf_specdec import SpeculativeConfig
from tests.conftest import DECODER
from tests.heads.test_medusa import heads_for

VOCAB = 8
N = 6_000
ALPHA = 1e-3
TEMPERATURE, TOP_K = 0.7, 4
PROMPT = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])  # repeats, so the n-gram proposer has something to propose


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(11)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **DECODER, pad_token_id=0, eos_token_id=None, bos_token_id=None)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # peaked logits: a 0.1 temperature error must be visible
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def exact_law(model, temperature: float) -> torch.Tensor:
    """[VOCAB * VOCAB]: P(t1, t2) after temperature and top-k, computed from the target's logits."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(TOP_K)])
    with torch.no_grad():
        first = torch.softmax(warpers(PROMPT, model(PROMPT).logits[:, -1].float()), dim=-1)[0]
        joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for t1 in range(VOCAB):
            if first[t1] > 0:
                prefix = torch.cat([PROMPT, torch.tensor([[t1]])], dim=1)
                second = torch.softmax(warpers(prefix, model(prefix).logits[:, -1].float()), dim=-1)[0]
                joint[t1] = first[t1].double() * second.double()
    return (joint / joint.sum()).flatten()


def draws(model, temperature: float, speculative: SpeculativeConfig | None) -> torch.Tensor:
    prompts = PROMPT.expand(N, -1)
    kwargs = dict(max_new_tokens=2, do_sample=True, temperature=temperature, top_k=TOP_K, top_p=1.0)
    if speculative is None:
        torch.manual_seed(5)
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kwargs)
    else:
        out = hf_specdec.generate(model, prompts, attention_mask=torch.ones_like(prompts), speculative=speculative, **kwargs)
    new = out[:, PROMPT.shape[1] :]
    return new[:, 0] * VOCAB + new[:, 1]


def chi_square_pvalue(samples: torch.Tensor, law: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=law.numel()).double()
    support = law > 0
    if counts[~support].sum() > 0:
        return 0.0  # a draw the law forbids
    expected = law[support] * counts.sum()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def _random_draft():
    torch.manual_seed(12)
    config = LlamaConfig(vocab_size=VOCAB, **{**DECODER, "hidden_size": 16, "num_hidden_layers": 1}, pad_token_id=0)
    draft = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        draft.lm_head.weight.mul_(30.0)
    return draft


PROPOSERS = {
    "plain_generate": lambda target: None,
    "random_draft": lambda target: SpeculativeConfig(method="draft", draft_model=_random_draft(), num_speculative_tokens=3, seed=1),
    "same_draft": lambda target: SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3, seed=2),
    "ngram": lambda target: SpeculativeConfig(method="ngram", num_speculative_tokens=3, seed=3),
    "random_draft_tree": lambda target: SpeculativeConfig(method="draft", draft_model=_random_draft(),
                                                          num_speculative_tokens=2, tree_width=3, seed=5),
    "same_draft_tree": lambda target: SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target),
                                                        num_speculative_tokens=2, tree_width=2, seed=6),
    "ngram_tree": lambda target: SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=2, seed=7),
    "medusa": lambda target: SpeculativeConfig(method="medusa", heads=heads_for(target), num_speculative_tokens=2,
                                               seed=9),
    "medusa_tree": lambda target: SpeculativeConfig(method="medusa", heads=heads_for(target), seed=10,
                                                    tree_paths=[(0,), (1,), (0, 0), (1, 0)]),
    "random_draft_dynamic_tree": lambda target: SpeculativeConfig(
        method="draft", draft_model=_random_draft(), num_speculative_tokens=2, tree_width=2, tree_total_tokens=4, seed=8
    ),
}


@pytest.mark.parametrize("name", sorted(PROPOSERS))
def test_sampling_matches_exact_target_law(target, name):
    law = exact_law(target, TEMPERATURE)
    assert int((law > 0).sum()) >= 6
    pvalue = chi_square_pvalue(draws(target, TEMPERATURE, PROPOSERS[name](target)), law)
    assert pvalue > ALPHA, f"{name}: p = {pvalue:.2e}"


def test_power_temperature_off_by_a_tenth_is_caught(target):
    """The test above would fail an engine whose temperature were 0.1 off."""
    law = exact_law(target, TEMPERATURE)
    wrong = exact_law(target, TEMPERATURE + 0.1)
    support = law > 0
    noncentrality = N * float((((wrong - law) ** 2)[support] / law[support]).sum())
    df = int(support.sum()) - 1
    power = 1 - stats.ncx2.cdf(stats.chi2.ppf(1 - ALPHA, df), df, noncentrality)
    assert power > 0.99, f"power {power:.3f} (noncentrality {noncentrality:.1f})"
    biased = SpeculativeConfig(method="ngram", num_speculative_tokens=3, seed=4)
    assert chi_square_pvalue(draws(target, TEMPERATURE + 0.1, biased), law) < ALPHA
