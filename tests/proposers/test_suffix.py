"""`SpeculativeConfig(method="suffix")`: its settings and errors, the cache shared across calls and threads, and
hybrid drafting's per-row choice. Greedy equality on every architecture, the sampling law and host syncs are in
tests/decoding/."""

from __future__ import annotations

import copy
import itertools
import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.proposers.hybrid import HybridProposer
from hf_specdec.suffix import EMPTY_DRAFT, SuffixCache, SuffixConfig, propose_suffix_draft
from tests.conftest import make_draft, make_model, padded_batch
from tests.heads.medusa.test_model import heads_for
from tests.proposers.test_eagle import eagle_head

GREEDY = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)


def test_defaults_are_vllms():
    config = SpeculativeConfig(method="suffix")
    assert (config.max_tree_depth, config.max_cached_requests, config.max_spec_factor, config.max_spec_offset,
            config.min_token_prob) == (24, 10000, 1.0, 0.0, 0.1)
    assert config.num_speculative_tokens == 24  # vLLM: a maximum, max_tree_depth by default
    assert SpeculativeConfig(method="ngram").num_speculative_tokens == 5
    assert SpeculativeConfig(method="suffix", max_tree_depth=8).num_speculative_tokens == 8
    assert config.suffix_config() == SuffixConfig()


@pytest.mark.parametrize(("options", "message"), [
    (dict(max_cached_requests=-1), r"SpeculativeConfig.max_cached_requests: expected an int >= 0, got -1"),
    (dict(min_token_prob=0.0), r"SpeculativeConfig.min_token_prob: expected a probability in \(0, 1\], got 0.0"),
    (dict(min_token_prob=1.5), r"SpeculativeConfig.min_token_prob: expected a probability in \(0, 1\], got 1.5"),
    (dict(max_tree_depth=0), r"SpeculativeConfig.max_tree_depth: expected an int >= 1, got 0"),
    (dict(max_spec_factor=-1.0), r"SpeculativeConfig.max_spec_factor: expected a number >= 0"),
    (dict(max_spec_offset=float("nan")), r"SpeculativeConfig.max_spec_offset: expected a finite number"),
    (dict(tree_width=2), r"SpeculativeConfig.tree_width: suffix drafts are token trees already"),
    (dict(suffix_cache="cache.safetensors"), r"SpeculativeConfig.suffix_cache: expected a hf_specdec.suffix.SuffixCache"),
    (dict(suffix_cache=SuffixCache(SuffixConfig(max_depth=16)), max_tree_depth=8),
     r"SpeculativeConfig.max_tree_depth=8 conflicts with the suffix_cache's 16"),
    (dict(fallback=SpeculativeConfig(method="ngram")), r"SpeculativeConfig.fallback: expected a SpeculativeConfig with "
                                                       r"method in \['draft', 'medusa', 'eagle'\].*method='ngram'"),
    (dict(fallback=make_draft()), r"SpeculativeConfig.fallback: .*got a LlamaForCausalLM"),
    (dict(fallback_min_score=2.0), r"SpeculativeConfig.fallback_min_score: decides when the fallback"),
    (dict(fallback=SpeculativeConfig(method="draft", draft_model=make_draft(), seed=3)),
     r"SpeculativeConfig.fallback: its seed and lossy_typical_acceptance are not used"),
])
def test_bad_settings_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(method="suffix", **options)


def test_suffix_settings_need_method_suffix_or_auto():
    with pytest.raises(ValueError, match=r"SpeculativeConfig.min_token_prob: a suffix decoding setting; only "
                                         r"methods 'suffix' and 'auto' use it, got method='ngram'"):
        SpeculativeConfig(method="ngram", min_token_prob=0.5)
    with pytest.raises(ValueError, match=r"SpeculativeConfig.suffix_cache: a suffix decoding setting"):
        SpeculativeConfig(method="ngram", suffix_cache=SuffixCache())
    # auto drafts with suffix decoding among its candidates, but has no hybrid fallback
    cache = SuffixCache(SuffixConfig(max_depth=12))
    assert SpeculativeConfig(method="auto", suffix_cache=cache).max_tree_depth == 12
    with pytest.raises(ValueError, match=r"SpeculativeConfig.fallback_min_score: a suffix decoding setting; only "
                                         r"method='suffix' uses it, got method='auto'"):
        SpeculativeConfig(method="auto", fallback_min_score=1.0)


