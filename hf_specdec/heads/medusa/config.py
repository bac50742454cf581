"""MedusaConfig: the shape of a set of Medusa heads, validated on construction; stored in their adapter folder."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hf_specdec.tree.template import TreeTemplate


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
    token_map_size: int | None = field(
        default=None,
        metadata={"help": "with shared_lm_head: draft over this many target ids (the heads' `token_map`) instead of "
                          "the whole vocabulary; None: the whole vocabulary"},
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
        if self.token_map_size is not None:
            _check_positive_int("token_map_size", self.token_map_size)
            if not self.shared_lm_head:
                raise ValueError("MedusaConfig.token_map_size: only for heads that share the target's lm_head "
                                 "(shared_lm_head=True)")
            if self.vocab_size is not None and self.token_map_size > self.vocab_size:
                raise ValueError(f"MedusaConfig.token_map_size: expected at most vocab_size {self.vocab_size}, "
                                 f"got {self.token_map_size}")
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
