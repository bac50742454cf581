"""Models with recurrent layers (hybrids of attention and state-space, linear-attention or convolution layers, and
state-space models alone): each row's states are rolled back to its kept tokens, so greedy output and every step's
logits are plain `generate`'s, and sampling keeps the target's law."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache import recurrent
from hf_specdec.heads import EagleConfig, EagleHead
from hf_specdec.lossless import divergences
from hf_specdec.suffix import SuffixCache
from tests.conftest import SPECIAL, VOCAB, make_draft, noisy_copy, padded_batch, run_racing_threads
from tests.decoding import test_sampling_lossless as lossless
from tests.heads.medusa.test_model import heads_for
from tests.proposers.test_mlp_speculator import fitted_speculator

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=2)
# per name: config class, model class, what the tiny config needs beyond SMALL (layers of each kind, in an order
# that puts a recurrent layer first and last somewhere)
HYBRIDS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "head_dim": 8, "num_hidden_layers": 4, **LINEAR, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "head_dim": 8, "num_hidden_layers": 4, **LINEAR,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        "num_hidden_layers": 4, "layer_types": ["linear_attention", "mlp", "full_attention", "linear_attention"],
        "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "head_dim": 8, "chunk_size": 8}),
    "bamba": ("BambaConfig", "BambaForCausalLM", {"num_hidden_layers": 3, "attn_layer_indices": [1], **MAMBA2}),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", {
        "num_hidden_layers": 4, **LINEAR,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}),
    # weights larger than its default initialization, which makes a tiny LFM2 repeat its last token forever
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {"num_hidden_layers": 4, "full_attn_idxs": [1, 3], "conv_L_cache": 3,
                                               "initializer_range": 0.1}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        "num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "num_local_experts": 2,
        "num_experts_per_tok": 1, **MAMBA2}),
    # a state-space model alone: no attention layer at all
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", {
        "num_hidden_layers": 2, "num_heads": 8, "head_dim": 8, "state_size": 8, "n_groups": 1, "chunk_size": 8,
        "expand": 2}),
}
LENGTHS = [12, 7, 10]  # batch 3, left padded
NEW_TOKENS = 24


def make_hybrid(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    config_name, model_name, extra = HYBRIDS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**SMALL, **extra, **SPECIAL, **overrides})
    return getattr(transformers, model_name)(config).eval()


def _chains(target: torch.nn.Module, expected: torch.Tensor) -> dict[str, SpeculativeConfig]:
    """Chain proposers, each drafting some tokens the target keeps and some it rejects."""
    suffix_cache = SuffixCache()
    return {
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3),
        # fitted to the target's own output: accepted several tokens deep, rejected now and then
        "mlp_speculator": SpeculativeConfig(method="mlp_speculator", num_speculative_tokens=3,
                                            heads=fitted_speculator(target, expected, steps=15)),
        # rejected at the first token almost always, at every step (k pinned)
        "random_draft": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=4,
                                          schedule="fixed"),
        "medusa": SpeculativeConfig(method="medusa", heads=heads_for(target), num_speculative_tokens=3),
        "eagle3": SpeculativeConfig(method="eagle", heads=EagleHead(EagleConfig.for_target(target, "eagle3")).eval(),
                                    num_speculative_tokens=3),
        # the target's own layers with a noisy lm_head: a draft model with recurrent layers of its own, rolled back
        # over several forwards a step
        "hybrid_draft": SpeculativeConfig(method="draft", draft_model=noisy_copy(target), num_speculative_tokens=3),
        # the target's first layers, recurrent ones among them
        "early_exit": SpeculativeConfig(method="early_exit", early_exit_layer=1, num_speculative_tokens=3),
        # one path per row from its own text and the earlier calls' outputs
        "suffix": SpeculativeConfig(method="suffix", suffix_cache=suffix_cache, num_speculative_tokens=4),
        "auto": SpeculativeConfig(method="auto", draft_model=make_draft(), num_speculative_tokens=3,
                                  suffix_cache=suffix_cache),
    }


@pytest.mark.parametrize("name, side", [(name, "left") for name in sorted(HYBRIDS)]
                         + [("qwen3_next", "right"), ("nemotron_h", "right")])
def test_greedy_output_and_logits_match_plain_generate(name, side):
    """Right padding too: the trailing pads go through the recurrent layers as plain generate feeds them."""
    target = make_hybrid(name)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5, side=side)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    expected = target.generate(ids, **kwargs)
    partly_kept = 0
    for proposer, config in _chains(target, expected.sequences).items():
        out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
        assert torch.equal(out.sequences, expected.sequences), f"{name}/{proposer}"
        # a state left after rejected drafts would change the logits long before it changes a greedy choice
        for step, (ours, theirs) in enumerate(zip(out.logits, expected.logits, strict=True)):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=f"{name}/{proposer}, step {step}")
        stats = out.spec_stats
        assert stats.num_draft_tokens > 0, f"{name}/{proposer}"
        partly_kept += 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert partly_kept >= 1, f"{name}: no proposer had drafts both kept and rejected"


@pytest.mark.parametrize("name", ["qwen3_next", "nemotron_h", "lfm2", "mamba2"])
def test_kept_tokens_fed_with_the_next_forward_at_batch_one(name, monkeypatch):
    """One row keeps one number of tokens: its states go back and the kept tokens' mixer inputs are fed in front of
    the next forward's, or run at once when too many wait."""
    fed = []
    begin = recurrent.RecurrentRollback.begin

    def spy(self, width, real=None):
        if self.saved is None:  # a step's first forward
            fed.append(self.num_pending)
        begin(self, width, real)

    monkeypatch.setattr(recurrent.RecurrentRollback, "begin", spy)
    target = make_hybrid(name)
    ids = padded_batch([12], seed=3, repeat_period=5)[0]
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    expected = target.generate(ids, **kwargs)
    for proposer, config in _chains(target, expected.sequences).items():
        fed.clear()
        out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
        assert torch.equal(out.sequences, expected.sequences), f"{name}/{proposer}"
        for step, (ours, theirs) in enumerate(zip(out.logits, expected.logits, strict=True)):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=f"{name}/{proposer}, step {step}")
        if proposer == "random_draft":
            # rejected at every step: each keeps one token, which joins those waiting until there are too many
            assert fed[1 : recurrent.MAX_PENDING_TOKENS + 2] == [*range(1, recurrent.MAX_PENDING_TOKENS + 1), 0], fed


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_bfloat16_output_parts_only_at_near_ties(name):
    """In bfloat16 the verify forward's kernels over k + 1 tokens, and the mixers' second run over the kept tokens,
    round differently from plain decoding's one token at a time: where plain's two best scores are (nearly) tied the
    output may part from plain's, and only there (`hf_specdec.lossless`: within TIE_SPACINGS bfloat16 spacings).
    `pytest tests/cache/test_recurrent.py -k bfloat16 -s` prints the rows that parted."""
    target = make_hybrid(name).to(torch.bfloat16)
    ids, mask = padded_batch([12, 7, 10, 9], seed=1, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    plain = target.generate(ids, **kwargs, return_dict_in_generate=True, output_scores=True)
    parted = 0
    configs = _chains(target, plain.sequences)
    for proposer, config in configs.items():
        for drafter in (config.heads, config.draft_model):
            if drafter is not None:
                drafter.to(torch.bfloat16)
        out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
        found = divergences(plain.sequences, out, ids.shape[1], plain.scores, torch.bfloat16, pad_token_id=0)
        assert all(divergence.near_tie for divergence in found), (proposer, found)
        parted += len(found)
    print(f"{name}: {parted} of {ids.shape[0] * len(configs)} rows parted from plain generate's, each at a near-tie")


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_a_hybrid_draft_drafts_each_row_as_alone(name, monkeypatch):
    """A draft model's step feeds its rows different numbers of tokens (dummies after the shorter), then drafts one
    token a forward: rows with dummies go back to their real tokens' states before the next forward, so what the
    target accepts of each row's drafts is what it accepts alone, in a batch of one; without that, it is not."""
    target = make_hybrid(name)
    lengths = [12, 7, 10]
    ids, mask = padded_batch(lengths, seed=3, repeat_period=5)
    kwargs = dict(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)

    def accepted() -> tuple[list[int], list[int]]:
        # the target's layers with a little noise on the lm_head: most drafts kept, so rows feed 1 or 2 tokens
        config = SpeculativeConfig(method="draft", draft_model=noisy_copy(target, scale=0.3),
                                   num_speculative_tokens=4, schedule="fixed")
        together = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **kwargs)
        alone = [hf_specdec.generate(target, ids[row:row + 1, ids.shape[1] - length:], speculative=config, **kwargs)
                 for row, length in enumerate(lengths)]
        return ([row.num_accepted_tokens for row in together.spec_stats.per_row],
                [out.spec_stats.num_accepted_tokens for out in alone])

    together, alone = accepted()
    assert together == alone, (together, alone)
    monkeypatch.setattr(recurrent.RecurrentRollback, "_fix", lambda self, *args: None)
    together, alone = accepted()
    assert together != alone