def test_a_cache_gives_its_settings():
    cache = SuffixCache(SuffixConfig(max_depth=12, min_token_prob=0.3))
    config = SpeculativeConfig(method="suffix", suffix_cache=cache)
    assert (config.max_tree_depth, config.min_token_prob, config.num_speculative_tokens) == (12, 0.3, 12)


def test_cache_of_another_vocabulary_is_refused():
    target = make_model("llama")
    ids, mask = padded_batch([6, 4], seed=1)
    config = SpeculativeConfig(method="suffix", suffix_cache=SuffixCache(vocab_size=50000))
    with pytest.raises(ValueError, match=r"SpeculativeConfig.suffix_cache: SuffixCache: built for a vocabulary of "
                                         r"50000 tokens, used with one of 128"):
        hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **GREEDY)


def test_outputs_feed_later_calls_first_in_first_out():
    """Each call's rows go into the global tree; the next call with the same prompts drafts them whole; at most
    max_cached_requests outputs are kept (a request's output takes its place when the request starts)."""
    target = make_model("qwen2")
    ids, mask = padded_batch([9, 5, 7], seed=2)  # no repeats: the first call has little to draft from
    expected = target.generate(ids, attention_mask=mask, **GREEDY)
    cache = SuffixCache(SuffixConfig(max_cached_requests=6))
    forwards = []
    for _ in range(3):
        config = SpeculativeConfig(method="suffix", suffix_cache=cache)
        out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config,
                                  return_dict_in_generate=True, **GREEDY)
        assert torch.equal(out.sequences, expected)
        forwards.append(out.spec_stats.target_forward_passes)
    assert forwards[1] < forwards[0] / 2, forwards
    assert cache.num_requests == 6  # 9 outputs, the oldest 3 evicted
    assert cache.num_tokens == 6 * GREEDY["max_new_tokens"]


def test_process_wide_cache_without_suffix_cache():
    target = make_model("llama")
    ids, mask = padded_batch([7], seed=9)
    config = SpeculativeConfig(method="suffix", max_cached_requests=7)  # settings of no other test
    hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **GREEDY)
    shared = SuffixCache.shared(config.suffix_config(), 128)
    assert shared.num_requests == 1
    hf_specdec.generate(target, ids, attention_mask=mask,
                        speculative=SpeculativeConfig(method="suffix", max_cached_requests=7), **GREEDY)
    assert shared.num_requests == 2


def test_threads_share_one_cache():
    """Concurrent generate calls in threads, one cache: every output is plain generate's, every output is cached."""
    target = make_model("llama")
    cache = SuffixCache(SuffixConfig(max_cached_requests=1000))
    batches = [padded_batch([8, 6], seed=seed, repeat_period=4) for seed in range(4)]
    expected = [target.generate(ids, attention_mask=mask, **GREEDY) for ids, mask in batches]
    results, errors = {}, []

    def work(index: int) -> None:
        try:
            ids, mask = batches[index % 4]
            for _ in range(2):
                config = SpeculativeConfig(method="suffix", suffix_cache=cache)
                results[index] = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **GREEDY)
                assert torch.equal(results[index], expected[index % 4])
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert cache.num_requests == 8 * 2 * 2
    assert cache.num_tokens == 8 * 2 * 2 * GREEDY["max_new_tokens"]


class Explode(StoppingCriteria):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > 3:
            raise RuntimeError("boom")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_failed_call_leaves_its_partial_outputs_finished():
    target = make_model("llama")
    ids, mask = padded_batch([8, 6], seed=1, repeat_period=3)
    cache = SuffixCache()
    config = SpeculativeConfig(method="suffix", suffix_cache=cache)
    with pytest.raises(RuntimeError, match="boom"):
        hf_specdec.generate(target, ids, attention_mask=mask, speculative=config,
                            stopping_criteria=StoppingCriteriaList([Explode()]), **GREEDY)
    assert cache.num_requests == 2
    with cache.reading() as tree:
        assert not tree._active  # no output left open


def _hybrid(target, fallback: SpeculativeConfig, min_score: float | None):
    # a fixed schedule: every step asks both drafters, so the counts below see the hybrid rule alone
    return SpeculativeConfig(method="suffix", suffix_cache=SuffixCache(), fallback=fallback,
                             fallback_min_score=min_score, schedule="fixed")


