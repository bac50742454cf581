"""`method="auto"`: its candidates, the heads it takes, and exactness whichever candidate drafts each step (the
schedule's choice forced in turn through every candidate, with rows drafting different k)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import hf_specdec
import hf_specdec.proposers.auto as auto
from hf_specdec import SpeculativeConfig
from hf_specdec.proposers.auto import AutoProposer
from hf_specdec.proposers.base import DraftSampling
from hf_specdec.proposers.draft_model import DraftModelProposer
from hf_specdec.schedule import controller, estimates
from hf_specdec.suffix import SuffixCache, SuffixConfig
from tests.conftest import VOCAB, make_model, padded_batch
from tests.decoding import test_sampling_lossless as lossless
from tests.heads.medusa.test_model import heads_for
from tests.proposers.test_eagle import eagle_head, trained_head
from tests.proposers.test_mlp_speculator import fitted_speculator
from tests.schedule.test_lossless import cycled_widths, region_moves_checked  # noqa: F401 (fixtures)

SAMPLING = DraftSampling(do_sample=False, warpers=None, generator=None)


@pytest.fixture
def mixed_priors(monkeypatch):
    """Estimates start mixed: row b of a per-row estimate (the model drafters') at 0.3, 0.95, 0.6 for b % 3 = 0,
    1, 2, and draft class c (n-gram lookup's, suffix decoding's) at the same for c % 3: from the first step rows
    draft k, fewer or none, and no class is switched off for good (classes are not probed)."""
    make = estimates.AcceptanceEstimate.__init__

    def init(self, batch_size, max_k, prior=None, **kwargs):
        make(self, batch_size, max_k, prior, **kwargs)
        self.values = np.array([0.3, 0.95, 0.6])[np.arange(batch_size) % 3][:, None] * np.ones((1, max_k))
        self.raw = self.values.copy()

    monkeypatch.setattr(estimates.AcceptanceEstimate, "__init__", init)


@pytest.fixture
def candidates_in_turn(monkeypatch):
    """The schedule weighs one candidate for two steps, each in turn (the order of `AUTO_CANDIDATES`), so every
    candidate drafts and skips steps in every order (and, with `cycled_widths`, whose cycle of 9 a turn of 6 steps
    does not divide, at every width); the rows' limits still come from the decision rule. Setting the fixture's
    `only` to a candidate weighs that one alone."""
    steps = itertools.count()
    weigh = controller.Schedule._weigh
    forced = SimpleNamespace(only=None)

    def in_turn(self, times, *args):
        methods = list(times)
        method = forced.only or methods[next(steps) // 2 % len(methods)]
        return weigh(self, {method: times[method]}, *args)

    monkeypatch.setattr(controller.Schedule, "_weigh", in_turn)
    return forced


@pytest.fixture
def rows_in_turn(monkeypatch):
    """The schedule's decision (limits from the decision rule over the first candidate's estimates), with row b
    drafting at step s with candidate (b + s) % C (the order of `AUTO_CANDIDATES`): from the first step, rows of one
    step draft with every candidate, and each row with each in turn. `merged` counts the steps whose rows drafted
    with more than one candidate."""
    steps = itertools.count()
    weigh = controller.Schedule._weigh
    merge = auto.merge_trees
    forced = SimpleNamespace(merged=0)

    def per_row(self, times, *args):
        names = list(times)
        _, decision, accepted, _ = weigh(self, {names[0]: times[names[0]]}, *args)
        step = next(steps)
        row_methods = np.asarray([names[(b + step) % len(names)] for b in range(len(decision.limits))], dtype=object)
        return names[step % len(names)], decision, accepted, row_methods

    def counted(trees, choice):
        forced.merged += 1
        return merge(trees, choice)

    monkeypatch.setattr(controller.Schedule, "_weigh", per_row)
    monkeypatch.setattr(auto, "merge_trees", counted)
    return forced


def test_candidates_follow_what_the_config_gives():
    target = make_model("llama")
    head = eagle_head(target)
    for heads, expected in ((None, ["ngram", "suffix"]), (head, ["ngram", "eagle", "suffix"]),
                            (heads_for(target), ["ngram", "medusa", "suffix"])):
        proposer = AutoProposer(SpeculativeConfig(method="auto", heads=heads), target, SAMPLING)
        assert list(proposer.methods) == expected
    # the suffix candidate takes the auto config's suffix settings; the others take none
    cache = SuffixCache(SuffixConfig(max_depth=12))
    proposer = AutoProposer(SpeculativeConfig(method="auto", heads=head, suffix_cache=cache), target, SAMPLING)
    assert proposer.configs["suffix"].suffix_cache is cache and proposer.candidates["suffix"].cache is cache
    assert proposer.configs["eagle"].suffix_cache is None and proposer.configs["eagle"].heads is head
    # a dynamic tree is the model drafter's; the lookups draft chains
    config = SpeculativeConfig(method="auto", heads=head, tree_width=2, tree_total_tokens=4)
    proposer = AutoProposer(config, target, SAMPLING)
    assert (proposer.configs["eagle"].tree_width, proposer.configs["eagle"].tree_total_tokens) == (2, 4)
    assert all((proposer.configs[m].tree_width, proposer.configs[m].tree_total_tokens) == (1, None)
               for m in ("ngram", "suffix"))
    proposer = AutoProposer(SpeculativeConfig(method="auto", heads=head, tree_width=2), target, SAMPLING)
    assert proposer.configs["ngram"].tree_width == 2  # without one, n-gram lookup offers a trie
    # auto_methods chooses the candidates (in the order of AUTO_CANDIDATES); token recycling only when listed
    for methods, heads, expected in ((["recycling"], None, ["recycling"]),
                                     (["recycling", "eagle", "ngram"], head, ["ngram", "eagle", "recycling"]),
                                     (["suffix", "medusa"], heads_for(target), ["medusa", "suffix"])):
        config = SpeculativeConfig(method="auto", heads=heads, auto_methods=methods)
        proposer = AutoProposer(config, target, SAMPLING)
        assert list(proposer.methods) == expected
        assert proposer.reads_target_scores == ("recycling" in methods)
        assert config.drafting_methods == ("auto", *(m for m in methods if m not in ("ngram", "suffix")))
    default = SpeculativeConfig(method="auto", heads=head)
    assert default.auto_methods is None and default.auto_candidates == ("ngram", "suffix", "eagle")
    # the default follows the drafters of a copy
    assert dataclasses.replace(default, heads=None).auto_candidates == ("ngram", "suffix")
    assert SpeculativeConfig(method="ngram").auto_candidates == ()
    assert proposer.configs["medusa"].auto_methods is None


def test_auto_methods_are_checked_against_the_drafters_given():
    target = make_model("llama")
    head = eagle_head(target)
    for kwargs, message in (
        (dict(auto_methods="ngram"), r"auto_methods: expected a list of method names from \['ngram', 'suffix', "
                                     r"'recycling'.*got 'ngram'"),
        (dict(auto_methods=[]), r"auto_methods: none given in \[\]"),
        (dict(auto_methods=["ngram", "ngram"]), r"auto_methods: a method given twice in \['ngram', 'ngram'\]"),
        (dict(auto_methods=["ngram", "lookahead"]), r"auto_methods: unknown \['lookahead'\]"),
        (dict(auto_methods=["ngram", "eagle"]), r"auto_methods: 'eagle' drafts with heads "
                                                r"\(hf_specdec.heads.EagleHead\), which this config does not have; "
                                                r"pass them or drop 'eagle'"),
        (dict(auto_methods=["ngram", "draft"], heads=head), r"auto_methods: 'draft' drafts with draft_model"),
        (dict(auto_methods=["ngram"], heads=head), r"auto_methods: leaves out 'eagle', whose heads .* this config is "
                                                   r"given; add 'eagle' or drop the heads"),
        (dict(auto_methods=["ngram", "recycling"], suffix_cache=SuffixCache()),
         r"suffix_cache: a suffix decoding setting, and auto_methods \['ngram', 'recycling'\] leaves out 'suffix'"),
    ):
        with pytest.raises(ValueError, match=r"SpeculativeConfig\." + message):
            SpeculativeConfig(method="auto", **kwargs)
    with pytest.raises(ValueError, match=r"SpeculativeConfig.auto_methods: the candidates of method='auto'; got "
                                         r"method='ngram'"):
        SpeculativeConfig(method="ngram", auto_methods=["ngram"])


def test_auto_refuses_what_is_not_a_drafter():
    target = make_model("llama")
    with pytest.raises(ValueError, match=r"SpeculativeConfig.heads: method='auto' takes optional heads \(MedusaHeads, "
                                         r"an EagleHead or an MlpSpeculator\).*got .*Llama"):
        SpeculativeConfig(method="auto", heads=target)
    for heads, named in ((None, "none"), (heads_for(target), "Medusa heads")):
        with pytest.raises(ValueError, match=r"SpeculativeConfig.tree_total_tokens: method='auto' builds the dynamic "
                                             rf"tree with its model drafter .* this config has {named}; drop"):
            SpeculativeConfig(method="auto", heads=heads, tree_width=2, tree_total_tokens=4)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # architectures an EAGLE head is built for
def test_every_candidate_in_turn_matches_plain_generate(arch, static, candidates_in_turn, cycled_widths):  # noqa: F811
    """n-gram lookup, an EAGLE head (trained on the expected output, so its drafts are often accepted) and suffix
    decoding draft in turn on a left-padded batch whose rows draft 0, some or all of k, with plain steps between:
    the output is plain generate's, and each candidate drafted and had drafts accepted."""
    target = make_model(arch)
    ids, mask = padded_batch([12, 7, 10, 9, 5, 11], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    head = trained_head(target, "eagle", expected)
    config = SpeculativeConfig(method="auto", heads=head, num_speculative_tokens=3, suffix_cache=SuffixCache())
    extra = {"cache_implementation": "static"} if static else {}
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs, **extra)
    assert torch.equal(out.sequences, expected), arch
    steps = out.spec_stats.schedule.method_steps
    assert set(steps) == {"ngram", "eagle", "suffix"} and min(steps.values()) > 0, steps
    assert out.spec_stats.num_accepted_tokens > 0