def test_calls_in_threads_share_a_hybrid_model():
    """Each call's hooks on the shared mixers record and feed its own thread's forwards only."""
    target = make_hybrid("qwen3_next")
    prompts = [padded_batch([10], seed=seed, repeat_period=4)[0] for seed in range(4)]
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = [target.generate(ids, **kwargs) for ids in prompts]
    config = SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3, schedule="fixed")
    got = [None] * len(prompts)

    def work(index: int) -> None:
        got[index] = hf_specdec.generate(target, prompts[index], speculative=config, **kwargs)

    run_racing_threads(work, len(prompts))
    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(ours, theirs), index


def test_without_the_rollback_the_output_changes(monkeypatch):
    """The states the verify forward leaves after rejected drafts are wrong for the next step: skipping the rollback
    changes the output, and the logits by far more than the 1e-4 the tests above allow (`-s` prints by how much)."""
    target = make_hybrid("qwen3_next")
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    expected = target.generate(ids, **kwargs)
    config = SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=4, schedule="fixed")
    assert torch.equal(hf_specdec.generate(target, ids, speculative=config, **kwargs).sequences, expected.sequences)

    def forget(self, kept, sources=None):
        self.saved, self.inputs = None, {}

    monkeypatch.setattr(recurrent.RecurrentRollback, "commit", forget)
    out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
    assert not torch.equal(out.sequences, expected.sequences)
    # up to the first step whose greedy choice parted (after it the two texts differ)
    parted = int((out.sequences != expected.sequences).any(dim=0).nonzero()[0]) - ids.shape[1]
    moved = max(float((ours - theirs).abs().max()) for ours, theirs in zip(out.logits[:parted + 1],
                                                                          expected.logits[:parted + 1]))
    print(f"without the rollback the logits moved by up to {moved:.2f} before the output parted")
    assert moved > 100 * 1e-4


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_supported_mixers_continue_from_their_state(name):
    """The check that refuses Mamba-1 scans (below) passes these by a wide margin (`-s` prints the differences)."""
    difference, mixer = recurrent.continuation_difference(make_hybrid(name))
    print(f"{name} ({type(mixer).__name__}): {difference:.1e}")
    assert difference < recurrent.CONTINUATION_TOLERANCE / 10