@pytest.mark.parametrize("kind", ["draft", "medusa", "eagle"])
def test_hybrid_takes_the_fallback_where_the_suffix_score_is_low(kind, monkeypatch):
    """Threshold 0: every row drafts from the suffix trees; a threshold no draft reaches: every row from the
    fallback; the default (the fallback's k): both, in the same calls. Output exact throughout."""
    target = make_model("llama")
    fallbacks = {
        "draft": lambda: SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3),
        "medusa": lambda: SpeculativeConfig(method="medusa", heads=heads_for(target), num_speculative_tokens=2),
        "eagle": lambda: SpeculativeConfig(method="eagle", heads=eagle_head(target), num_speculative_tokens=3),
    }
    ids, mask = padded_batch([10, 6, 8], seed=3, repeat_period=4)
    expected = target.generate(ids, attention_mask=mask, **GREEDY)
    built = []
    init = HybridProposer.__init__

    def spy(self, *args):
        init(self, *args)
        built.append(self)

    monkeypatch.setattr(HybridProposer, "__init__", spy)
    counts = {}
    for min_score in (0.0, None, 1000.0):
        config = _hybrid(target, fallbacks[kind](), min_score)
        out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **GREEDY)
        assert torch.equal(out, expected), (kind, min_score)
        counts[min_score] = (built[-1].suffix_drafts, built[-1].fallback_drafts)
    assert counts[0.0][1] == 0 and counts[0.0][0] > 0, counts
    assert counts[1000.0][0] == 0 and counts[1000.0][1] > 0, counts
    assert counts[None][0] > 0 and counts[None][1] > 0, counts


def test_hybrid_reports_each_rows_draft_depth_to_the_schedule(monkeypatch):
    """Every row on the fallback (a 2-token draft under a suffix k of 5): the proposal says each row drafted at
    most 2, so the schedule does not count positions 3 to 5 as rejected drafts."""
    from hf_specdec.schedule.controller import Schedule

    target = make_model("llama")
    ids, mask = padded_batch([10, 6], seed=3, repeat_period=4)
    fallback = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=2)
    config = SpeculativeConfig(method="suffix", suffix_cache=SuffixCache(), fallback=fallback,
                               fallback_min_score=1000.0, num_speculative_tokens=5)
    seen, observe = [], Schedule.observe

    def recording(self, state, proposal):
        seen.append((proposal.host_depths, list(self.allowed)))
        observe(self, state, proposal)

    monkeypatch.setattr(Schedule, "observe", recording)
    out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **GREEDY)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **GREEDY))
    drafted = [(depths, allowed) for depths, allowed in seen if any(allowed)]
    assert drafted and any(max(allowed) > 2 for _, allowed in drafted), seen
    for depths, allowed in drafted:
        assert depths is not None and all(d == min(a, 2) for d, a in zip(depths, allowed)), (depths, allowed)


def test_hybrid_skips_a_draft_model_that_no_row_needs():
    target = make_model("llama")
    draft = make_draft()
    calls = []
    draft.register_forward_hook(lambda *args: calls.append(1))
    ids, mask = padded_batch([10, 6], seed=3, repeat_period=4)
    config = _hybrid(target, SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=3), 0.0)
    hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **GREEDY)
    assert len(calls) == 1  # its prefill only


def test_hybrid_refuses_static_shapes():
    target = make_model("llama")
    ids, mask = padded_batch([6, 4], seed=1)
    config = _hybrid(target, SpeculativeConfig(method="draft", draft_model=make_draft()), None)
    with pytest.raises(ValueError, match=r"SpeculativeConfig.fallback: hybrid drafting runs with dynamic shapes"):
        hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, cache_implementation="static",
                            **GREEDY)


def test_hybrid_checks_what_the_fallback_needs():
    target = make_model("llama")
    ids, mask = padded_batch([6, 4], seed=1)
    config = _hybrid(target, SpeculativeConfig(method="eagle", heads=eagle_head(target)), None)
    with pytest.raises(ValueError, match=r"inputs_embeds: method='suffix' \(drafting with 'eagle'\) drafts from the "
                                         r"prompt's token ids"):
        hf_specdec.generate(target, inputs_embeds=target.get_input_embeddings()(ids), attention_mask=mask,
                            speculative=config, **GREEDY)


