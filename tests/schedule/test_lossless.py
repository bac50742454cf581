"""The adaptive schedule changes how many tokens rows draft, never what they emit: greedy output equals plain
`generate` and sampling follows the target's law, with steps where rows draft different k and steps where every
row decodes plainly (checked: the statistics must show them)."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.proposers.draft_model import DraftModelProposer
from hf_specdec.proposers.ngram import NgramProposer
from hf_specdec.schedule import controller, estimates
from hf_specdec.schedule.decision import Decision
from tests.conftest import make_draft, make_model, padded_batch
from tests.decoding import test_sampling_lossless as lossless
from tests.heads.medusa.test_model import heads_for


@pytest.fixture
def mixed_priors(monkeypatch):
    """Rows start from different acceptance estimates (row b: 0, 0.3, 0.95 for b % 3 = 0, 1, 2): from the first
    step, some rows draft k, some fewer, some none, so the steps mix limits."""
    make = estimates.AcceptanceEstimate.__init__

    def init(self, batch_size, max_k, prior=None, **kwargs):  # draft classes' estimates (n-gram) mix likewise
        make(self, batch_size, max_k, prior, **kwargs)
        priors = np.array([0.0, 0.3, 0.95])[np.arange(batch_size) % 3]
        self.values = priors[:, None] * np.ones((1, max_k))
        self.raw = self.values.copy()

    monkeypatch.setattr(estimates.AcceptanceEstimate, "__init__", init)


def _configs(target):
    return {
        "draft": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=4),
        "random_draft_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3,
                                               tree_width=2),
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4),
        "ngram_tree": SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=2),
        "recycling": SpeculativeConfig(method="recycling", num_speculative_tokens=3, tree_total_tokens=6),
        "medusa_tree": SpeculativeConfig(method="medusa", heads=heads_for(target),
                                         tree_paths=[(0,), (1,), (0, 0), (1, 0)]),
        "auto": SpeculativeConfig(method="auto", draft_model=copy.deepcopy(target), num_speculative_tokens=3),
    }


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_adaptive_greedy_matches_plain_generate(arch, static, mixed_priors):
    target = make_model(arch)
    ids, mask = padded_batch([12, 7, 10, 9, 5, 11], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    extra = {"cache_implementation": "static"} if static else {}
    for name, config in _configs(target).items():
        if static and name == "auto":
            continue  # auto with a draft model needs dynamic shapes
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs, **extra)
        assert torch.equal(out.sequences, expected), f"{arch}/{name}"
        schedule = out.spec_stats.schedule
        assert schedule.schedule == "adaptive"
        histogram = schedule.k_histogram
        assert sum(histogram[1:]) > 0, (name, histogram)  # drafting row-steps
        if name == "auto":  # rows the draft model's estimates leave plain draft with n-gram lookup's matches
            assert sum(steps > 0 for steps in schedule.method_steps.values()) >= 2, schedule.method_steps
        else:  # and plain ones
            assert histogram[0] > 0, (name, histogram)
        if name in ("draft", "auto"):  # copies of the target: accepted wherever drafted
            assert out.spec_stats.num_accepted_tokens > 0, name


def test_fixed_schedule_reproduces_the_fixed_statistics():
    """`schedule="fixed"` is today's engine: no schedule statistics, the same counts whatever the estimates."""
    target = make_model("llama")
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    config = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=4,
                               schedule="fixed")
    stats = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs).spec_stats
    assert stats.schedule is None
    assert stats.target_forward_passes == 1 + -(-23 // 5) and stats.acceptance_rate == 1.0


# each step's width in turn (0: a plain step); rows 1, 4, ... draft one fewer
WIDTH_CYCLE = (3, 0, 1, 2, 0, 0, 3, 1, 2)


@pytest.fixture
def cycled_widths(monkeypatch):
    """The schedule's decision forced through WIDTH_CYCLE: every width from none to k, and plain steps in a row."""
    steps = itertools.count()

    def forced(acceptance, step_time, active, probe, widths, probe_length, draft_rate=None, probe_alone=True,
               estimate_widths=None, critical=None):
        width = WIDTH_CYCLE[next(steps) % len(WIDTH_CYCLE)]
        rows = np.arange(len(active))
        limits = np.where(np.asarray(active, dtype=bool), np.where(rows % 3 == 1, max(width - 1, 0), width), 0)
        return Decision(int(limits.max()), tuple(int(x) for x in limits), 1.0, 1.0)

    monkeypatch.setattr(controller, "decide", forced)


@pytest.fixture
def region_moves_checked(monkeypatch):
    """Every ragged-cache commit moves region slots only: a move reading past the region reads what no forward
    wrote, and past the buffer's end raises (where the region ends at the buffer's capacity)."""
    commit = RaggedKVCache.commit

    def checked(self, num_kept, sources=None, kept_on_host=None):
        if sources is not None:
            assert sources.shape[1] <= self.region and int(sources.max()) < self.region, (sources, self.region)
        commit(self, num_kept, sources, kept_on_host)

    monkeypatch.setattr(RaggedKVCache, "commit", checked)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_dynamic_trees_on_varying_widths_match_plain_generate(arch, static, cycled_widths, region_moves_checked):
    """The draft model's and early exit's EAGLE-2 dynamic trees drafted at every width below k and skipped on plain
    steps: their draft caches stay in step with the text (a copy of the target drafts, so deep paths are kept). A
    tree of fewer nodes than its depth (`small_tree`) and n-gram lookup's tries, whose nodes shrink with the step's
    width, verify no path longer than their nodes (`region_moves_checked`); a sized trie keeps ceil(n * d / k)
    nodes, as a dynamic tree does."""
    target = make_model(arch)
    ids, mask = padded_batch([12, 7, 10, 9, 5, 11], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    extra = {"cache_implementation": "static"} if static else {}
    tree = dict(top_k=2, depth=3, total_tokens=5)
    configs = {
        "same_draft": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), **tree),
        "random_draft": SpeculativeConfig(method="draft", draft_model=make_draft(), **tree),
        "early_exit": SpeculativeConfig(method="early_exit", early_exit_layer=1, **tree),
        "small_tree": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), top_k=2, depth=3,
                                        total_tokens=2),
        "ngram_trie": SpeculativeConfig(method="ngram", tree_width=2, num_speculative_tokens=3),
        "ngram_sized_trie": SpeculativeConfig(method="ngram", tree_width=2, num_speculative_tokens=3,
                                              tree_total_tokens=4),
    }
    nodes_by_depth = set()
    propose, propose_trie = DraftModelProposer.propose, NgramProposer._propose_tree

    def recording(self, state):  # (the step's width, draft nodes) of each dynamic tree
        width = state.step_width(self.k) if self.fixed_shapes else min(self.k, max(state.host_draft_budget()))
        proposal = propose(self, state)
        if self.total_tokens is not None:
            nodes_by_depth.add((width, proposal.tree.num_nodes - 1))
        return proposal

    def recording_trie(self, state, budget):  # (the step's width, the trie's draft nodes) of a sized trie
        proposal = propose_trie(self, state, budget)
        if self.total is not None and proposal.tree.num_nodes > 1:  # not a step without matches
            nodes_by_depth.add((state.step_width(self.k), proposal.tree.num_nodes - 1))
        return proposal

    for name, config in configs.items():
        nodes_by_depth.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DraftModelProposer, "propose", recording)
            patch.setattr(NgramProposer, "_propose_tree", recording_trie)
            out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs,
                                      **extra)
        assert torch.equal(out.sequences, expected), f"{arch}/{name}"
        histogram = out.spec_stats.schedule.k_histogram
        assert all(histogram), (name, histogram)  # row-steps of every width, 0 included
        if name == "ngram_trie":
            continue
        # a step narrowed to d of k = 3 levels keeps ceil(n * d / 3) of n nodes (at most the d levels' candidates; a
        # trie's: its 2 continuations of d tokens)
        total = config.tree_total_tokens
        most = (lambda d: 2 * d) if name == "ngram_sized_trie" else (lambda d: 2 + (d - 1) * 4)
        expected_nodes = {(d, min(-(-total * d // 3), most(d))) for d in (1, 2, 3)}
        assert nodes_by_depth == expected_nodes, (name, nodes_by_depth)
        if name == "same_draft":  # paths through fed nodes accepted (the draft cache keeps them)
            assert out.spec_stats.accepted_per_position[1] > 0, name



@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_mlp_speculator_trees_shrink_with_the_steps_width(static, cycled_widths, region_moves_checked):
    """The MLP speculator's dynamic tree drafted at every width below k keeps ceil(n * d / k) nodes at d stages (as
    the draft model's does), and greedy output stays plain generate's."""
    from hf_specdec.proposers.mlp_speculator import MlpSpeculatorProposer
    from tests.proposers.test_mlp_speculator import fitted_speculator

    target = make_model("llama")
    ids, mask = padded_batch([12, 7, 10, 9, 5, 11], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    extra = {"cache_implementation": "static"} if static else {}
    config = SpeculativeConfig(method="mlp_speculator", heads=fitted_speculator(target, expected), top_k=2, depth=3,
                               total_tokens=5)
    nodes_by_depth = set()
    dynamic_tree = MlpSpeculatorProposer._dynamic_tree

    def recording(self, state, budget, current):
        proposal = dynamic_tree(self, state, budget, current)
        nodes_by_depth.add((state.step_width(self.k), proposal.tree.num_nodes - 1))
        return proposal

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MlpSpeculatorProposer, "_dynamic_tree", recording)
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs, **extra)
    assert torch.equal(out.sequences, expected)
    assert all(out.spec_stats.schedule.k_histogram), out.spec_stats.schedule.k_histogram
    assert nodes_by_depth == {(d, min(-(-5 * d // 3), 2 + (d - 1) * 4)) for d in (1, 2, 3)}, nodes_by_depth
    assert out.spec_stats.num_accepted_tokens > 0


ADAPTIVE_PROPOSERS = ("noisy_draft", "ngram", "medusa_tree", "eagle")


@pytest.mark.parametrize("name", ADAPTIVE_PROPOSERS)
def test_adaptive_sampling_matches_exact_target_law(name, mixed_priors):
    """The chi-square test of tests/decoding/test_sampling_lossless.py with rows drafting 0, some or all of k in
    the step that shapes the tested tokens; its power is checked there, and drafts are checked here."""
    target = lossless.make_target()
    law = lossless.exact_law(target, lossless.TEMPERATURE)
    config = lossless.PROPOSERS[name](target)
    prompts = lossless.PROMPT.expand(lossless.N, -1)
    out = hf_specdec.generate(target, prompts, attention_mask=torch.ones_like(prompts), speculative=config,
                              max_new_tokens=lossless.NEW_TOKENS, do_sample=True, temperature=lossless.TEMPERATURE,
                              top_k=lossless.TOP_K, top_p=1.0, return_dict_in_generate=True)
    histogram = out.spec_stats.schedule.k_histogram
    assert histogram[0] > 1000 and sum(histogram[1:]) > 1000, histogram
    assert out.spec_stats.num_accepted_tokens > 0
    samples = out.sequences[:, lossless.PROMPT.shape[1]:]
    pvalues = lossless.chi_square_pvalues(samples, law)
    assert lossless.accepted(pvalues), f"{name}: p = {pvalues}"