def _assert_same_cache(ours, theirs) -> None:
    """Each layer's keys and values, and each recurrent layer's states, as plain generate's."""
    assert [type(layer) for layer in ours.layers] == [type(layer) for layer in theirs.layers]
    for index, (mine, plain) in enumerate(zip(ours.layers, theirs.layers, strict=True)):
        if isinstance(plain, transformers.cache_utils.LinearAttentionLayer):
            torch.testing.assert_close(mine.conv_states[0], plain.conv_states[0], msg=f"layer {index}")
            torch.testing.assert_close(mine.recurrent_states[0], plain.recurrent_states[0], msg=f"layer {index}")
            assert mine.has_previous_state[0]
        else:
            torch.testing.assert_close(mine.keys, plain.keys, msg=f"layer {index}")
            torch.testing.assert_close(mine.values, plain.values, msg=f"layer {index}")


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_rows_that_finish_early_and_the_returned_cache_are_plain_generates(name):
    """Rows end at an EOS at different steps (dropped from the batch with their states, and computed again for the
    cache, as plain generate fed them padding); the cache returned is plain generate's."""
    target = make_hybrid(name)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    base = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    free = target.generate(ids, **base, eos_token_id=None)[:, ids.shape[1]:]
    eos = int(free[1, 5])
    kwargs = dict(**base, eos_token_id=eos, return_dict_in_generate=True)
    expected = target.generate(ids, **kwargs)
    assert (expected.sequences[:, -1] == 0).any(), "a row should end early"
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    _assert_same_cache(out.cache, expected.cache)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_returned_cache_of_rows_that_ran_to_the_end_is_the_engines(batch):
    """No forward runs again for rows whose cache is complete: their keys and values are gathered and their states
    are the engine's (tokens still waiting for the next forward, at batch 1, are fed first)."""
    target = make_hybrid("qwen3_next")
    ids, mask = padded_batch(LENGTHS[:batch], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True)
    expected = target.generate(ids, **kwargs)
    config = SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3, schedule="fixed")
    out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.spec_stats.target_forward_passes == 1 + NEW_TOKENS - 1  # the prefill and one verify per token
    _assert_same_cache(out.cache, expected.cache)


