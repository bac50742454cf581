"""Sampling through `generate` with speculation draws from exactly the target's law.

A tiny Llama with 8 tokens and peaked logits; four new tokens under temperature 0.7 and top-k 4. The prefill
emits the first; the next step drafts the second and third (k >= 2) and, when both are accepted, adds the fourth
as a bonus, so every acceptance, rejection and bonus path of one speculative step shapes tokens 2-4. The exact
joint law of the four tokens is computed from the target itself; a batch of N identical prompts gives N
independent draws per proposer (and for plain `generate`, which checks the harness). Chi-square tests of the
marginal laws of tokens (2, 3) and (3, 4) must accept; the same tests must reject a temperature off by 0.1 and a
verifier that forgets the residual distribution (power computed from the non-central chi-square distribution,
and measured on draws).
"""

from __future__ import annotations

import copy

import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import (
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import hf_specdec
import hf_specdec.verify.verifier as verifier
from hf_specdec import SpeculativeConfig
from hf_specdec.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from hf_specdec.suffix import SuffixCache, SuffixConfig
from hf_specdec.verify.chain import rejection_sample
from tests.conftest import DECODER, make_model, padded_batch
from tests.heads.medusa.test_model import heads_for
from tests.proposers.test_mlp_speculator import fitted_speculator

VOCAB = 8
N = 6_000
NEW_TOKENS = 4
MARGINALS = ((1, 2), (2, 3))  # positions among the new tokens: tokens 2-3 and 3-4
ALPHA = 1e-3  # per test; each marginal is tested at ALPHA / len(MARGINALS)
MIN_EXPECTED = 5  # cells expected fewer times are pooled into one
TEMPERATURE, TOP_K = 0.7, 4
PROMPT = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])  # repeats, so the n-gram proposer has something to propose


def make_target():
    torch.manual_seed(11)
    return peaked(LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **DECODER, pad_token_id=0, eos_token_id=None,
                                               bos_token_id=None)).eval())


def peaked(model):
    """`model` with peaked logits (a 0.1 temperature error must be visible) and no EOS, padding with 0."""
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def target():
    return make_target()


def exact_law(model, temperature: float, processors: tuple = ()) -> torch.Tensor:
    """[VOCAB] * NEW_TOKENS float64: P(t1, ..., t4) after `processors` (as generate orders them: before the
    warpers), temperature and top-k, from the target's logits."""
    warpers = LogitsProcessorList([*processors, TemperatureLogitsWarper(temperature), TopKLogitsWarper(TOP_K)])
    law = torch.ones((), dtype=torch.float64)
    prefixes = PROMPT
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            probs = torch.softmax(warpers(prefixes, model(prefixes).logits[:, -1].float()), dim=-1).double()
        law = law[..., None] * probs.reshape(*law.shape, VOCAB)
        tokens = torch.arange(VOCAB).repeat(prefixes.shape[0])
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, dim=0), tokens[:, None]], dim=1)
    return law / law.sum()


def marginal(law: torch.Tensor, pair: tuple[int, int]) -> torch.Tensor:
    """[VOCAB * VOCAB]: the joint law of the new tokens at the two positions."""
    others = tuple(i for i in range(NEW_TOKENS) if i not in pair)
    return law.sum(dim=others).flatten()


def draws(model, temperature: float, speculative: SpeculativeConfig | None, **options) -> torch.Tensor:
    """[N, NEW_TOKENS]; `options`: more of generate's"""
    prompts = PROMPT.expand(N, -1)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=temperature, top_k=TOP_K, top_p=1.0,
                  **options)
    if speculative is None:
        torch.manual_seed(5)
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kwargs)
    else:
        out = hf_specdec.generate(model, prompts, attention_mask=torch.ones_like(prompts), speculative=speculative, **kwargs)
    return out[:, PROMPT.shape[1] :]


def _cells(law: torch.Tensor) -> torch.Tensor:
    """[VOCAB * VOCAB] bin of every cell: cells expected at least MIN_EXPECTED times keep their own, the rest (and
    the impossible ones, kept apart) are pooled."""
    expected = law * N
    big = expected >= MIN_EXPECTED
    bins = torch.full_like(law, -1, dtype=torch.long)
    bins[big] = torch.arange(int(big.sum()))
    bins[~big & (law > 0)] = int(big.sum())
    return bins


