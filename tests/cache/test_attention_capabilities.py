"""Models that place tokens by cache slot or by a 2-D mask inside their own code, and models that keep a recurrent
state hf_specdec cannot roll back, are refused before any work."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    MptConfig,
    MptForCausalLM,
    RecurrentGemmaConfig,
    RecurrentGemmaForCausalLM,
    RwkvConfig,
    RwkvForCausalLM,
)

import hf_specdec
from hf_specdec import SpeculativeConfig
from tests.conftest import SPECIAL, VOCAB, make_model

PROMPT = torch.tensor([[5, 6, 7, 5, 6, 7]])


def _neo(types) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, attention_types=types, num_heads=4,
                          window_size=4, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return GPTNeoForCausalLM(config).eval()


def test_bloom_refused_up_front(forward_counter):
    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)).eval()
    count = forward_counter(model)
    with pytest.raises(ValueError, match="BloomForCausalLM: its ALiBi biases are built inside the model"):
        hf_specdec.generate(model, PROMPT, spec_method="ngram", max_new_tokens=4)
    assert count() == 0


def test_mpt_refused_up_front(forward_counter):
    """MPT's ALiBi bias of a key is its slot index: with rows accepting different numbers of tokens (holes in the
    slots) its output differed from plain generate's (scores by up to 0.26 on a 2-layer random MPT, 4 rows)."""
    torch.manual_seed(0)
    model = MptForCausalLM(MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=64)).eval()
    count = forward_counter(model)
    with pytest.raises(ValueError, match="MptForCausalLM: its ALiBi biases are indexed by cache slot"):
        hf_specdec.generate(model, PROMPT, spec_method="ngram", max_new_tokens=4)
    assert count() == 0


def test_gpt_neo_local_layers_refused_up_front(forward_counter):
    model = _neo([[["global", "local"], 1]])
    count = forward_counter(model)
    with pytest.raises(ValueError, match="GPTNeoForCausalLM: its local-attention layers apply their window"):
        hf_specdec.generate(model, PROMPT, spec_method="ngram", max_new_tokens=4)
    assert count() == 0


def test_gpt_neo_global_layers_match_plain_generate():
    model = _neo([[["global"], 2]])
    ids = torch.tensor([[0, 0, 5, 6, 7, 5], [5, 6, 7, 5, 6, 7]])
    mask = (ids != 0).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    assert torch.equal(hf_specdec.generate(model, ids, spec_method="ngram", **kwargs), expected)


# tiny random models whose layers keep a running state the engine cannot roll back (the state-space and
# linear-attention layers it can are in tests/cache/test_recurrent.py)
STATEFUL = {
    # RWKV takes no KV cache argument at all: before it was refused, its drafts ran against a state that had
    # advanced over rejected tokens, and its greedy output differed from plain generate's
    "rwkv": lambda: RwkvForCausalLM(RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                               attention_hidden_size=32, intermediate_size=64, context_length=64)),
    # its recurrent blocks keep their state themselves, outside the cache
    "recurrent_gemma": lambda: RecurrentGemmaForCausalLM(RecurrentGemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, lru_width=32, attention_window_size=8)),
}


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_recurrent_models_refused_up_front(name, forward_counter):
    torch.manual_seed(0)
    model = STATEFUL[name]().eval()
    count = forward_counter(model)
    with pytest.raises(ValueError, match=f"{type(model).__name__}: its layers .*keep a running state"):
        hf_specdec.generate(model, PROMPT, spec_method="ngram", max_new_tokens=4, pad_token_id=0)
    assert count() == 0


def test_recurrent_draft_model_refused_up_front(forward_counter):
    torch.manual_seed(0)
    draft = RwkvForCausalLM(RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                       intermediate_size=64, context_length=64, **SPECIAL)).eval()
    target = make_model("llama")
    counts = forward_counter(target), forward_counter(draft)
    config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="RwkvForCausalLM: its layers keep a running state"):
        hf_specdec.generate(target, PROMPT, speculative=config, max_new_tokens=4)
    assert [count() for count in counts] == [0, 0]
