"""Medusa heads (Cai et al. 2024): K small heads on the target's final hidden state; head i guesses the token
i + 2 positions after that state (the target's own lm_head gives the next one).

Each head is `num_layers` residual blocks, x + SiLU(W x + b), each with its own weights (the original code's
`[ResBlock] * n` shares them by accident), then a vocabulary projection of its own. Block weights start at zero,
so an untrained head is the identity followed by its projection.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    base_model_name_or_path: str | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MedusaConfig.{name}: expected an int >= 1, got {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            nn.Sequential(
                *(ResidualBlock(config.hidden_size) for _ in range(config.num_layers)),
                nn.Linear(config.hidden_size, config.vocab_size, bias=False),
            )
            for _ in range(config.num_heads)
        )

    def forward(
        self,
        # [..., H]: the target's final hidden state (after its last norm)
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [..., K, V]: head i's guess for the token i + 2 positions after `hidden`."""
        hidden = hidden.to(self.heads[0][-1].weight.dtype)
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def check_target(self, target: nn.Module) -> None:
        """Clear errors when the heads were made for another model shape."""
        text = target.config.get_text_config(decoder=True)
        if text.hidden_size != self.config.hidden_size:
            raise ValueError(
                f"SpeculativeConfig.heads: hidden_size {self.config.hidden_size} does not match the target's "
                f"{text.hidden_size}; these heads were trained for another model"
            )
        if text.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"SpeculativeConfig.heads: vocab_size {self.config.vocab_size} does not match the target's "
                f"{text.vocab_size}; these heads were trained for another model"
            )

    def save_pretrained(self, folder) -> None:
        """Write the PEFT-style adapter folder (adapter_config.json + adapter_model.safetensors)."""
        from hf_specdec.heads.files import save_medusa

        save_medusa(self, folder)

    @classmethod
    def from_pretrained(cls, path_or_repo_id, revision: str | None = None) -> MedusaHeads:
        """Our adapter folder or a published Medusa checkpoint (converted on load): a local folder or a Hub id."""
        from hf_specdec.heads.files import load_medusa
        from hf_specdec.heads.hub import resolve_folder

        return load_medusa(resolve_folder(path_or_repo_id, revision))

    def push_to_hub(self, repo_id: str, private: bool | None = None, token: str | None = None,
                    commit_message: str | None = None, measured: dict[str, float] | None = None):
        """Upload the adapter folder with a model card (measured acceptance/speedup go in when given)."""
        from hf_specdec.heads.hub import push_medusa

        return push_medusa(self, repo_id, private=private, token=token, commit_message=commit_message,
                           measured=measured)