@pytest.mark.parametrize("config, message", [
    (SpeculativeConfig(method="ngram", tree_width=2), "not token trees"),
    (SpeculativeConfig(method="draft", draft_model=make_draft(), tree_width=2, tree_total_tokens=4), "token trees"),
    (SpeculativeConfig(method="recycling"), "token trees"),
    (SpeculativeConfig(method="auto", auto_methods=["ngram", "recycling"]), "token trees"),
    (SpeculativeConfig(method="draft", draft_model=make_hybrid("lfm2", seed=1), tree_width=2), "draft_model: "),
])
def test_what_recurrent_layers_cannot_do_is_refused_up_front(config, message):
    target = make_hybrid("qwen3_next")
    ids, mask = padded_batch(LENGTHS, seed=3)
    with pytest.raises(ValueError, match=message):
        hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=4)


def test_static_shapes_are_refused():
    target = make_hybrid("qwen3_next")
    ids, mask = padded_batch(LENGTHS, seed=3)
    with pytest.raises(ValueError, match="static shapes"):
        hf_specdec.generate(target, ids, attention_mask=mask, speculative=SpeculativeConfig(method="ngram"),
                            max_new_tokens=4, cache_implementation="static")


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_conversation_goes_on_from_a_filled_cache(name, batch):
    """A second turn continues from the first turn's cache (plain generate's, or the one hf_specdec returned, which
    carries an EAGLE head's own context): its recurrent layers start from the cache's states, its attention layers
    from its keys and values; output, logits and the returned cache are plain generate's from the same cache."""
    target = make_hybrid(name)
    ids, mask = padded_batch(LENGTHS[:batch], seed=3, repeat_period=5)
    head = EagleHead(EagleConfig.for_target(target, "eagle3")).eval()
    first_kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None,
                        return_dict_in_generate=True)
    first = target.generate(ids, **first_kwargs)
    ours = hf_specdec.generate(target, ids, speculative=SpeculativeConfig(method="eagle", heads=head), **first_kwargs)
    assert torch.equal(ours.sequences, first.sequences)
    more = torch.randint(3, VOCAB, (batch, 4), generator=torch.Generator().manual_seed(1))
    conversation = torch.cat([first.sequences, more], dim=1)
    kwargs = dict(attention_mask=torch.cat([mask, torch.ones(batch, 10, dtype=mask.dtype)], dim=1),
                  max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                  output_logits=True)
    expected = target.generate(conversation, cache=copy.deepcopy(first.cache), **kwargs)
    configs = {"ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1),
               "eagle": SpeculativeConfig(method="eagle", heads=head, num_speculative_tokens=3)}
    for source, cache in (("plain", first.cache), ("ours", ours.cache)):
        for proposer, config in configs.items():
            out = hf_specdec.generate(target, conversation, cache=copy.deepcopy(cache), speculative=config, **kwargs)
            assert torch.equal(out.sequences, expected.sequences), (source, proposer)
            for step, (mine, theirs) in enumerate(zip(out.logits, expected.logits, strict=True)):
                torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4, msg=f"{source}/{proposer}, {step}")
            assert out.spec_stats.num_draft_tokens > 0
            _assert_same_cache(out.cache, expected.cache)


def test_a_filled_cache_is_refused_where_it_cannot_be_continued():
    """A cache of recurrent layers alone does not say how many tokens it holds; padding among the new tokens
    would enter the states as text."""
    ngram = SpeculativeConfig(method="ngram")
    mamba = make_hybrid("mamba2")
    ids, mask = padded_batch([8], seed=3)
    filled = mamba.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                            return_dict_in_generate=True).cache
    longer = torch.cat([ids, torch.full((1, 3), 5)], dim=1)
    with pytest.raises(ValueError, match="without attention layers"):
        hf_specdec.generate(mamba, longer, cache=filled, speculative=ngram, max_new_tokens=4, pad_token_id=0)
    target = make_hybrid("qwen3_next")
    ids, mask = padded_batch([8, 6], seed=3)
    first = target.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, return_dict_in_generate=True)
    filled = first.cache
    longer = torch.cat([first.sequences, torch.full((2, 3), 5)], dim=1)
    padded = torch.cat([mask, torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]])], dim=1)
    with pytest.raises(ValueError, match="padding among the new tokens"):
        hf_specdec.generate(target, longer, attention_mask=padded, cache=filled, speculative=ngram, max_new_tokens=4,
                            pad_token_id=0)


# transformers' Mamba-1 scan starts a forward of several tokens from a zero state, not the cached one
MAMBA1 = {
    "mamba": ("MambaConfig", "MambaForCausalLM", {"num_hidden_layers": 2, "state_size": 4}),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", {"num_hidden_layers": 2, "state_size": 4}),
    "jamba": ("JambaConfig", "JambaForCausalLM", {
        "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
        "expert_layer_offset": 1, "num_experts": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2}),
}


@pytest.mark.parametrize("name", sorted(MAMBA1))
def test_layers_that_restart_from_a_zero_state_are_refused(name, monkeypatch):
    """Their verify forward would not compute what plain decoding does (greedy output can still agree on a tiny
    model, while the logits already differ): refused before any forward, with the measured difference."""
    monkeypatch.setitem(HYBRIDS, name, MAMBA1[name])
    model = make_hybrid(name)
    difference, mixer = recurrent.continuation_difference(model)
    print(f"{name} ({type(mixer).__name__}): {difference:.1e}")
    assert difference > 10 * recurrent.CONTINUATION_TOLERANCE
    ids, mask = padded_batch(LENGTHS, seed=3)
    with pytest.raises(ValueError, match="start a forward of several tokens from a zero state"):
        hf_specdec.generate(model, ids, attention_mask=mask, speculative=SpeculativeConfig(method="ngram"),
                            max_new_tokens=4, pad_token_id=0)


def test_states_of_other_kinds_are_refused():
    """Layers holding a state and keys and values at once (Falcon-H1's) and RNNs that take no cache (RWKV)."""
    torch.manual_seed(0)
    falcon = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
        **{**SMALL, "num_hidden_layers": 2}, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
        mamba_n_groups=1, mamba_chunk_size=8, **SPECIAL)).eval()
    rwkv = transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        context_length=256)).eval()
    ids, mask = padded_batch(LENGTHS, seed=3)
    for model in (falcon, rwkv):
        with pytest.raises(ValueError, match="running state"):
            hf_specdec.generate(model, ids, attention_mask=mask, speculative=SpeculativeConfig(method="ngram"),
                                max_new_tokens=4, pad_token_id=0)


