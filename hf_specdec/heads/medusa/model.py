"""Medusa heads (Cai et al. 2024): K small heads on the target's final hidden state; head i guesses the token i + 2
positions after that state (the target's own lm_head gives the next one).

Each head is `num_layers` residual blocks, x + SiLU(W x + b), each with its own weights (the original code's
`[ResBlock] * n` shares them by accident), then a vocabulary projection: its own (Medusa v0.1/1.0), or, with
`shared_lm_head`, the target's lm_head (the "version 2" layout: the heads hold only their residual blocks). Block
weights start at zero, so an untrained head is the identity followed by the projection. Heads on the target's
lm_head may carry a token map (`hf_specdec.heads.token_map`): proposals then project onto its rows at those ids only.
Stored as our adapter folder (method "medusa"); FasterDecoding and vLLM checkpoints are converted on load
(`convert.py`).
"""

from __future__ import annotations

from importlib.resources import files

import torch
from torch import nn

from hf_specdec.heads.adapter import AdapterMixin
from hf_specdec.heads.medusa.config import MedusaConfig
from hf_specdec.heads.medusa.convert import read_published
from hf_specdec.heads.medusa.tree import default_tree
from hf_specdec.heads.target_weights import layer_spec
from hf_specdec.heads.token_map import TokenMapMixin


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaHeads(AdapterMixin, TokenMapMixin, nn.Module):
    config_class = MedusaConfig
    adapter_types = ("medusa",)
    card_template = files(__package__).joinpath("card.md")
    upload_message = "Upload Medusa heads (hf_specdec)"
    read_published = staticmethod(read_published)

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            nn.Sequential(
                *(ResidualBlock(config.hidden_size) for _ in range(config.num_layers)),
                *([] if config.shared_lm_head else [nn.Linear(config.hidden_size, config.vocab_size, bias=False)]),
            )
            for _ in range(config.num_heads)
        )
        self._init_token_map(config.vocab_size)

    def token_map_refusal(self) -> str | None:
        if not self.config.shared_lm_head:
            return ("these heads project with their own lm_heads; a token map is for heads that share the target's "
                    "(shared_lm_head=True)")
        return None

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0][0].linear.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.heads[0][0].linear.weight.device

    def forward(
        self,
        # [..., H]: the target's final hidden state (after its last norm)
        hidden: torch.Tensor,
        lm_head: nn.Module | None = None,
    ) -> torch.Tensor:
        """Logits [..., K, V]: head i's guess for the token i + 2 positions after `hidden`. `lm_head` (the target's
        `get_output_embeddings()`) is required with `shared_lm_head` and unused otherwise."""
        outputs = torch.stack([head(hidden.to(self.dtype)) for head in self.heads], dim=-2)
        if not self.config.shared_lm_head:
            return outputs
        if lm_head is None:
            raise ValueError("MedusaHeads.forward: lm_head: expected the target's lm_head (these heads share it)")
        spec = layer_spec(lm_head)
        return lm_head(outputs.to(device=spec.device, dtype=spec.dtype))

    def tree(self) -> list[list[int]]:
        """The static tree for these heads: the one fitted to them in training, else every path over the first
        (up to 4) heads whose ranks sum to at most 2 (for 4 heads: the built-in 34-node default tree)."""
        if self.config.tree_paths is not None:
            return self.config.tree_paths
        return default_tree(self.config.num_heads)

    def check_target(self, target: nn.Module) -> None:
        """Clear errors when the heads were made for another model shape."""
        text = target.config.get_text_config(decoder=True)
        sizes = {"hidden_size": text.hidden_size, "vocab_size": text.vocab_size}
        if self.config.shared_lm_head:
            lm_head = target.get_output_embeddings()
            if lm_head is None:
                raise ValueError("SpeculativeConfig.heads: these heads share the target's lm_head; the target has none")
            vocab, hidden = layer_spec(lm_head).shape
            sizes = {"hidden_size": hidden, "vocab_size": vocab}
        for name, expected in sizes.items():
            mine = getattr(self.config, name)
            if mine is not None and mine != expected:
                raise ValueError(
                    f"SpeculativeConfig.heads: {name} {mine} does not match the target's {expected}; "
                    "these heads were trained for another model"
                )

    def card_fields(self) -> dict:
        config = self.config
        shared = "the target's own lm_head" + ("" if config.token_map_size is None else
                                               f" (its rows at {config.token_map_size} token ids: a token map)")
        projection = (shared if config.shared_lm_head
                      else f"its own lm_head over {config.vocab_size} tokens")
        return dict(num_heads=config.num_heads, num_layers=config.num_layers, hidden_size=config.hidden_size,
                    projection=projection)