@pytest.mark.parametrize("schedule", ["fixed", "adaptive"])
def test_hybrid_with_a_fallback_draft_of_another_tokenizer(schedule, monkeypatch):
    """Batched and left padded, suffix rows and fallback rows in the same calls, steps where the fallback drafts
    and steps it skips: output exact, and at every proposal the fallback has read every committed token of each row
    (the steps it skipped included)."""
    from hf_specdec.proposers.cross_tokenizer import CrossTokenizerProposer
    from hf_specdec.testbed import load_testbed
    from hf_specdec.testbed.other_tokenizer import permuted

    tokenizer, target, draft = load_testbed()
    other, moved = permuted(tokenizer, draft)
    tokenizer.padding_side = "left"
    prompts = ["def parse_args(argv):\n", "import os\nimport sys\n\nimport os\nimport sys\n", "x = 1\ny = 2\n"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=32, do_sample=False, eos_token_id=None)
    expected = target.generate(**batch, **kwargs)
    calls = {"propose": 0, "skip": 0}
    built = []
    catch_up, init = CrossTokenizerProposer._catch_up, HybridProposer.__init__

    def reading(self, state):
        catch_up(self, state)
        for b in range(state.batch_size):
            start, end = int(state.pad_lengths[b]), self.text.ends[b]
            assert self.text.row(b).tolist() == state.sequences[b, start:end].tolist()
            assert end == state.host.lengths[b]

    def counting(name):
        method = getattr(CrossTokenizerProposer, name)

        def counted(self, state):
            calls[name] += 1
            return method(self, state)

        return counted

    def spy(self, *args):
        init(self, *args)
        built.append(self)

    monkeypatch.setattr(CrossTokenizerProposer, "_catch_up", reading)
    for name in calls:
        monkeypatch.setattr(CrossTokenizerProposer, name, counting(name))
    monkeypatch.setattr(HybridProposer, "__init__", spy)
    if schedule == "adaptive":  # every third step plain, so that the fallback skips steps
        from hf_specdec.schedule import controller
        from hf_specdec.schedule.decision import Decision

        decide, steps = controller.decide, itertools.count()

        def every_third_plain(*args, **kwargs):
            decision = decide(*args, **kwargs)
            if next(steps) % 3 == 2:
                return Decision(0, (0,) * len(decision.limits), decision.expected_tokens, decision.expected_time)
            return decision

        monkeypatch.setattr(controller, "decide", every_third_plain)
    fallback = SpeculativeConfig(method="draft", draft_model=moved, draft_tokenizer=other, tokenizer=tokenizer,
                                 num_speculative_tokens=3)
    config = SpeculativeConfig(method="suffix", suffix_cache=SuffixCache(), fallback=fallback, schedule=schedule)
    out = hf_specdec.generate(target, **batch, **kwargs, speculative=config, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert calls["propose"] > 0 and calls["skip"] > 0, calls
    assert built[-1].suffix_drafts > 0 and built[-1].fallback_drafts > 0
    assert out.spec_stats.num_accepted_tokens > 0


def test_lookahead_is_the_tree_a_proposal_would_draft():
    from hf_specdec.proposers.suffix import SuffixProposer
    from hf_specdec.step import DecodeState

    cache = SuffixCache(SuffixConfig(max_spec_factor=2.0))
    for output in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 8, 7]):  # earlier requests' outputs
        request = cache.start_request([0])
        request.extend(output)
        request.finish()
    ids = torch.tensor([[11, 12, 1, 2, 3]])
    state = DecodeState.start(ids, None, max_length=40, extra_capacity=6, pad_token_id=0)
    proposer = SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4, max_spec_factor=2.0,
                                                suffix_cache=cache), cache)
    proposer.start(state, None)
    (draft,) = proposer.drafts(state)
    assert draft.source == "global" and 9 in draft.tokens  # a tree: the less frequent branch rides along
    (tree,) = proposer.lookahead(state, [0])
    assert (tree.tokens.tolist(), tree.parents.tolist()) == (list(draft.tokens), list(draft.parents))
    proposer.finish(state)