def _sampling_target() -> torch.nn.Module:
    """A tiny Qwen3-Next over the law test's 8 tokens, with peaked logits (see tests/decoding/test_sampling_lossless)."""
    return lossless.peaked(make_hybrid("qwen3_next", seed=11, vocab_size=lossless.VOCAB, eos_token_id=None,
                                       bos_token_id=None))


@pytest.fixture(scope="module")
def sampling_target():
    return _sampling_target()


def _sampled_chain(target) -> SpeculativeConfig:
    """An MLP speculator fitted to the target's sampled continuations, drafting chains of 2 from sampled drafts."""
    return SpeculativeConfig(method="mlp_speculator", heads=lossless._speculator(target), num_speculative_tokens=2,
                             seed=5)


# sampled chains of 2 from drafters with recurrent layers of their own: the target's layers with a noisy lm_head (a
# draft model), and its first layer (early exit)
SAMPLED_DRAFTERS = {
    "mlp_speculator": _sampled_chain,
    "hybrid_draft": lambda target: SpeculativeConfig(method="draft", draft_model=lossless._noisy_draft(target),
                                                     num_speculative_tokens=2, seed=7),
    "early_exit": lambda target: SpeculativeConfig(method="early_exit", early_exit_layer=2, num_speculative_tokens=2,
                                                   seed=9),
}


@pytest.mark.parametrize("drafter", sorted(SAMPLED_DRAFTERS))
def test_sampling_matches_exact_target_law(sampling_target, drafter):
    """Tokens 2-4 come from a step that drafted tokens 2 and 3: rows that rejected one go on from rolled-back states.
    Drafts were both accepted (at depth 2 too) and rejected."""
    law = lossless.exact_law(sampling_target, lossless.TEMPERATURE)
    config = SAMPLED_DRAFTERS[drafter](sampling_target)
    prompts = lossless.PROMPT.expand(300, -1)
    spec = hf_specdec.generate(sampling_target, prompts, attention_mask=torch.ones_like(prompts), speculative=config,
                               max_new_tokens=lossless.NEW_TOKENS, do_sample=True, temperature=lossless.TEMPERATURE,
                               top_k=lossless.TOP_K, return_dict_in_generate=True).spec_stats
    assert spec.accepted_per_position[1] > 0 and spec.num_accepted_tokens < spec.num_draft_tokens, spec
    pvalues = lossless.chi_square_pvalues(lossless.draws(sampling_target, lossless.TEMPERATURE, config), law)
    assert lossless.accepted(pvalues), f"p = {pvalues}"


def test_sampling_without_the_rollback_is_caught(sampling_target, monkeypatch):
    """The law test has the power to see states left after rejected drafts."""

    def forget(self, kept, width):
        self.saved, self.inputs = None, {}

    monkeypatch.setattr(recurrent.RecurrentRollback, "commit", forget)
    law = lossless.exact_law(sampling_target, lossless.TEMPERATURE)
    draws = lossless.draws(sampling_target, lossless.TEMPERATURE, _sampled_chain(sampling_target))
    assert not lossless.accepted(lossless.chi_square_pvalues(draws, law))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["qwen3_next", "nemotron_h"])
def test_hybrids_on_a_gpu(name):
    """The states (and those kept before each step) stay on the model's device, in its dtype: float32 output is
    plain generate's; in bfloat16, kernels over k + 1 tokens may round differently from one token, so near-ties
    can part."""
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    ids, mask = ids.to("cuda"), mask.to("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        target = make_hybrid(name).to("cuda", dtype)
        kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
        expected = target.generate(ids, **kwargs)
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
        got = hf_specdec.generate(target, ids, speculative=config, **kwargs)
        assert got.device.type == "cuda"
        if dtype == torch.float32:
            assert torch.equal(got, expected)
        else:
            assert (got == expected).float().mean().item() > 0.9
