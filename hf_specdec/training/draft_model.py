"""Draft-model training, an objective of the shared training loop (`skeleton.py`): a draft cut from the target
(`pruned_draft.py`: some of its layers, its embeddings and lm_head shared) learns to imitate the whole target.

The loss is the KL divergence from the target's next-token distribution to the draft's, at every position whose next
token is trained on (the target's logits recomputed from its cached final hidden state through its lm_head). The
draft's own layers and final norm train; the shared embeddings and lm_head stay the target's. The result is saved
with `save_pruned_draft` (only the draft's own tensors, in bfloat16) and loads with `load_pruned_draft(folder,
target)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

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

    def _check(self) -> None:
        self.target_layers = tuple(int(i) for i in self.target_layers)
        count = AutoConfig.from_pretrained(self.base).get_text_config(decoder=True).num_hidden_layers
        try:
            check_target_layers(count, self.target_layers)
        except ValueError as error:
            raise ValueError(f"DraftTrainConfig.{error}") from error


class DraftObjective(Objective):
    """The draft plus its distillation loss."""

    feature_layers = FINAL_LAYER

    def __init__(self, draft: nn.Module) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, batch: TargetBatch, target: nn.Module) -> tuple[torch.Tensor, dict]:
        decoder = self.draft.model
        dtype = decoder.norm.weight.dtype  # the draft's own layers train in float32
        with torch.no_grad():
            embeds = target.get_input_embeddings()(batch.input_ids).to(dtype)  # [B, L, H]
        keep = batch.ahead(1)[1]  # [B, L]: the position predicts a trained token
        hidden = decoder(inputs_embeds=embeds).last_hidden_state[keep]  # [N, H]
        lm_head = target.get_output_embeddings()
        log_draft = torch.log_softmax(target_logits(hidden, lm_head), dim=-1)  # [N, V]
        with torch.no_grad():
            log_target = torch.log_softmax(target_logits(batch.hidden[keep], lm_head), dim=-1)
        count = keep.sum().clamp(min=1)
        kl = (log_target.exp() * (log_target - log_draft)).sum(-1)  # [N]
        loss = kl.sum() / count
        accuracy = (log_draft.argmax(-1) == batch.argmax[keep]).float().sum() / count
        return loss, {"accuracy": float(accuracy)}

    def save(self, out: Path, target: nn.Module, rows: TrainingRows, result: dict) -> None:
        save_pruned_draft(self.draft, out)


def make_objective(config: DraftTrainConfig, target: nn.Module, rows: TrainingRows) -> DraftObjective:
    """A draft of the target's `target_layers`, its embeddings and lm_head shared (and frozen with the target)."""
    return DraftObjective(pruned_copy(target, config.target_layers))


def train_draft(config: DraftTrainConfig) -> dict:
    return train(config, make_objective)
