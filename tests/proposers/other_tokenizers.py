"""Drafts with tokenizers other than the test bed's, built here (no downloads)."""

from __future__ import annotations

import copy
import json

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}


def permuted(tokenizer, draft: torch.nn.Module, seed: int = 0, extra_rows: int = 64):
    """The test bed's tokenizer with its ordinary tokens' ids shuffled, and the test bed's draft with its embedding
    and lm_head rows moved to match (plus `extra_rows` padded rows): the same segmentation under other ids, a real
    draft whose tokens the target accepts."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    special = set(tokenizer.all_special_ids)
    ordinary = sorted(i for i in spec["model"]["vocab"].values() if i not in special)
    shuffled = torch.tensor(ordinary)[torch.randperm(len(ordinary), generator=torch.Generator().manual_seed(seed))]
    new_id = dict(zip(ordinary, shuffled.tolist()))
    spec["model"]["vocab"] = {s: new_id.get(i, i) for s, i in spec["model"]["vocab"].items()}
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **SPECIAL_TOKENS)
    moved = copy.deepcopy(draft)
    old = torch.arange(len(tokenizer))
    new = torch.tensor([new_id.get(i, i) for i in range(len(tokenizer))])
    moved.resize_token_embeddings(len(tokenizer) + extra_rows)
    with torch.no_grad():
        for weight, source in ((moved.get_input_embeddings().weight, draft.get_input_embeddings().weight),
                               (moved.get_output_embeddings().weight, draft.get_output_embeddings().weight)):
            weight[new] = source[old]
    return other, moved.eval()


def byte_level(seed: int = 0):
    """A byte-level tokenizer without merges (one token per byte, 258 tokens) and a random one-layer Llama over
    it: a segmentation unlike the target's (whose BPE merges bytes into words)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, **{c: i + 2 for i, c in enumerate(sorted(alphabet))}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=1, eos_token_id=0, bos_token_id=0)
    return tokenizer, LlamaForCausalLM(config).eval()
