"""Medusa heads: lossless with chains and trees on several architectures, fed the right hidden state."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads import MedusaConfig, MedusaHeads
from tests.conftest import make_model, padded_batch

TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def heads_for(target: torch.nn.Module, num_heads: int = 3, seed: int = 0) -> MedusaHeads:
    """Heads whose projections copy the target's lm_head: head 0 guesses that the last token repeats, which
    repetitive random models often do, so some drafts are accepted and some rejected."""
    torch.manual_seed(seed)
    text = target.config.get_text_config()
    heads = MedusaHeads(MedusaConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size, num_heads=num_heads))
    with torch.no_grad():
        for head in heads.heads:
            head[-1].weight.copy_(target.get_output_embeddings().weight)
    return heads.eval()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "opt"])
@pytest.mark.parametrize("tree", [None, TREE, "default"])
def test_medusa_greedy_matches_plain_generate(arch, tree):
    target = make_model(arch)
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    num_heads = 4 if tree == "default" else 3
    config = SpeculativeConfig(method="medusa", heads=heads_for(target, num_heads=num_heads), num_speculative_tokens=3,
                               tree_paths=tree)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.num_draft_tokens > 0
    # per-position counts span the whole tree depth (the default tree is 4 deep, deeper than k = 3)
    assert len(out.spec_stats.accepted_per_position) == (4 if tree == "default" else 3)
    assert sum(out.spec_stats.accepted_per_position) == out.spec_stats.num_accepted_tokens


def test_heads_read_the_hidden_state_that_produced_the_last_token(monkeypatch):
    """At every proposal, state.target_hidden is the target's final hidden state at the position just before the
    last committed token (the one whose logits chose it), exactly as a fresh forward computes it."""
    from hf_specdec.proposers.medusa import MedusaProposer

    target = make_model("llama")
    seen: list[tuple[int, torch.Tensor]] = []
    propose = MedusaProposer.propose

    def recording(self, state):
        seen.append((int(state.lengths[0]), state.target_hidden[0].clone()))
        return propose(self, state)

    monkeypatch.setattr(MedusaProposer, "propose", recording)
    ids = torch.tensor([[5, 9, 5, 9, 5, 9, 5]])
    out = hf_specdec.generate(target, ids, assistant=heads_for(target), spec_method="medusa", max_new_tokens=16,
                              do_sample=False, eos_token_id=None)
    with torch.no_grad():
        states = target(out, output_hidden_states=True).hidden_states[-1][0]  # [L, H]
    assert len(seen) >= 3
    for length, hidden in seen:
        torch.testing.assert_close(hidden, states[length - 2], atol=1e-5, rtol=1e-4)


def test_medusa_spelling_and_bad_input():
    target = make_model("llama")
    heads = heads_for(target)
    ids = torch.tensor([[5, 9, 5, 9]])
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    assert torch.equal(hf_specdec.generate(target, ids, assistant=heads, spec_method="medusa", **kwargs), expected)
    wrong = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=128))
    with pytest.raises(ValueError, match="hidden_size 16 does not match the target's 32"):
        hf_specdec.generate(target, ids, assistant=wrong, spec_method="medusa", **kwargs)
    with pytest.raises(ValueError, match="depth 4 needs as many heads; the heads have 3"):
        hf_specdec.generate(target, ids, speculative=SpeculativeConfig(
            method="medusa", heads=heads, tree_paths=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]), **kwargs)
    with pytest.raises(ValueError, match="method='medusa' needs hf_specdec.heads.MedusaHeads, got None"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="only methods \\['medusa', 'recycling'\\] use them"):
        SpeculativeConfig(method="ngram", tree_paths=[(0,)])
    with pytest.raises(ValueError, match=r"needs its prefix"):
        SpeculativeConfig(method="medusa", heads=heads, tree_paths=[(0, 1)])
    with pytest.raises(ValueError, match="MedusaConfig.num_heads: expected an int >= 1"):
        MedusaConfig(hidden_size=8, vocab_size=8, num_heads=0)


@pytest.mark.parametrize("tree", [None, TREE])
def test_shared_lm_head_heads_are_lossless_and_checked(tree):
    target = make_model("llama")
    torch.manual_seed(2)
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=3, shared_lm_head=True)).eval()
    assert sorted(heads.state_dict()) == sorted(f"heads.{h}.0.linear.{p}" for h in range(3) for p in ("weight", "bias"))
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    config = SpeculativeConfig(method="medusa", heads=heads, num_speculative_tokens=3, tree_paths=tree)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, target.generate(ids, **kwargs))
    assert out.spec_stats.num_draft_tokens > 0
    wrong = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=100, shared_lm_head=True))
    with pytest.raises(ValueError, match="vocab_size 100 does not match the target's 128"):
        hf_specdec.generate(target, ids[:1], assistant=wrong, spec_method="medusa", max_new_tokens=2)
    with pytest.raises(ValueError, match="lm_head: expected the target's lm_head"):
        heads(torch.zeros(1, 32))
