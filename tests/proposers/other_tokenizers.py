"""A draft with a tokenizer unlike the test bed's, built here (no downloads); the test bed's draft under shuffled
ids is `hf_specdec.testbed.other_tokenizer.permuted`."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}


def byte_level(seed: int = 0, learned_positions: int | None = None):
    """A byte-level tokenizer without merges (one token per byte, 258 tokens) and a random one-layer Llama over
    it: a segmentation unlike the target's (whose BPE merges bytes into words); with `learned_positions`, a
    one-layer GPT-2 whose table holds that many positions instead."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, **{c: i + 2 for i, c in enumerate(sorted(alphabet))}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
    torch.manual_seed(seed)
    if learned_positions is not None:
        return tokenizer, GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=1, n_head=4,
                                                     n_positions=learned_positions, pad_token_id=1, eos_token_id=0,
                                                     bos_token_id=0)).eval()
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=1, eos_token_id=0, bos_token_id=0)
    return tokenizer, LlamaForCausalLM(config).eval()
