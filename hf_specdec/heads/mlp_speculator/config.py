"""MlpSpeculatorConfig: the shape of an MLP speculator, validated on construction; stored in its adapter folder. The
field names are those of IBM fms-extras' published `config.json` (`emb_dim`, `inner_dim`, `n_predict`, ...), so the
published layout converts field for field."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


def default_top_k_tokens_per_head(n_predict: int) -> list[int]:
    """5, 4, 3, ... candidates per stage (at least 1): fms-extras' [5, 4, 3] for its three stages."""
    return [max(1, 5 - i) for i in range(n_predict)]


@dataclass
class MlpSpeculatorConfig:
    emb_dim: int = field(metadata={"help": "the target's hidden size: the width of the state the speculator reads"})
    vocab_size: int = field(metadata={"help": "the target's vocabulary size"})
    n_predict: int = field(default=3, metadata={"help": "stages: stage i guesses the token i + 1 after the last one"})
    inner_dim: int = field(default=0, metadata={"help": "width of the speculator's state (0: emb_dim)"})
    tie_weights: bool = field(
        default=False, metadata={"help": "every stage shares one embedding, norm and lm_head, and the stages after "
                                         "the first one projection"})
    scale_input: bool = field(
        default=False, metadata={"help": "normalise the target's hidden state (no affine) and divide it by sqrt(2) "
                                         "before the first stage"})
    top_k_tokens_per_head: list[int] | None = field(
        default=None, metadata={"help": "candidates per stage when drafting a tree (default 5, 4, 3, ...)"})
    n_candidates: int = field(default=5, metadata={"help": "the tree's best paths kept (by summed log-probability)"})
    shared_vocab: bool = field(
        default=False, metadata={"help": "embed tokens with the target's input embeddings and score them with its "
                                         "lm_head, each through a learned map (emb_map, head_map), instead of "
                                         "vocabulary-sized matrices of the speculator's own (those parameters "
                                         "shrink by vocab_size / emb_dim); the speculator then needs its target to "
                                         "run"})
    token_map_size: int | None = field(
        default=None, metadata={"help": "with shared_vocab: draft over this many target ids (the speculator's "
                                        "token_map) instead of the whole vocabulary"})
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "the target it was trained on"})
    revision: str | None = field(default=None, metadata={"help": "the target's revision"})

    def __post_init__(self) -> None:
        for name in ("emb_dim", "vocab_size", "n_predict", "n_candidates"):
            _check_int(name, getattr(self, name), 1)
        _check_int("inner_dim", self.inner_dim, 0)
        for name in ("tie_weights", "scale_input", "shared_vocab"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MlpSpeculatorConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("MlpSpeculatorConfig.tie_weights: ties the weights of several stages; n_predict is 1 "
                             "(set tie_weights=False or n_predict >= 2)")
        if self.top_k_tokens_per_head is None:
            self.top_k_tokens_per_head = default_top_k_tokens_per_head(self.n_predict)
        top_k = self.top_k_tokens_per_head
        if (not isinstance(top_k, list | tuple) or len(top_k) != self.n_predict
                or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in top_k)):
            raise ValueError(f"MlpSpeculatorConfig.top_k_tokens_per_head: expected {self.n_predict} ints >= 1 (one "
                             f"per stage, n_predict {self.n_predict}), got {top_k!r}")
        self.top_k_tokens_per_head = list(top_k)
        if self.token_map_size is not None:
            _check_int("token_map_size", self.token_map_size, 1)
            if not self.shared_vocab:
                raise ValueError("MlpSpeculatorConfig.token_map_size: only for a speculator that scores with the "
                                 "target's lm_head (shared_vocab=True)")
            if self.token_map_size > self.vocab_size:
                raise ValueError(f"MlpSpeculatorConfig.token_map_size: expected at most vocab_size "
                                 f"{self.vocab_size}, got {self.token_map_size}")
        if self.n_candidates > math.prod(top_k):
            raise ValueError(f"MlpSpeculatorConfig.n_candidates: expected at most the tree's {math.prod(top_k)} "
                             f"paths (the product of top_k_tokens_per_head {top_k}), got {self.n_candidates}")

    @property
    def inner_size(self) -> int:
        """The width of the speculator's state."""
        return self.inner_dim or self.emb_dim

    @property
    def state_weight(self) -> float:
        """fms-extras' weight of the projected state: 0.5 ** (0.5 / n_predict), so that after the last stage the
        target's state accounts for half of the state's magnitude in expectation."""
        return 0.5 ** (0.5 / self.n_predict)

    @property
    def emb_weight(self) -> float:
        """fms-extras' weight of the token embedding: sqrt((1 - state_weight^2) * inner_size / 2)."""
        return math.sqrt((1 - self.state_weight**2) * self.inner_size / 2)

    def check_sizes(self, hidden_size: int, vocab_size: int, owner: str) -> None:
        """Clear errors when a target of `hidden_size` and `vocab_size` is not the one these sizes were made for;
        `owner` names what the user passed (e.g. "SpeculativeConfig.heads")."""
        for name, mine, theirs in (("emb_dim", self.emb_dim, hidden_size), ("vocab_size", self.vocab_size, vocab_size)):
            if mine != theirs:
                what = "hidden_size" if name == "emb_dim" else name
                raise ValueError(f"{owner}: the MLP speculator's {name} {mine} does not match the target's {what} "
                                 f"{theirs}; it was trained for another model")

    def to_dict(self) -> dict:
        return asdict(self)


def _check_int(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"MlpSpeculatorConfig.{name}: expected an int >= {least}, got {value!r}")
