"""Draft-model training, an objective of the shared training loop (`skeleton.py`): a draft cut from the target
(`pruned_draft.py`: some of its layers, its embeddings and lm_head shared) learns to imitate the whole target.

The loss is the KL divergence from the target's next-token distribution to the draft's, at every position whose next
token is trained on (the target's logits recomputed from its cached final hidden state through its lm_head). The
draft's own layers and final norm train; the shared embeddings and lm_head stay the target's. With `token_map_size`
the draft drafts over the most frequent trained tokens only, and learns so: the KL is between both distributions
restricted to the map, at positions whose target top token lies in it. The result is saved with `save_pruned_draft`
(only the draft's own tensors, in bfloat16, and its map) and loads with `load_pruned_draft(folder, target)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from hf_specdec.heads.token_map import map_mask, most_frequent_tokens
from hf_specdec.pruned_draft import check_target_layers, pruned_copy, save_pruned_draft
from hf_specdec.training.config import TrainConfig
from hf_specdec.training.generated import TrainingRows
from hf_specdec.training.skeleton import Objective, train
from hf_specdec.training.target_features import FINAL_LAYER, TargetBatch, target_logits


@dataclass
class DraftTrainConfig(TrainConfig):
    target_layers: tuple[int, ...] = field(
        default=(0, 1, -1), metadata={"help": "the target's layers the draft keeps, in order (negative: from the "
                                              "end)"})
    token_map_size: int | None = field(
        default=None, metadata={"help": "draft over the N most frequent trained tokens only (the draft's token map, "
                                        "saved with it; default: the whole vocabulary)"})

    def _check(self) -> None:
        self.target_layers = tuple(int(i) for i in self.target_layers)
        if self.token_map_size is not None and self.token_map_size < 1:
            raise ValueError(f"DraftTrainConfig.token_map_size: expected >= 1, got {self.token_map_size}")
        count = AutoConfig.from_pretrained(self.base).get_text_config(decoder=True).num_hidden_layers
        try:
            check_target_layers(count, self.target_layers)
        except ValueError as error:
            raise ValueError(f"DraftTrainConfig.{error}") from error


class DraftObjective(Objective):
    """The draft plus its distillation loss."""

    feature_layers = FINAL_LAYER

    def __init__(
        self,
        draft: nn.Module,
        # [D] target ids the draft drafts over, ascending, or None: the whole vocabulary
        token_map: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.draft = draft
        self.register_buffer("token_map", token_map)

    def forward(self, batch: TargetBatch, target: nn.Module) -> tuple[torch.Tensor, dict]:
        decoder = self.draft.model
        dtype = decoder.norm.weight.dtype  # the draft's own layers train in float32
        with torch.no_grad():
            embeds = target.get_input_embeddings()(batch.input_ids).to(dtype)  # [B, L, H]
        keep = batch.ahead(1)[1]  # [B, L]: the position predicts a trained token
        count = keep.sum().clamp(min=1)
        lm_head, vocab = target.get_output_embeddings(), None
        if self.token_map is not None:  # a draft with a token map learns over the map, as it drafts
            vocab = map_mask(self.token_map, lm_head.weight.shape[0])  # [V]
            keep = keep & vocab[batch.argmax]
        hidden = decoder(inputs_embeds=embeds).last_hidden_state[keep]  # [M, H]
        log_draft = torch.log_softmax(target_logits(hidden, lm_head, vocab), dim=-1)  # [M, D]: D = V without a map
        with torch.no_grad():
            log_target = torch.log_softmax(target_logits(batch.hidden[keep], lm_head, vocab), dim=-1)
        kl = (log_target.exp() * (log_target - log_draft)).sum(-1)  # [M]
        loss = kl.sum() / keep.sum().clamp(min=1)
        guess = log_draft.argmax(-1)  # [M]
        if self.token_map is not None:
            guess = self.token_map[guess]
        accuracy = (guess == batch.argmax[keep]).float().sum() / count  # top tokens outside a map count as missed
        return loss, {"accuracy": float(accuracy)}

    def save(self, out: Path, target: nn.Module, rows: TrainingRows, result: dict) -> None:
        save_pruned_draft(self.draft, out, token_map=self.token_map)


def make_objective(config: DraftTrainConfig, target: nn.Module, rows: TrainingRows) -> DraftObjective:
    """A draft of the target's `target_layers`, its embeddings and lm_head shared (and frozen with the target), and
    with `token_map_size` its token map (the rows' most frequent trained tokens)."""
    token_map = None
    if config.token_map_size is not None:
        vocab_size = target.config.get_text_config(decoder=True).vocab_size
        token_map = most_frequent_tokens(rows.tokens(), vocab_size, config.token_map_size).to(target.device)
    return DraftObjective(pruned_copy(target, config.target_layers), token_map)


def train_draft(config: DraftTrainConfig) -> dict:
    return train(config, make_objective)