def _pool(
    # [VOCAB * VOCAB]
    cell_values: torch.Tensor,
    # [VOCAB * VOCAB] from _cells
    bins: torch.Tensor,
) -> torch.Tensor:
    """[bins]: the values summed per bin (impossible cells left out)."""
    size = int(bins.max()) + 1
    return torch.zeros(size, dtype=cell_values.dtype).index_add_(0, bins[bins >= 0], cell_values[bins >= 0])


def chi_square_pvalues(samples: torch.Tensor, law: torch.Tensor) -> list[float]:
    """One p-value per marginal (0 when a draw falls where the law has no mass)."""
    pvalues = []
    for pair in MARGINALS:
        cell_law = marginal(law, pair)
        cells = samples[:, pair[0]] * VOCAB + samples[:, pair[1]]
        bins = _cells(cell_law)
        if bool((bins[cells] < 0).any()):
            pvalues.append(0.0)
            continue
        observed = torch.bincount(bins[cells], minlength=int(bins.max()) + 1).double()
        expected = _pool(cell_law, bins) * N
        pvalues.append(float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue))
    return pvalues


def accepted(pvalues: list[float]) -> bool:
    return min(pvalues) > ALPHA / len(MARGINALS)


def _noisy_draft(target):
    """The target with noise on its lm_head: drafts close enough to be accepted often (at depth 2 too) and wrong
    often enough to be rejected."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(3))
        draft.lm_head.weight.add_(noise)
    return draft


def _draft_lacking_ids(target, missing: int = 5):
    """The noisy draft with a vocabulary `missing` ids short of the target's (a draft whose vocabulary is padded less
    than its target's, or that lacks tokens added to the target's): it is fed the prompt's ids 3 to 5, which it
    lacks, and drafts only the ids it has (those the target samples here)."""
    noisy = _noisy_draft(target)
    config = copy.deepcopy(noisy.config)
    config.vocab_size = VOCAB - missing
    draft = LlamaForCausalLM(config).eval()
    rows = ("model.embed_tokens.weight", "lm_head.weight")
    draft.load_state_dict({k: v[: VOCAB - missing] if k in rows else v for k, v in noisy.state_dict().items()})
    return draft


def _eagle_head(target, version: str) -> EagleHead:
    """A random head with damped outputs: its drafts are spread over many tokens, so the target accepts some and
    rejects others (EAGLE-1: small fc and a pass-through layer before the target's lm_head; EAGLE-3: a zero
    lm_head)."""
    torch.manual_seed(15)
    head = EagleHead(EagleConfig.for_target(target, version)).eval()
    with torch.no_grad():
        if version == "eagle":
            head.fc.weight.mul_(0.01)
            head.fc.bias.zero_()
            head.layers[0].self_attn.o_proj.weight.zero_()
            head.layers[0].mlp.down_proj.weight.zero_()
        else:
            head.lm_head.weight.zero_()  # uniform over the draft vocabulary before the warpers
    return head


def _with_token_map(heads, token_map=(0, 2, 3, 5, 6)):
    """`heads` drafting over five of the eight ids only (the target samples the other three too)."""
    heads.set_token_map(torch.tensor(token_map), vocab_size=VOCAB)
    return heads


def _shared_medusa(target):
    """Medusa heads on the target's lm_head, their blocks at zero: like `heads_for`'s, each guesses that the last
    token repeats."""
    return MedusaHeads(MedusaConfig(hidden_size=DECODER["hidden_size"], vocab_size=VOCAB, num_heads=2,
                                    shared_lm_head=True)).eval()


def _speculator(target, **options):
    """An MLP speculator fitted to the target's own sampled continuations: its sampled drafts are accepted often,
    at depth 2 too, and rejected often. `options`: `fitted_speculator`'s (e.g. the target's vocabulary)."""
    torch.manual_seed(0)
    prompts = PROMPT.expand(64, -1)
    sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=True,
                                temperature=TEMPERATURE, top_k=TOP_K)
    return fitted_speculator(target, sequences, n_predict=2, steps=30, **options)


PROPOSERS = {
    "plain_generate": lambda target: None,
    "noisy_draft": lambda target: SpeculativeConfig(method="draft", draft_model=_noisy_draft(target), num_speculative_tokens=3, seed=1),
    "same_draft": lambda target: SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3, seed=2),
    "ngram": lambda target: SpeculativeConfig(method="ngram", num_speculative_tokens=3, seed=3),
    # the mask token is the target's likeliest token here, so the noisy draft's guesses after it are often the
    # target's next tokens and drafts are accepted at depth 2 and 3 as well
    "noisy_draft_parallel": lambda target: SpeculativeConfig(method="draft", draft_model=_noisy_draft(target),
                                                             parallel_drafting=True, pard_token=2,
                                                             num_speculative_tokens=3, seed=30),
    "draft_lacking_ids": lambda target: SpeculativeConfig(method="draft", draft_model=_draft_lacking_ids(target),
                                                          num_speculative_tokens=3, seed=29),
    "noisy_draft_tree": lambda target: SpeculativeConfig(method="draft", draft_model=_noisy_draft(target),
                                                          num_speculative_tokens=2, tree_width=3, seed=5),
    "same_draft_tree": lambda target: SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target),
                                                        num_speculative_tokens=2, tree_width=2, seed=6),
    "ngram_tree": lambda target: SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=2, seed=7),
    # its size from the target's measured verify costs (hf_specdec.schedule.tree_size): 3 to 9 nodes
    "ngram_auto_tree": lambda target: SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=3,
                                                        tree_total_tokens="auto", seed=11),
    "medusa": lambda target: SpeculativeConfig(method="medusa", heads=heads_for(target), num_speculative_tokens=2,
                                               seed=9),
    "medusa_tree": lambda target: SpeculativeConfig(method="medusa", heads=heads_for(target), seed=10,
                                                    tree_paths=[(0,), (1,), (0, 0), (1, 0)]),
    "eagle": lambda target: SpeculativeConfig(method="eagle", heads=_eagle_head(target, "eagle"),
                                              num_speculative_tokens=2, seed=13),
    "eagle3": lambda target: SpeculativeConfig(method="eagle", heads=_eagle_head(target, "eagle3"),
                                               num_speculative_tokens=2, seed=15),
    "eagle_dynamic_tree": lambda target: SpeculativeConfig(method="eagle", heads=_eagle_head(target, "eagle"),
                                                           top_k=3, depth=2, total_tokens=4, seed=14),
    # each row's chain stops where the drafter's running confidence (its distributions' peaks) falls below 0.52: after
    # one token or after both, by the token drawn first (test_confidence_cut_depends_on_the_drawn_tokens)
    "noisy_draft_confidence": lambda target: SpeculativeConfig(method="draft", draft_model=_noisy_draft(target),
                                                               num_speculative_tokens=3, draft_confidence=0.52, seed=27),
    "noisy_draft_token_map": lambda target: SpeculativeConfig(
        method="draft", draft_model=_noisy_draft(target), draft_token_map=torch.tensor([0, 2, 3, 5, 6]),
        num_speculative_tokens=3, seed=25),
    "eagle_token_map": lambda target: SpeculativeConfig(
        method="eagle", heads=_with_token_map(_eagle_head(target, "eagle")), num_speculative_tokens=2, seed=22),
    "eagle_token_map_dynamic_tree": lambda target: SpeculativeConfig(
        method="eagle", heads=_with_token_map(_eagle_head(target, "eagle")), top_k=3, depth=2, total_tokens=4, seed=23),
    "medusa_token_map": lambda target: SpeculativeConfig(
        method="medusa", heads=_with_token_map(_shared_medusa(target)), num_speculative_tokens=2, seed=24),
    "mlp_speculator": lambda target: SpeculativeConfig(method="mlp_speculator", heads=_speculator(target),
                                                       num_speculative_tokens=2, seed=17),
    "mlp_speculator_dynamic_tree": lambda target: SpeculativeConfig(method="mlp_speculator", heads=_speculator(target),
                                                                    top_k=2, depth=2, total_tokens=4, seed=18),
    # embedding and scoring with the target's own matrices, drafting over five of the eight ids
    "mlp_speculator_shared_vocab": lambda target: SpeculativeConfig(
        method="mlp_speculator", num_speculative_tokens=2, seed=26,
        heads=_speculator(target, shared_vocab=True, token_map=torch.tensor([0, 2, 3, 5, 6]))),
    "early_exit": lambda target: SpeculativeConfig(method="early_exit", early_exit_layer=1, num_speculative_tokens=2,
                                                   seed=19),
    "early_exit_dynamic_tree": lambda target: SpeculativeConfig(method="early_exit", early_exit_layer=1, top_k=2,
                                                                depth=2, total_tokens=4, seed=20),
    "noisy_draft_dynamic_tree": lambda target: SpeculativeConfig(
        method="draft", draft_model=_noisy_draft(target), num_speculative_tokens=2, tree_width=2, tree_total_tokens=4, seed=8
    ),
    # its size from the target's measured verify costs (hf_specdec.schedule.tree_size): 2 to 6 nodes
    "noisy_draft_auto_tree": lambda target: SpeculativeConfig(
        method="draft", draft_model=_noisy_draft(target), num_speculative_tokens=2, tree_width=2,
        tree_total_tokens="auto", seed=9),
    # the repeating prompt gives suffix drafts; rows drawn side by side share the global tree, so its trees branch
    "suffix": lambda target: SpeculativeConfig(
        method="suffix", num_speculative_tokens=3, seed=16,
        suffix_cache=SuffixCache(SuffixConfig(max_spec_offset=2.0, min_token_prob=0.02))),
    # token recycling: a tree of the target's earlier top candidates, its table fed by every row of the batch
    "recycling": lambda target: SpeculativeConfig(method="recycling", num_speculative_tokens=3, tree_total_tokens=6,
                                                  seed=31),
    # suffix rows (deterministic nodes, one-hot draft distributions) and sampled draft-model rows in one proposal
    "suffix_hybrid": lambda target: SpeculativeConfig(
        method="suffix", num_speculative_tokens=3, suffix_cache=SuffixCache(), seed=17, fallback_min_score=1.0,
        fallback=SpeculativeConfig(method="draft", draft_model=_noisy_draft(target), num_speculative_tokens=2)),
}


# n-gram and suffix drafts rarely survive two sampled tokens; an EAGLE tree of an untrained head rarely holds the target's
# second token; the confidence cut keeps depth 2 only after the first tokens whose continuation the target rejects
# here: their depth-2 paths are covered by the greedy tests
SHALLOW = {"ngram", "ngram_tree", "ngram_auto_tree", "eagle_dynamic_tree", "eagle_token_map_dynamic_tree", "suffix",
           "noisy_draft_confidence"}


@pytest.mark.parametrize("name", sorted(PROPOSERS))
def test_sampling_matches_exact_target_law(target, name):
    law = exact_law(target, TEMPERATURE)
    assert all(int((marginal(law, pair) > 0).sum()) >= 6 for pair in MARGINALS)
    pvalues = chi_square_pvalues(draws(target, TEMPERATURE, PROPOSERS[name](target)), law)
    assert accepted(pvalues), f"{name}: p = {pvalues}"


def _no_successor(batch_id: int, prefix: torch.Tensor) -> list[int]:
    """A `prefix_allowed_tokens_fn`: every token but the one after the last (mod the vocabulary)."""
    return [t for t in range(VOCAB) if t != (int(prefix[-1]) + 1) % VOCAB]


# processors that read the prefix, so each verified position must see its own path: a repetition penalty and a
# prefix constraint, as generate options and as the processors the exact law applies
PREFIX_OPTIONS = dict(repetition_penalty=1.5, prefix_allowed_tokens_fn=_no_successor)
PREFIX_PROCESSORS = (RepetitionPenaltyLogitsProcessor(1.5), PrefixConstrainedLogitsProcessor(_no_successor, 1))


@pytest.mark.parametrize("name", ["noisy_draft", "noisy_draft_dynamic_tree"])
def test_sampling_with_prefix_processors_matches_exact_target_law(target, name):
    """Drafters apply only the processors that read no prefix, so their drafts come from another law than the
    processed target's; the verifier still keeps the processed target's law exactly. The processors change the
    law enough to be seen (power against the law without them)."""
    law = exact_law(target, TEMPERATURE, PREFIX_PROCESSORS)
    assert _power(law, exact_law(target, TEMPERATURE)) > 0.99
    config = PROPOSERS[name](target)
    prompts = PROMPT.expand(300, -1)
    spec = hf_specdec.generate(target, prompts, attention_mask=torch.ones_like(prompts), speculative=config,
                               max_new_tokens=NEW_TOKENS, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                               return_dict_in_generate=True, **PREFIX_OPTIONS).spec_stats
    assert 0 < spec.accepted_per_position[1] and spec.num_accepted_tokens < spec.num_draft_tokens, spec
    pvalues = chi_square_pvalues(draws(target, TEMPERATURE, PROPOSERS[name](target), **PREFIX_OPTIONS), law)
    assert accepted(pvalues), f"{name}: p = {pvalues}"


def test_every_proposer_drafts_and_is_both_accepted_and_rejected(target):
    """The law test exercises the verifier: each proposer drafts in the second step, at depth 2 too, and its
    drafts are accepted in some rows and rejected in others."""
    prompts = PROMPT.expand(300, -1)
    for name, make in sorted(PROPOSERS.items()):
        config = make(target)
        if config is None:
            continue
        out = hf_specdec.generate(target, prompts, attention_mask=torch.ones_like(prompts), speculative=config,
                                  max_new_tokens=NEW_TOKENS, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  return_dict_in_generate=True)
        spec = out.spec_stats
        assert spec.num_draft_tokens > 100, name
        assert 0 < spec.num_accepted_tokens, name
        assert spec.num_accepted_tokens < spec.num_draft_tokens or name.startswith("same_draft"), name
        if name not in SHALLOW:
            assert spec.accepted_per_position[1] > 0, f"{name}: {spec.accepted_per_position}"


def test_confidence_cut_depends_on_the_drawn_tokens(target, monkeypatch):
    """In the draft_confidence case above, rows of the same step stop after one drafted token or after both, by
    the first token they drew, so the law test covers a stop chosen from the sampled draft's own distributions."""
    from hf_specdec.proposers import confidence

    kept = []
    observe = confidence.ConfidenceCut.observe

    def spy(self, position, peaks):
        observe(self, position, peaks)
        kept.append((position, list(self.limits), list(self.kept)))

    monkeypatch.setattr(confidence.ConfidenceCut, "observe", spy)
    prompts = PROMPT.expand(300, -1)
    hf_specdec.generate(target, prompts, attention_mask=torch.ones_like(prompts),
                        speculative=PROPOSERS["noisy_draft_confidence"](target), max_new_tokens=NEW_TOKENS,
                        do_sample=True, temperature=TEMPERATURE, top_k=TOP_K)
    first_step = [(limit, k) for position, limits, rows in kept[:2] if position == 1
                  for limit, k in zip(limits, rows)]
    assert first_step and all(limit == 2 for limit, _ in first_step)
    assert {k for _, k in first_step} == {1, 2}