def test_draft_classes_are_the_drafts_tree_and_match_length(monkeypatch):
    """Row 0 ends with `1 2 3`, which an earlier output continues (a match of 3 tokens in the global tree); row 1
    with `2 3` after an unseen token (2 tokens, global); row 2 with `7 8`, seen in its own prompt (2 tokens, local);
    row 3 with nothing seen before (0: no draft). The class is the match length's bucket, shifted for the global
    tree, and the proposal drafts what the classes looked up."""
    from hf_specdec.proposers import suffix as module
    from hf_specdec.proposers.suffix import MATCH_CLASS_BOUNDS, SuffixProposer, match_class
    from hf_specdec.step import DecodeState
    from hf_specdec.suffix import SuffixDraft

    buckets = len(MATCH_CLASS_BOUNDS)
    lengths = (1, 2, 3, 4, 5, 6, 8, 9, 13, 14, 24)
    assert [match_class(SuffixDraft((1,), (-1,), (1,), (1.0,), 1.0, m, "local")) for m in lengths] == \
        [1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert [match_class(SuffixDraft((1,), (-1,), (1,), (1.0,), 1.0, m, "global")) for m in (1, 24)] == \
        [1 + buckets, 2 * buckets]
    assert match_class(EMPTY_DRAFT) == 0
    cache = SuffixCache(SuffixConfig())
    request = cache.start_request([0])
    request.extend([1, 2, 3, 4, 5, 6])
    request.finish()
    ids = torch.tensor([[11, 12, 1, 2, 3], [13, 14, 15, 2, 3], [7, 8, 9, 7, 8], [16, 17, 18, 19, 20]])
    state = DecodeState.start(ids, None, max_length=40, extra_capacity=6, pad_token_id=0)
    proposer = SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_cache=cache),
                              cache)
    proposer.start(state, None)
    lookups = []
    monkeypatch.setattr(module, "propose_suffix_draft", lambda *args, **kwargs: lookups.append(args) or
                        propose_suffix_draft(*args, **kwargs))
    assert proposer.num_draft_classes == 2 * buckets
    assert proposer.draft_classes(state).tolist() == [3 + buckets, 2 + buckets, 2, 0]
    proposal = proposer.propose(state)
    assert len(lookups) == 4  # the step's classes and proposal share each row's lookup
    assert proposal.draft_token_ids[0].tolist()[:3] == [4, 5, 6] and proposal.draft_token_ids[1].tolist()[:2] == [4, 5]
    assert proposal.draft_token_ids[2].tolist()[:2] == [9, 7]
    assert proposal.num_draft_tokens.tolist() == [3, 2, 2, 0]  # capped at the match length (max_spec_factor 1)
    proposer.finish(state)


def test_a_smaller_budget_reuses_a_lookup_whose_draft_fits(monkeypatch):
    """A step's draft classes look each row up with the full budget k; the proposal under the schedule's smaller
    limit reuses that lookup where its draft fits the limit (it is the smaller budget's best draft too: checked against
    a fresh lookup) and looks the row up again where it does not."""
    from hf_specdec.proposers import suffix as module
    from hf_specdec.proposers.suffix import SuffixProposer
    from hf_specdec.step import DecodeState

    cache = SuffixCache(SuffixConfig(max_spec_factor=2.0))
    for output in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], [5, 9, 1, 2], [5, 9, 1, 3]):
        request = cache.start_request([0])
        request.extend(output)
        request.finish()
    # row 0 ends with `1 2 3`: a long continuation (5 tokens, budget 5); row 1 with `5 9`: a short one
    ids = torch.tensor([[11, 12, 1, 2, 3], [13, 14, 15, 5, 9]])
    state = DecodeState.start(ids, None, max_length=40, extra_capacity=6, pad_token_id=0)
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=5, max_spec_factor=2.0, suffix_cache=cache)
    proposer = SuffixProposer(config, cache)
    proposer.start(state, None)
    lookups = []
    monkeypatch.setattr(module, "propose_suffix_draft", lambda *args, **kwargs: lookups.append(args[-1]) or
                        propose_suffix_draft(*args, **kwargs))
    proposer.draft_classes(state)
    full = [proposer._draft(row, 5) for row in range(2)]
    assert lookups == [5, 5] and full[0].num_tokens == 5 and 0 < full[1].num_tokens <= 3
    state.set_draft_limits([3, 3], 3)
    drafts = proposer.drafts(state)
    assert lookups == [5, 5, 3]  # row 0's draft does not fit 3 tokens: looked up again; row 1's fits
    assert drafts[1] is full[1]
    fresh = SuffixProposer(config, cache)
    fresh.start(state, None)
    assert fresh.drafts(state) == drafts  # what a lookup with the smaller budget finds
    proposer.finish(state)
    fresh.finish(state)
