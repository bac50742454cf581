"""Byte-level BPE tokenizer for the test bed, trained with ``tokenizers``.

``<|endoftext|>`` is the bos and eos token (it separates files in training),
``<|pad|>`` is a separate padding token. No token is added automatically.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, model_max_length: int = 512
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it for transformers."""
    if vocab_size < 512:
        raise ValueError(f"vocab_size must be at least 512, got {vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )
