"""Architectures of the test-bed target and draft (``LlamaForCausalLM``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one Llama model of the test bed."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")

    def llama_config(self, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> LlamaConfig:
        """The transformers config of this spec, with tied embeddings."""
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )

    def build(self, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> LlamaForCausalLM:
        """A freshly initialised model with a generation config matching the tokenizer."""
        model = LlamaForCausalLM(self.llama_config(vocab_size, bos_token_id, eos_token_id, pad_token_id))
        model.generation_config = GenerationConfig(
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id
        )
        return model


TARGET_SPEC = ModelSpec(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1024)
DRAFT_SPEC = ModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=384)
SPECS = {"target": TARGET_SPEC, "draft": DRAFT_SPEC}