def test_auto_with_an_mlp_speculator_matches_plain_generate(candidates_in_turn, cycled_widths):  # noqa: F811
    target = make_model("llama")
    ids, mask = padded_batch([12, 7, 10, 9], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    config = SpeculativeConfig(method="auto", heads=fitted_speculator(target, expected, n_predict=3, steps=30),
                               num_speculative_tokens=3, suffix_cache=SuffixCache())
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.schedule.method_steps["mlp_speculator"] > 0


def _drafter_configs(target, expected):
    head = trained_head(target, "eagle", expected)
    return {
        "eagle_chain": dict(heads=head),
        "eagle_tree": dict(heads=head, tree_width=2),
        "eagle_dynamic_tree": dict(heads=head, tree_width=2, tree_total_tokens=4),
        "draft": dict(draft_model=copy.deepcopy(target)),
        "draft_dynamic_tree": dict(draft_model=copy.deepcopy(target), tree_width=2, tree_total_tokens=4),
        "draft_parallel": dict(draft_model=copy.deepcopy(target), parallel_drafting=True, pard_token=VOCAB - 1),
        "medusa": dict(heads=heads_for(target)),
        "mlp_speculator": dict(heads=fitted_speculator(target, expected, n_predict=3, steps=30)),
    }


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_rows_drafting_with_different_candidates_in_one_step_match_plain_generate(
        arch, static, rows_in_turn, cycled_widths, region_moves_checked):  # noqa: F811
    """Every model drafter auto takes (an EAGLE head's chain, its top-2 tree (n-gram lookup's a trie) and its dynamic
    tree (n-gram lookup's a chain), a draft model's chain, dynamic tree and parallel drafts (PARD), Medusa heads, an
    MLP speculator), with
    n-gram lookup and suffix decoding, on a left-padded batch: in each step the rows draft with
    different candidates (their trees merged into one proposal; chains with trees), each row 0, some or all of k,
    with plain steps between. The output is plain generate's, the steps did mix candidates, and each candidate
    drafted."""
    target = make_model(arch)
    ids, mask = padded_batch([12, 7, 10, 9, 5, 11], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    extra = {"cache_implementation": "static"} if static else {}
    for name, drafter in _drafter_configs(target, expected).items():
        if static and name.startswith("draft"):
            continue  # auto with a draft model needs dynamic shapes
        rows_in_turn.merged = 0
        config = SpeculativeConfig(method="auto", num_speculative_tokens=3, suffix_cache=SuffixCache(), **drafter)
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs, **extra)
        assert torch.equal(out.sequences, expected), name
        steps = out.spec_stats.schedule.method_steps
        assert len(steps) == 3 and min(steps.values()) > 0, (name, steps)
        assert rows_in_turn.merged > 0, name
        assert out.spec_stats.num_accepted_tokens > 0, name


@pytest.mark.parametrize("drafter", ["eagle", "parallel_draft"])
def test_rows_drafting_with_different_candidates_sample_the_exact_target_law(drafter, rows_in_turn, monkeypatch,
                                                                             cycled_widths):  # noqa: F811
    """The chi-square test of tests/decoding/test_sampling_lossless.py over one call whose steps mix candidates
    across rows: the model drafter's sampled chains (an EAGLE head's, or a parallel draft's from one forward over
    mask tokens; with their draft distributions) next to n-gram lookup's and suffix decoding's deterministic drafts
    in one proposal, rows drafting 0 to k. The suffix cache first reads a call's outputs of the same prompts, so the
    suffix rows have drafts (each candidate's drafts are counted)."""
    target = lossless.make_target()
    law = lossless.exact_law(target, lossless.TEMPERATURE)
    model_drafter = (dict(heads=lossless._eagle_head(target, "eagle")) if drafter == "eagle" else
                     dict(draft_model=lossless._noisy_draft(target), parallel_drafting=True, pard_token=2))
    parallel, propose_parallel = [], DraftModelProposer._propose_parallel
    monkeypatch.setattr(DraftModelProposer, "_propose_parallel",
                        lambda self, *args: parallel.append(1) or propose_parallel(self, *args))
    config = SpeculativeConfig(method="auto", **model_drafter, num_speculative_tokens=3,
                               seed=29, suffix_cache=SuffixCache(SuffixConfig(max_spec_offset=2.0,
                                                                              min_token_prob=0.02)))
    prompts = lossless.PROMPT.expand(lossless.N, -1)
    kwargs = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=lossless.NEW_TOKENS, do_sample=True,
                  top_p=1.0, temperature=lossless.TEMPERATURE, top_k=lossless.TOP_K, return_dict_in_generate=True)
    hf_specdec.generate(target, prompts[:500], speculative=dataclasses.replace(config, seed=31),
                        **{**kwargs, "attention_mask": kwargs["attention_mask"][:500]})
    drafted = {}
    merge = auto.merge_trees

    def counted(trees, choice):  # each candidate's real draft nodes in the steps that mixed candidates
        for tree, index in zip(trees, range(len(trees))):
            kind = "sampled" if tree.draft_probs is not None else "deterministic"
            drafted[kind] = drafted.get(kind, 0) + int(tree.valid[choice == index][:, 1:].sum())
        return merge(trees, choice)

    auto.merge_trees = counted
    try:
        out = hf_specdec.generate(target, prompts, speculative=config, **kwargs)
    finally:
        auto.merge_trees = merge
    assert min(drafted.values()) > 1000, drafted
    assert (len(parallel) > 0) == (drafter == "parallel_draft")
    spec = out.spec_stats
    assert min(spec.schedule.method_steps.values()) > 1000, spec.schedule.method_steps
    assert rows_in_turn.merged > 0
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    pvalues = lossless.chi_square_pvalues(out.sequences[:, lossless.PROMPT.shape[1]:], law)
    assert lossless.accepted(pvalues), f"p = {pvalues}"


