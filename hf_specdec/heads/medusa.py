"""Medusa heads (Cai et al. 2024): K small heads on the target's final hidden state; head i guesses the token
i + 2 positions after that state (the target's own lm_head gives the next one).

Each head is `num_layers` residual blocks, x + SiLU(W x + b), each with its own weights (the original code's
`[ResBlock] * n` shares them by accident), then a vocabulary projection: its own (Medusa v0.1/1.0), or, with
`shared_lm_head`, the target's lm_head (the "version 2" layout: the heads hold only their residual blocks). Block
weights start at zero, so an untrained head is the identity followed by the projection.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from hf_specdec.tree.template import TreeTemplate, rank_budget_paths

MAX_DEFAULT_TREE_DEPTH = 4


@dataclass
class MedusaConfig:
    hidden_size: int = field(metadata={"help": "the target's hidden size"})
    vocab_size: int | None = field(
        metadata={"help": "the target's vocabulary size; may be None (unknown) only with shared_lm_head"}
    )
    num_heads: int = field(default=4, metadata={"help": "heads: head i guesses the token i + 2 ahead"})
    num_layers: int = field(default=1, metadata={"help": "residual blocks per head, each with its own weights"})
    shared_lm_head: bool = field(
        default=False, metadata={"help": "project with the target's lm_head instead of a per-head one ('version 2')"}
    )
    tree_paths: list[list[int]] | None = field(
        default=None, metadata={"help": "a static tree fitted to these heads (rank paths), or None"}
    )
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "the target the heads were trained on"})
    revision: str | None = field(default=None, metadata={"help": "the target's revision"})

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_layers"):
            _check_positive_int(name, getattr(self, name))
        if not isinstance(self.shared_lm_head, bool):
            raise ValueError(f"MedusaConfig.shared_lm_head: expected a bool, got {self.shared_lm_head!r}")
        if self.vocab_size is not None or not self.shared_lm_head:
            _check_positive_int("vocab_size", self.vocab_size)
        if self.tree_paths is not None:
            self.tree_paths = [list(path) for path in self.tree_paths]
            try:
                depth = TreeTemplate.from_paths(self.tree_paths).max_depth
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"MedusaConfig.tree_paths: expected a list of rank paths forming a tree: {error}"
                ) from None
            if depth > self.num_heads:
                raise ValueError(
                    f"MedusaConfig.tree_paths: depth {depth} needs as many heads, num_heads is {self.num_heads}"
                )

    def to_dict(self) -> dict:
        return asdict(self)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MedusaConfig.{name}: expected an int >= 1, got {value!r}")


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
                *([] if config.shared_lm_head else [nn.Linear(config.hidden_size, config.vocab_size, bias=False)]),
            )
            for _ in range(config.num_heads)
        )

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
        return lm_head(outputs.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype))

    def tree(self) -> list[list[int]]:
        """The static tree for these heads: the one fitted to them in training, else every path over the first
        (up to 4) heads whose ranks sum to at most 2 (for 4 heads: the built-in 34-node default tree)."""
        if self.config.tree_paths is not None:
            return self.config.tree_paths
        depth = min(self.config.num_heads, MAX_DEFAULT_TREE_DEPTH)
        return [list(p) for p in rank_budget_paths(depth=depth, rank_budget=2)]

    def check_target(self, target: nn.Module) -> None:
        """Clear errors when the heads were made for another model shape."""
        text = target.config.get_text_config(decoder=True)
        sizes = {"hidden_size": text.hidden_size, "vocab_size": text.vocab_size}
        if self.config.shared_lm_head:
            lm_head = target.get_output_embeddings()
            if lm_head is None:
                raise ValueError("SpeculativeConfig.heads: these heads share the target's lm_head; the target has none")
            sizes = {"hidden_size": lm_head.weight.shape[1], "vocab_size": lm_head.weight.shape[0]}
        for name, expected in sizes.items():
            mine = getattr(self.config, name)
            if mine is not None and mine != expected:
                raise ValueError(
                    f"SpeculativeConfig.heads: {name} {mine} does not match the target's {expected}; "
                    "these heads were trained for another model"
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
        from hf_specdec.heads.hub import medusa_card, push_folder

        return push_folder(repo_id, self.save_pretrained, medusa_card(self, repo_id, measured),
                           "Upload Medusa heads (hf_specdec)", private, token, commit_message)


def fit_tree(
    # [K, R]: P(head i's rank-r candidate is the token that follows), measured on data
    rank_accuracy: torch.Tensor,
    num_nodes: int,
) -> list[list[int]]:
    """Medusa's tree fit: a path's chance of being accepted whole is the product of its heads' rank accuracies
    (heads taken as independent); keep the `num_nodes` likeliest paths. A path is never likelier than its prefix,
    and ties go to the shorter path, so the result is a tree."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"fit_tree: num_nodes: expected an int >= 1, got {num_nodes!r}")
    accuracy = rank_accuracy.double().tolist()
    scored: list[tuple[float, tuple[int, ...]]] = []
    level: list[tuple[float, tuple[int, ...]]] = [(1.0, ())]
    for head in accuracy:
        # only the num_nodes likeliest paths of a level can have children among the num_nodes likeliest overall
        level = sorted(((p * a, path + (r,)) for p, path in level for r, a in enumerate(head)),
                       key=lambda item: (-item[0], item[1]))[:num_nodes]
        scored.extend(level)
    scored.sort(key=lambda item: (-item[0], len(item[1]), item[1]))
    return [list(path) for _, path in scored[:num_nodes]]