def _power(law: torch.Tensor, wrong: torch.Tensor) -> float:
    """Probability that the marginal tests reject draws from `wrong` (the larger of the two marginals' powers)."""
    powers = []
    for pair in MARGINALS:
        cell_law, cell_wrong = marginal(law, pair), marginal(wrong, pair)
        bins = _cells(cell_law)
        pooled_law, pooled_wrong = _pool(cell_law, bins), _pool(cell_wrong, bins)
        size = len(pooled_law)
        noncentrality = N * float(((pooled_wrong - pooled_law) ** 2 / pooled_law).sum())
        critical = stats.chi2.ppf(1 - ALPHA / len(MARGINALS), size - 1)
        powers.append(1 - stats.ncx2.cdf(critical, size - 1, noncentrality))
    return max(powers)


def test_power_temperature_off_by_a_tenth_is_caught(target):
    """The test above would fail an engine whose temperature were 0.1 off."""
    law = exact_law(target, TEMPERATURE)
    power = _power(law, exact_law(target, TEMPERATURE + 0.1))
    assert power > 0.99, f"power {power:.4f}"
    biased = SpeculativeConfig(method="ngram", num_speculative_tokens=3, seed=4)
    assert not accepted(chi_square_pvalues(draws(target, TEMPERATURE + 0.1, biased), law))


