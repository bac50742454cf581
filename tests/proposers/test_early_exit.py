"""Early-exit self-speculation: the draft is the target's first N layers, final norm and lm_head (the target's own
modules), its greedy output is plain generate's on every architecture (chains, branches, dynamic trees), batched
and left padded, transformers' `assistant_early_exit=N` is routed to it, and bad layers are refused up front."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.proposers.early_exit import decoder_layers_path, early_exit_draft
from tests.conftest import ARCHITECTURES, VOCAB, draft_shapes, make_draft, make_model, padded_batch

LENGTHS = [12, 7, 10]
NEW_TOKENS = 24


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_matches_plain_generate(arch, forward_counter):
    target = make_model(arch)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    layer = target.config.num_hidden_layers - 1
    for name, config in draft_shapes("early_exit", 4, early_exit_layer=layer).items():
        target_forwards = forward_counter(target)
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), f"{arch}/{name}"
        stats = out.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, (arch, name)
        assert stats.accepted_per_position[1] > 0, f"{arch}/{name}: {stats.accepted_per_position}"
        # the draft's forwards are not the target's: only prefill and verify steps run the whole model
        assert target_forwards() == stats.target_forward_passes, (arch, name)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_draft_is_the_targets_first_layers_sharing_its_modules(arch):
    """Same parameter objects (no copy), N layers, and the logits of a copy of the target cut to its first N layers
    (its final norm and lm_head kept)."""
    target = make_model(arch)
    layer = 1
    draft = early_exit_draft(target, layer)
    assert early_exit_draft(target, layer) is draft, "built once per target and layer"
    own = {id(p) for p in target.parameters()}
    assert all(id(p) in own for p in draft.parameters())
    assert draft.config.num_hidden_layers == layer and target.config.num_hidden_layers > layer
    assert draft.get_output_embeddings() is target.get_output_embeddings()
    reference = copy.deepcopy(target)
    del reference.get_submodule(decoder_layers_path(reference))[layer:]
    reference.config.num_hidden_layers = layer
    if getattr(reference.config, "layer_types", None) is not None:
        reference.config.layer_types = reference.config.layer_types[:layer]
    ids, mask = padded_batch(LENGTHS, seed=3)
    with torch.no_grad():
        mine = draft(ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(mine, reference(ids, attention_mask=mask, use_cache=False).logits)
        assert not torch.allclose(mine, target(ids, attention_mask=mask, use_cache=False).logits)


class Wrapped(torch.nn.Module):
    """A layer in place of a linear one (as an adapter or a quantization library puts its own), computing the same."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_target_with_replaced_layers_drafts_with_them(arch):
    """A target whose linear layers (lm_head included) were replaced by modules of another class drafts with those
    very modules, its output plain generate's."""
    target = make_model(arch)
    for module in list(target.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, Wrapped(child))
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    config = SpeculativeConfig(method="early_exit", early_exit_layer=1, schedule="fixed")
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, target.generate(ids, **kwargs))
    assert out.spec_stats.num_accepted_tokens > 0
    assert isinstance(target.lm_head, Wrapped) and early_exit_draft(target, 1).lm_head is target.lm_head


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_draft_cache_starts_from_the_targets_prompt_keys_and_values(arch):
    """The draft's prompt cache is the target's first layers' over every prompt token but the last: what the
    draft's own prefill computes (same modules, same inputs), copied instead of computed."""
    target = make_model(arch)
    layer = 1
    draft = early_exit_draft(target, layer)
    ids, mask = padded_batch(LENGTHS, seed=3)
    length = ids.shape[1] - 1
    with torch.no_grad():
        target_cache = RaggedKVCache(target)
        target_cache.prefill(ids, mask)
        shared, computed = RaggedKVCache(draft), RaggedKVCache(draft)
        shared.prefill_shared(target_cache, length, mask[:, :-1])
        computed.prefill(ids[:, :-1], mask[:, :-1])
    mine, theirs = shared.layers_by_order(length), computed.layers_by_order(length)
    assert len(mine) == len(theirs) == layer
    for (keys, values), (ref_keys, ref_values) in zip(mine, theirs):
        torch.testing.assert_close(keys, ref_keys)
        torch.testing.assert_close(values, ref_values)
    for name in ("lengths", "next_position", "valid"):
        assert torch.equal(getattr(shared, name), getattr(computed, name)), name
    assert (shared.host_lengths, shared.width, shared.padded) == (computed.host_lengths, computed.width,
                                                                  computed.padded)


def test_prompt_runs_through_the_shared_layers_once():
    """Only the target's prefill feeds the whole prompt through the layers the draft shares."""
    target = make_model("llama")
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    widths = []
    first = target.get_submodule(decoder_layers_path(target))[0]
    handle = first.register_forward_hook(lambda module, args, output: widths.append(output[0].shape[1]
                                                                                    if isinstance(output, tuple)
                                                                                    else output.shape[1]))
    try:
        out = hf_specdec.generate(target, ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, return_dict_in_generate=True,
                                  speculative=SpeculativeConfig(method="early_exit", early_exit_layer=1,
                                                                num_speculative_tokens=3, schedule="fixed"))
    finally:
        handle.remove()
    assert out.spec_stats.num_draft_tokens > 0
    assert widths[0] == ids.shape[1] and ids.shape[1] - 1 not in widths, widths


