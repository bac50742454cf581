"""The MLP speculator as a method: greedy output is plain generate's (chains, branches, dynamic trees) on several
architectures with left padding and batch > 1; k above n_predict is capped with a warning; a speculator made for
another model is refused before any forward."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads import MedusaConfig, MedusaHeads, MlpSpeculator, MlpSpeculatorConfig
from hf_specdec.heads.token_map import map_index
from hf_specdec.step import Proposal
from tests.conftest import draft_shapes, make_model, padded_batch

LENGTHS = [12, 7, 10]
NEW_TOKENS = 24


def random_speculator(target: torch.nn.Module, seed: int = 0) -> MlpSpeculator:
    """A random speculator sized for the target: it drafts every step, and is rarely right."""
    torch.manual_seed(seed)
    text = target.config.get_text_config(decoder=True)
    return MlpSpeculator(MlpSpeculatorConfig(emb_dim=text.hidden_size, vocab_size=text.vocab_size)).eval()


def fitted_speculator(
    target: torch.nn.Module,
    # [B, L]: sequences the speculator learns to continue (the test's expected outputs: drafts are then often right)
    sequences: torch.Tensor,
    n_predict: int = 3,
    steps: int = 80,
    seed: int = 0,
    shared_vocab: bool = False,
    # [D] target ids the speculator drafts over (with shared_vocab), or None
    token_map: torch.Tensor | None = None,
) -> MlpSpeculator:
    """A speculator fitted for a few steps to the target's choices on `sequences`, teacher-forced on the target's
    final hidden states as it is trained, so drafts are accepted often, rejected sometimes, several tokens deep.
    `shared_vocab`: it embeds and scores with the target's matrices (learning over `token_map`'s ids, if any)."""
    torch.manual_seed(seed)
    text = target.config.get_text_config(decoder=True)
    speculator = MlpSpeculator(MlpSpeculatorConfig(emb_dim=text.hidden_size, vocab_size=text.vocab_size,
                                                   n_predict=n_predict, inner_dim=32, scale_input=True,
                                                   shared_vocab=shared_vocab))
    if token_map is not None:
        speculator.set_token_map(token_map)
    vocab = speculator.target_vocab(target, compact=True)
    with torch.no_grad():
        hidden = target(sequences, output_hidden_states=True).hidden_states[-1]  # [B, L, F]
    positions = sequences.shape[1] - 1 - n_predict
    windows = sequences.unfold(1, n_predict + 1, 1)[:, 1 : positions + 1]  # [B, T, n + 1]: x_{t+1} .. x_{t+n+1}
    labels = windows[..., 1:] if token_map is None else map_index(token_map, text.vocab_size)[windows[..., 1:]]
    optimizer = torch.optim.Adam(speculator.parameters(), lr=2e-2)
    for _ in range(steps):
        logits = speculator(hidden[:, :positions], windows[..., :-1], vocab)  # [B, T, n, V] ([..., D] over a map)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten(), ignore_index=-1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return speculator.eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "opt", "gemma2"])
def test_greedy_matches_plain_generate(arch):
    target = make_model(arch)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    speculator = fitted_speculator(target, expected, steps=15)
    for name, config in draft_shapes("mlp_speculator", 3, heads=speculator).items():
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), f"{arch}/{name}"
        stats = out.spec_stats
        assert 0 < stats.num_accepted_tokens, (arch, name)
        assert name == "chain" or stats.num_accepted_tokens < stats.num_draft_tokens, (arch, name)
        assert stats.accepted_per_position[1] > 0, f"{arch}/{name}: {stats.accepted_per_position}"
        assert stats.target_forward_passes < 1 + NEW_TOKENS - 1, (arch, name)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("mapped", [False, True])
def test_a_speculator_on_the_targets_vocabulary_matches_plain_generate(arch, mapped):
    """shared_vocab: the target's embedding and lm_head (gemma2 scales its embeddings, gpt2 ties them), over the
    whole vocabulary or a token map of half of it; every draft shape."""
    target = make_model(arch)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    vocab_size = target.config.get_text_config(decoder=True).vocab_size
    token_map = torch.arange(0, vocab_size, 2) if mapped else None
    speculator = fitted_speculator(target, expected, steps=15, shared_vocab=True, token_map=token_map)
    for name, config in draft_shapes("mlp_speculator", 3, heads=speculator).items():
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), f"{arch}/{name}"
        stats = out.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, (arch, name)
        assert stats.accepted_per_position[1] > 0, f"{arch}/{name}: {stats.accepted_per_position}"


def test_a_speculator_on_the_targets_vocabulary_drafts_only_its_token_map(monkeypatch):
    target = make_model("llama")
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    token_map = torch.arange(1, 128, 3)
    speculator = fitted_speculator(target, target.generate(ids, **kwargs), steps=10, shared_vocab=True,
                                   token_map=token_map)
    drafted = []
    real = Proposal.chain

    def kept(root, tokens, budget, *args, **kw):  # tokens [B, k], budget [B]: the drafts each row holds
        drafted.append(tokens[torch.arange(tokens.shape[1]) < budget[:, None]])
        return real(root, tokens, budget, *args, **kw)

    monkeypatch.setattr(Proposal, "chain", kept)
    config = SpeculativeConfig(method="mlp_speculator", heads=speculator, num_speculative_tokens=3, schedule="fixed")
    hf_specdec.generate(target, ids, speculative=config, **kwargs)
    drafted = torch.cat(drafted)
    assert drafted.numel() > 0 and bool(torch.isin(drafted, token_map).all())


def test_a_speculator_on_the_targets_vocabulary_needs_a_target_that_can_lend_it(forward_counter):
    target = make_model("llama")
    speculator = MlpSpeculator(MlpSpeculatorConfig(emb_dim=32, vocab_size=128, shared_vocab=True))
    target.get_output_embeddings().weight = torch.nn.Parameter(torch.zeros(128, 16))
    ids, mask = padded_batch(LENGTHS, seed=3)
    count = forward_counter(target)
    with pytest.raises(ValueError, match=r"SpeculativeConfig.heads: this MLP speculator embeds and scores with its "
                                         r"target's input embedding and lm_head \(128 x 32\); the target's lm_head is "
                                         r"\(128, 16\)"):
        hf_specdec.generate(target, ids, attention_mask=mask, max_new_tokens=4,
                            speculative=SpeculativeConfig(method="mlp_speculator", heads=speculator))
    assert count() == 0, "refused before any forward"


def test_speculator_reads_the_hidden_state_that_produced_the_last_token():
    """A speculator fitted to the sequence guesses it whole: every draft accepted at batch 1."""
    target = make_model("llama")
    ids, mask = padded_batch([9], seed=1, repeat_period=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    speculator = fitted_speculator(target, expected, steps=300)
    config = SpeculativeConfig(method="mlp_speculator", heads=speculator, num_speculative_tokens=3)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.acceptance_rate > 0.8


def test_k_above_n_predict_is_capped_with_a_warning():
    target = make_model("llama")
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    speculator = fitted_speculator(target, expected, n_predict=2, steps=20)
    config = SpeculativeConfig(method="mlp_speculator", heads=speculator, num_speculative_tokens=5)
    with pytest.warns(UserWarning, match="num_speculative_tokens=5: this MLP speculator has n_predict=2"):
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.num_speculative_tokens == 2


@pytest.mark.parametrize("field,value,match", [
    ("emb_dim", 48, "emb_dim 48 does not match the target's hidden_size 32; it was trained for another model"),
    ("vocab_size", 64, "vocab_size 64 does not match the target's vocab_size 128; it was trained for another model"),
])
def test_speculator_of_another_model_is_refused(field, value, match, forward_counter):
    target = make_model("llama")
    sizes = {"emb_dim": 32, "vocab_size": 128, field: value}
    speculator = MlpSpeculator(MlpSpeculatorConfig(**sizes))
    ids, mask = padded_batch(LENGTHS, seed=3)
    count = forward_counter(target)
    with pytest.raises(ValueError, match=f"SpeculativeConfig.heads: the MLP speculator's {match}"):
        hf_specdec.generate(target, ids, attention_mask=mask, max_new_tokens=4,
                            speculative=SpeculativeConfig(method="mlp_speculator", heads=speculator))
    assert count() == 0, "refused before any forward"


def test_wrong_drafter_for_the_method_is_named():
    medusa = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=2))
    with pytest.raises(ValueError, match="method='mlp_speculator' needs hf_specdec.heads.MlpSpeculator, got a "
                                         "MedusaHeads; a MedusaHeads is for method='medusa'"):
        SpeculativeConfig(method="mlp_speculator", heads=medusa)
    speculator = MlpSpeculator(MlpSpeculatorConfig(emb_dim=32, vocab_size=128))
    with pytest.raises(ValueError, match="MlpSpeculator is for method='mlp_speculator'"):
        SpeculativeConfig(method="medusa", heads=speculator)
    with pytest.raises(ValueError, match=r"SpeculativeConfig.tree_paths: static trees of rank paths; only "
                                         r"methods \['medusa', 'recycling'\]"):
        SpeculativeConfig(method="mlp_speculator", heads=speculator, tree_paths=[(0,)])


def test_assistant_picks_the_method():
    """`assistant=speculator` alone selects method='mlp_speculator', as heads pick theirs."""
    target = make_model("llama")
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    speculator = fitted_speculator(target, expected, steps=20)
    out = hf_specdec.generate(target, ids, assistant=speculator, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.num_draft_tokens > 0