def test_power_verifier_without_residual_is_caught(target, monkeypatch):
    """A verifier that draws the token after a rejection from the target itself instead of the residual
    max(0, target - draft) is biased (the rejected token comes back too often); the law test catches it."""

    def without_residual(draft_token_ids, num_draft_tokens, draft_probs, target_probs, generator):
        result = rejection_sample(draft_token_ids, num_draft_tokens, draft_probs, target_probs, generator)
        rejected = result.num_accepted < num_draft_tokens
        at = result.num_accepted[:, None, None].expand(-1, 1, target_probs.shape[2])
        fresh = torch.multinomial(target_probs.gather(1, at).squeeze(1), 1, generator=generator).squeeze(1)
        tokens = result.output_token_ids.clone()
        rows = torch.arange(tokens.shape[0])
        tokens[rows, result.num_accepted] = torch.where(rejected, fresh, tokens[rows, result.num_accepted])
        return type(result).chain(tokens, result.num_accepted)

    monkeypatch.setattr(verifier, "rejection_sample", without_residual)
    law = exact_law(target, TEMPERATURE)
    config = SpeculativeConfig(method="draft", draft_model=_noisy_draft(target), num_speculative_tokens=3, seed=1)
    assert not accepted(chi_square_pvalues(draws(target, TEMPERATURE, config), law))