def test_assistant_early_exit_is_routed_through_hf_specdec():
    target = make_model("llama")
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    hf_specdec.enable()
    try:
        out = target.generate(ids, assistant_early_exit=1, num_assistant_tokens=3, return_dict_in_generate=True,
                              **kwargs)
        assert torch.equal(out.sequences, expected)
        assert out.spec_stats.num_speculative_tokens == 3 and out.spec_stats.num_draft_tokens > 0
        assert torch.equal(target.generate(ids, **kwargs), expected), "calls without it are transformers' own"
        with pytest.raises(ValueError, match="num_assistant_tokens_schedule='heuristic': with assistant_early_exit"):
            target.generate(ids, assistant_early_exit=1, num_assistant_tokens_schedule="heuristic", **kwargs)
        with pytest.raises(ValueError, match="assistant_confidence_threshold=0.4: with assistant_early_exit"):
            target.generate(ids, assistant_early_exit=1, assistant_confidence_threshold=0.4, **kwargs)
        with pytest.raises(ValueError, match="assistant_early_exit=: transformers' spelling"):
            target.generate(ids, assistant_early_exit=1, spec_method="ngram", **kwargs)
    finally:
        hf_specdec.disable()
    out = hf_specdec.generate(target, ids, assistant_early_exit=1, **kwargs)
    assert torch.equal(out, expected)


def test_bad_layers_are_refused_before_any_work(forward_counter):
    target = make_model("llama")  # 2 layers: only layer 1 leaves a draft shorter than the target
    ids, mask = padded_batch(LENGTHS, seed=3)
    count = forward_counter(target)
    for layer in (2, 5):
        with pytest.raises(ValueError, match=f"SpeculativeConfig.early_exit_layer: expected a layer from 1 to 1 "
                                             f"\\(the target has 2 layers.*got {layer}"):
            hf_specdec.generate(target, ids, attention_mask=mask, max_new_tokens=4,
                                speculative=SpeculativeConfig(method="early_exit", early_exit_layer=layer))
    assert count() == 0
    with pytest.raises(ValueError, match="SpeculativeConfig.early_exit_layer: expected an int >= 1, got 0"):
        SpeculativeConfig(method="early_exit", early_exit_layer=0)
    # LayerSkip's name, an alias
    assert SpeculativeConfig(method="early_exit", exit_layer=1).early_exit_layer == 1
    with pytest.raises(ValueError, match="SpeculativeConfig.exit_layer: an alias of early_exit_layer, given both"):
        SpeculativeConfig(method="early_exit", exit_layer=1, early_exit_layer=2)
    with pytest.raises(ValueError, match="SpeculativeConfig.early_exit_layer: expected an int >= 1, got 0"):
        SpeculativeConfig(method="early_exit", exit_layer=0)
    with pytest.raises(ValueError, match="SpeculativeConfig.early_exit_layer: method='early_exit' needs the layer"):
        SpeculativeConfig(method="early_exit")
    with pytest.raises(ValueError, match="SpeculativeConfig.early_exit_layer: only method='early_exit' uses it"):
        SpeculativeConfig(method="ngram", early_exit_layer=1)
    with pytest.raises(ValueError, match="SpeculativeConfig.draft_model: method='early_exit' does not use"):
        SpeculativeConfig(method="early_exit", early_exit_layer=1, draft_model=make_draft())
    with pytest.raises(ValueError, match="spec_method='early_exit' needs the layer to draft from"):
        hf_specdec.generate(target, ids, attention_mask=mask, spec_method="early_exit", max_new_tokens=4)


def _gemma3n(per_layer_input: int) -> torch.nn.Module:
    """A tiny Gemma-3n: its last two layers reuse the keys and values of earlier ones; `per_layer_input` > 0 gives
    every layer an input embedding of its own, from one table for all four."""
    config = Gemma3nTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_kv_shared_layers=2,
        laurel_rank=8, hidden_size_per_layer_input=per_layer_input, vocab_size_per_layer_input=VOCAB, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4)
    torch.manual_seed(0)
    model = Gemma3nForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("per_layer_input", [8, 0])
def test_a_model_whose_first_layers_make_no_model_is_refused_by_name(per_layer_input):
    """Gemma-3n: per-layer inputs sized for all its layers, or (without them) layers that share keys and values
    with layers past the exit; other methods run on it as on any model."""
    target = _gemma3n(per_layer_input)
    ids, mask = padded_batch(LENGTHS, seed=2, repeat_period=3)
    kwargs = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": False}
    expected = target.generate(ids, **kwargs)
    assert torch.equal(hf_specdec.generate(target, ids, spec_method="ngram", **kwargs), expected)
    why = "an input embedding of its own" if per_layer_input else "does not describe a model of its first 2 layers"
    with pytest.raises(ValueError, match=f"early_exit_layer: Gemma3nForCausalLM.*{why}.*another method"):
        hf_specdec.generate(target, ids, speculative=SpeculativeConfig(method="early_exit", early_exit_layer=2),
                            **kwargs)
