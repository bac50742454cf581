"""A real draft under another tokenizer, built from a model's own tokenizer and draft (no downloads).

`permuted(tokenizer, draft)` shuffles the ids of the tokenizer's ordinary tokens and moves the draft's embedding and
lm_head rows to match, and pads its vocabulary: the same segmentation of every text under other ids, in a vocabulary
of another size. It exists so that benchmarks and tests have a draft with another tokenizer whose tokens the target
accepts as often as its own draft's (`SpeculativeConfig(method="draft", draft_tokenizer=...)`, and transformers'
universal assisted generation), for the test bed and for models such as SmolLM2 that have no such draft published.
"""

from __future__ import annotations

import copy
import json

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast


def permuted(tokenizer: PreTrainedTokenizerFast, draft: PreTrainedModel, seed: int = 0,
             extra_rows: int = 64) -> tuple[PreTrainedTokenizerFast, PreTrainedModel]:
    """`tokenizer` with its ordinary tokens' ids shuffled (seeded; added and special tokens keep theirs, as do its
    special-token settings and chat template), and a copy of `draft` with its embedding and lm_head rows moved to the
    new ids, plus `extra_rows` rows no token uses (set to the mean row, so they are never a greedy pick). `draft` is
    left as it was.

    The tokenizer must be a fast tokenizer whose model holds a `vocab` (BPE, WordPiece, WordLevel), as GPT-2-style
    byte-level BPE tokenizers do."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"].get("vocab")
    if not isinstance(vocab, dict):
        raise ValueError(f"permuted: expected a tokenizer whose model maps token strings to ids (BPE, WordPiece, "
                         f"WordLevel), got a {spec['model']['type']} model")
    fixed = set(tokenizer.all_special_ids) | {token["id"] for token in spec["added_tokens"]}
    ordinary = sorted(i for i in vocab.values() if i not in fixed)
    order = torch.randperm(len(ordinary), generator=torch.Generator().manual_seed(seed))
    new_id = dict(zip(ordinary, torch.tensor(ordinary)[order].tolist()))
    spec["model"]["vocab"] = {token: new_id.get(i, i) for token, i in vocab.items()}
    backend = type(tokenizer.backend_tokenizer).from_str(json.dumps(spec))
    other = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=tokenizer.chat_template,
                                    padding_side=tokenizer.padding_side, **tokenizer.special_tokens_map)

    size = len(tokenizer)
    moved = copy.deepcopy(draft)
    moved.resize_token_embeddings(size + extra_rows, mean_resizing=False)
    old = torch.arange(size)
    new = torch.tensor([new_id.get(i, i) for i in range(size)])
    with torch.no_grad():
        for weight, source in ((moved.get_input_embeddings().weight, draft.get_input_embeddings().weight),
                               (moved.get_output_embeddings().weight, draft.get_output_embeddings().weight)):
            weight[new.to(weight.device)] = source[old.to(source.device)]
            weight[size:] = source[:size].float().mean(0).to(weight.dtype)
    return other, moved.eval()