@pytest.mark.parametrize("tree", [{}, dict(tree_width=2, tree_total_tokens=3)], ids=["chain", "dynamic_tree"])
def test_auto_with_an_eagle_head_samples_the_exact_target_law(tree, candidates_in_turn, mixed_priors):
    """The chi-square test of tests/decoding/test_sampling_lossless.py (its power is checked there) over the draws
    of three calls, one per candidate (n-gram lookup, the EAGLE head (its sampled chain, or its dynamic tree of
    deterministic candidates), suffix decoding: the call's few steps are weighed with that candidate alone), each
    step's rows drafting 0, some or all of k; each candidate's drafts are checked to happen and to be both accepted
    and rejected. An exact law per call makes the pooled draws exact."""
    target = lossless.make_target()
    law = lossless.exact_law(target, lossless.TEMPERATURE)
    config = SpeculativeConfig(method="auto", heads=lossless._eagle_head(target, "eagle"), num_speculative_tokens=2,
                               seed=23, suffix_cache=SuffixCache(SuffixConfig(max_spec_offset=2.0,
                                                                              min_token_prob=0.02)), **tree)
    prompts = lossless.PROMPT.expand(lossless.N // 3, -1)
    samples = []
    for method in ("ngram", "eagle", "suffix"):
        candidates_in_turn.only = method
        out = hf_specdec.generate(target, prompts, attention_mask=torch.ones_like(prompts), speculative=config,
                                  max_new_tokens=lossless.NEW_TOKENS, do_sample=True, top_p=1.0,
                                  temperature=lossless.TEMPERATURE, top_k=lossless.TOP_K, return_dict_in_generate=True)
        spec = out.spec_stats
        assert spec.schedule.method_steps[method] > 400, (method, spec.schedule.method_steps)
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, method
        samples.append(out.sequences[:, lossless.PROMPT.shape[1]:])
    pvalues = lossless.chi_square_pvalues(torch.cat(samples), law)
    assert lossless.accepted(pvalues), f"p = {pvalues}"


def test_a_head_keeps_each_rows_own_tokens_waiting_and_drafts_as_if_fed_every_step(monkeypatch):
    """In the steps another candidate drafts, rows commit different numbers of tokens; the EAGLE head keeps each
    row's own tokens' features waiting (no head forward) and feeds them at its next draft. Under the same forced
    decisions (candidates in turn, two steps each; the width cycle of tests/schedule/test_lossless.py), it drafts
    exactly what a head fed after every step drafts (`BACKLOG_LIMIT` 0), and the waiting tokens did differ between
    rows."""
    from tests.schedule.test_lossless import WIDTH_CYCLE

    steps = [0, 0]  # decisions, weighings

    def forced(acceptance, step_time, active, probe, widths, probe_length, draft_rate=None, probe_alone=True,
               estimate_widths=None, critical=None):
        width = WIDTH_CYCLE[steps[0] % len(WIDTH_CYCLE)]
        steps[0] += 1
        rows = np.arange(len(active))
        limits = np.where(np.asarray(active, dtype=bool), np.where(rows % 3 == 1, max(width - 1, 0), width), 0)
        return controller.Decision(int(limits.max()), tuple(int(x) for x in limits), 1.0, 1.0)

    weigh = controller.Schedule._weigh

    def in_turn(self, times, *args):
        method = list(times)[steps[1] // 2 % len(times)]
        steps[1] += 1
        return weigh(self, {method: times[method]}, *args)

    monkeypatch.setattr(controller, "decide", forced)
    monkeypatch.setattr(controller.Schedule, "_weigh", in_turn)
    import hf_specdec.proposers.eagle as eagle

    ragged = []
    index = eagle.backlog_index

    def spied(pieces, ends, width):
        ragged.append(any(len(set((after - before).tolist())) > 1 for before, after in zip(ends, ends[1:])))
        return index(pieces, ends, width)

    monkeypatch.setattr(eagle, "backlog_index", spied)
    target = make_model("llama")
    ids, mask = padded_batch([12, 7, 10, 9, 5, 11], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    head = trained_head(target, "eagle", expected)
    stats = {}
    for limit in (eagle.BACKLOG_LIMIT, 0):
        monkeypatch.setattr(eagle, "BACKLOG_LIMIT", limit)
        steps[:] = [0, 0]
        config = SpeculativeConfig(method="auto", heads=head, num_speculative_tokens=3, suffix_cache=SuffixCache())
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), limit
        stats[limit] = out.spec_stats
        if limit:
            assert any(ragged), ragged
            ragged.clear()
    assert not ragged  # fed after every step: nothing waited
    waited, fed = stats.values()
    assert waited.schedule.method_steps["eagle"] > 0 and waited.num_accepted_tokens > 0
    assert waited.accepted_per_position == fed.accepted_per_position and waited.num_drafts == fed.num_drafts


def test_a_candidate_drafts_in_auto_exactly_as_alone(monkeypatch):
    """The EAGLE head under `method="auto"`, chosen at every drafting step, with plain steps between (the forced
    width cycle of tests/schedule/test_lossless.py, restarted for each run): it drafts exactly what it drafts as
    `method="eagle"` under the same schedule, so the steps it skips (plain ones, and under auto those another
    candidate drafts) keep its features in step with the text."""
    from tests.schedule.test_lossless import WIDTH_CYCLE

    steps = [0]

    def forced(acceptance, step_time, active, probe, widths, probe_length, draft_rate=None, probe_alone=True,
               estimate_widths=None, critical=None):
        width = WIDTH_CYCLE[steps[0] % len(WIDTH_CYCLE)]
        steps[0] += 1
        limits = np.where(np.asarray(active, dtype=bool), width, 0)
        return controller.Decision(width, tuple(int(x) for x in limits), 1.0, 1.0)

    weigh = controller.Schedule._weigh
    monkeypatch.setattr(controller, "decide", forced)
    monkeypatch.setattr(controller.Schedule, "_weigh",
                        lambda self, times, *args: weigh(self, {m: times[m] for m in times if m in (None, "eagle")},
                                                         *args))
    target = make_model("llama")
    ids, mask = padded_batch([12, 7, 10, 9], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    head = trained_head(target, "eagle", expected)
    stats = {}
    for method in ("eagle", "auto"):
        steps[0] = 0
        config = SpeculativeConfig(method=method, heads=head, num_speculative_tokens=3,
                                   **({"suffix_cache": SuffixCache()} if method == "auto" else {}))
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), method
        stats[method] = out.spec_stats
    assert stats["auto"].schedule.method_steps["eagle"] > 0
    assert stats["auto"].accepted_per_position == stats["eagle"].accepted_per_position
    assert stats["auto"].num_drafts == stats["eagle"].num_drafts
    assert stats["eagle"].num_accepted_tokens > 0


def _counting_observations(monkeypatch) -> tuple[list[int], list[int]]:
    """Counts the forwards the loop scored (the prefill and every step) and those whose scores token recycling
    observed."""
    from hf_specdec.decoding.loop import SpeculativeDecoder
    from hf_specdec.proposers.recycling import RecyclingProposer

    scored, seen = [], []
    score, observe = SpeculativeDecoder.score, RecyclingProposer.observe_scores
    monkeypatch.setattr(SpeculativeDecoder, "score", lambda self, *args: scored.append(1) or score(self, *args))
    monkeypatch.setattr(RecyclingProposer, "observe_scores",
                        lambda self, *args: seen.append(1) or observe(self, *args))
    return scored, seen


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_token_recycling_among_the_candidates_matches_plain_generate(
        arch, static, rows_in_turn, cycled_widths, monkeypatch):  # noqa: F811
    """Token recycling as a candidate (`auto_methods`) beside n-gram lookup, suffix decoding and an EAGLE head, on a
    left-padded batch whose rows draft with different candidates in each step (its static tree merged with chains
    and lookups), 0, some or all of k, with plain steps between: the output is plain generate's, every candidate
    drafted, and the recycled table saw the target's scores in every forward, the steps other candidates drafted
    included."""
    scored, seen = _counting_observations(monkeypatch)
    target = make_model(arch)
    ids, mask = padded_batch([12, 7, 10, 9, 5, 11], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    config = SpeculativeConfig(method="auto", heads=trained_head(target, "eagle", expected), num_speculative_tokens=3,
                               suffix_cache=SuffixCache(), auto_methods=["ngram", "suffix", "recycling", "eagle"])
    extra = {"cache_implementation": "static"} if static else {}
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs, **extra)
    assert torch.equal(out.sequences, expected), arch
    steps = out.spec_stats.schedule.method_steps
    assert set(steps) == {"ngram", "suffix", "recycling", "eagle"} and min(steps.values()) > 0, steps
    assert rows_in_turn.merged > 0 and out.spec_stats.num_accepted_tokens > 0
    assert len(seen) == len(scored) > 1 + max(row.schedule.method_steps.get("recycling", 0)
                                              for row in out.spec_stats.per_row), (len(seen), len(scored))


def test_token_recycling_among_the_candidates_samples_the_exact_target_law(rows_in_turn, monkeypatch,
                                                                          cycled_widths):  # noqa: F811
    """The chi-square test of tests/decoding/test_sampling_lossless.py over one call whose steps mix token
    recycling's static trees with n-gram lookup's chains across rows (rows drafting 0 to k): recycled nodes were
    drafted in those steps, accepted and rejected."""
    from hf_specdec.proposers.recycling import RecyclingProposer

    target = lossless.make_target()
    law = lossless.exact_law(target, lossless.TEMPERATURE)
    recycled, propose = [], RecyclingProposer.propose

    def counted(self, state):
        proposal = propose(self, state)
        recycled.append(int(proposal.tree.valid[:, 1:].sum()))
        return proposal

    monkeypatch.setattr(RecyclingProposer, "propose", counted)
    config = SpeculativeConfig(method="auto", num_speculative_tokens=3, seed=37, auto_methods=["ngram", "recycling"])
    prompts = lossless.PROMPT.expand(lossless.N, -1)
    kwargs = dict(max_new_tokens=lossless.NEW_TOKENS, do_sample=True, top_p=1.0, temperature=lossless.TEMPERATURE,
                  top_k=lossless.TOP_K, return_dict_in_generate=True)
    hf_specdec.generate(target, prompts[:500], attention_mask=torch.ones_like(prompts[:500]),
                        speculative=dataclasses.replace(config, seed=41), **kwargs)
    recycled.clear()
    out = hf_specdec.generate(target, prompts, attention_mask=torch.ones_like(prompts), speculative=config, **kwargs)
    spec = out.spec_stats
    assert sum(recycled) > 1000 and rows_in_turn.merged > 0, (recycled, rows_in_turn.merged)
    assert min(spec.schedule.method_steps.values()) > 1000, spec.schedule.method_steps
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    pvalues = lossless.chi_square_pvalues(out.sequences[:, lossless.PROMPT.shape[1]:], law)
    assert lossless.accepted(pvalues), f"p = {pvalues}"


def test_every_auto_method_has_a_candidate_and_only_those_register():
    from hf_specdec.config import AUTO_METHODS

    assert sorted(auto.AUTO_CANDIDATES) == sorted(AUTO_METHODS)
    with pytest.raises(ValueError, match=r"auto candidate 'lookahead': not one of hf_specdec.config.AutoMethod"):
        auto.register_auto_candidate("lookahead", lambda config: None)
    with pytest.raises(ValueError, match=r"an auto candidate is already registered for method 'ngram'"):
        auto.register_auto_candidate("ngram", lambda config: None)