def test_power_speculator_drafts_drawn_from_another_law_are_caught(target, monkeypatch):
    """The MLP speculator's sampled chain must draw its drafts from the law it hands verification: drafts drawn
    from a flattened law (the square root of it) but verified against the stated one come out biased, and the law
    test catches it."""
    from hf_specdec.proposers import mlp_speculator
    from hf_specdec.sampling import draft_distribution, sample

    def flattened(scores, do_sample, warpers, generator):
        probs = draft_distribution(scores, warpers, generator)
        return sample(probs.sqrt(), generator), probs

    monkeypatch.setattr(mlp_speculator, "draw_draft", flattened)
    law = exact_law(target, TEMPERATURE)
    config = SpeculativeConfig(method="mlp_speculator", heads=_speculator(target), num_speculative_tokens=2, seed=17)
    assert not accepted(chi_square_pvalues(draws(target, TEMPERATURE, config), law))


def assert_exact_law_with_drafts(model, speculative: SpeculativeConfig, deep: bool = True) -> None:
    """For a proposer tested outside this file: it drafts in the second step, its drafts are accepted in some rows
    and rejected in others (at depth 2 too, with `deep`), and its draws follow the exact law."""
    prompts = PROMPT.expand(300, -1)
    spec = hf_specdec.generate(model, prompts, attention_mask=torch.ones_like(prompts), speculative=speculative,
                               max_new_tokens=NEW_TOKENS, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                               return_dict_in_generate=True).spec_stats
    assert spec.num_draft_tokens > 100
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    if deep:
        assert spec.accepted_per_position[1] > 0, spec.accepted_per_position
    pvalues = chi_square_pvalues(draws(model, TEMPERATURE, speculative), exact_law(model, TEMPERATURE))
    assert accepted(pvalues), pvalues


@pytest.mark.parametrize("warper", [dict(top_p=0.8), dict(min_p=0.2), dict(typical_p=0.7), dict(top_h=0.4),
                                    dict(epsilon_cutoff=0.02), dict(eta_cutoff=0.02)])
def test_a_copy_of_the_target_drafts_under_each_score_only_warper(warper):
    """A draft model warps its own scores with the user's score-only warpers (`hf_specdec.sampling.prefix_free`),
    so a copy of the target drafts from the target's own law and every draft is accepted."""
    target = make_model("llama")
    ids, mask = padded_batch([7, 5, 9], seed=3)
    config = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3,
                               schedule="fixed")
    torch.manual_seed(0)
    out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=16,
                              do_sample=True, temperature=1.5, eos_token_id=None, return_dict_in_generate=True,
                              **warper)
    stats = out.spec_stats
    assert stats.num_draft_tokens > 20
    assert stats.num_accepted_tokens == stats.num_draft_tokens, warper
