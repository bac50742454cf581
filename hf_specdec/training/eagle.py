"""EAGLE head training on a frozen target: EAGLE-1/2 (feature regression) and EAGLE-3 (training-time test), an
objective of the shared training loop (`skeleton.py`: target-written rows, cached target features, accelerate).

* `version="eagle"`: index i of a row feeds `cat(embed(x_{i+1}), f_i + noise)` (f = the target's final normed
  hidden state, noise uniform of width `noise` in training), and the head's output there regresses f_{i+1} (smooth
  L1) and, through the target's lm_head, matches the target's next-token distribution at i + 1 (soft
  cross-entropy, weight `ce_weight`), as EAGLE-1's recipe. A head with a token map (`token_map_size`) drafts over
  the map's ids only, and so learns over them: the cross-entropy is against the target's distribution restricted to
  the map, on positions whose target argmax lies in it (the lm_head's map rows only, a sixth of SmolLM2's at 8192).
* `version="eagle3"`: the training-time test unrolls `ttt_steps` steps. Step 0 reads the fused target features f_i
  with token x_{i+1}; step s reads the head's own step s - 1 output at index i with token x_{i+1+s} (the drafting
  chain the head runs at inference) at position i + 1 + s. Attention at step s sees the step-0 keys causally and,
  from each later step r <= s, only the key at the query's own index (`ttt_attention_mask`). The loss is
  sum_s decay^s * soft CE against the target's distribution restricted to the draft vocabulary, on positions whose
  target argmax lies in that vocabulary.

Only predictions of trained tokens count (a prompt record's continuation; never padding after a row's end). The
target's logits are recomputed per batch from its cached final hidden state through its lm_head (EAGLE-3: through
the draft vocabulary's rows only).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import get_args

import torch
from torch import nn
from transformers import DynamicCache

from hf_specdec.heads.eagle import EagleConfig, EagleHead, EagleVersion
from hf_specdec.heads.token_map import map_mask, most_frequent_tokens
from hf_specdec.training.config import TrainConfig
from hf_specdec.training.generated import TrainingRows
from hf_specdec.training.skeleton import Objective, train
from hf_specdec.training.target_features import TargetBatch, target_logits


@dataclass
class EagleTrainConfig(TrainConfig):
    grad_clip: float = field(default=0.5, metadata={"help": "gradient norm clip (EAGLE's 0.5)"})
    version: EagleVersion = field(default="eagle", metadata={"help": "'eagle' (EAGLE-1/2) or 'eagle3'"})
    noise: float = field(default=0.2, metadata={"help": "eagle: width of the uniform noise on input features"})
    ce_weight: float = field(default=0.1, metadata={"help": "eagle: weight of the soft cross-entropy"})
    ttt_steps: int = field(default=7, metadata={"help": "eagle3: unrolled training-time-test steps"})
    decay: float = field(default=0.8, metadata={"help": "eagle3: loss weight decay per unrolled step"})
    draft_vocab_size: int | None = field(
        default=None, metadata={"help": "eagle3: keep the N most frequent trained tokens (default: all)"})
    token_map_size: int | None = field(
        default=None, metadata={"help": "eagle: draft over the N most frequent trained tokens only (the head's token "
                                        "map; default: the whole vocabulary)"})
    feature_layers: tuple[int, ...] | None = field(
        default=None, metadata={"help": "eagle3: fused target layers (default 2, L//2, L-3)"})
    intermediate_size: int | None = field(default=None, metadata={"help": "head MLP width (default: the target's)"})
    init_from_target: bool = field(
        default=True, metadata={"help": "start from the target's last layer (off: random weights)"})

    def _check(self) -> None:
        self.feature_layers = None if self.feature_layers is None else tuple(int(i) for i in self.feature_layers)
        if self.version not in get_args(EagleVersion):
            raise ValueError(
                f"EagleTrainConfig.version: expected one of {get_args(EagleVersion)}, got {self.version!r}"
            )
        if self.ttt_steps < 1:
            raise ValueError(f"EagleTrainConfig.ttt_steps: expected >= 1, got {self.ttt_steps}")
        for name in ("draft_vocab_size", "intermediate_size", "token_map_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"EagleTrainConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.version == "eagle3" and self.ttt_steps + 1 >= self.seq_len:
            raise ValueError(f"EagleTrainConfig.ttt_steps: expected less than seq_len - 1, got {self.ttt_steps}")
        for name in ("noise", "ce_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"EagleTrainConfig.{name}: expected >= 0, got {getattr(self, name)}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"EagleTrainConfig.decay: expected a value in (0, 1], got {self.decay}")
        if self.version == "eagle" and (self.draft_vocab_size is not None or self.feature_layers is not None):
            raise ValueError("EagleTrainConfig.draft_vocab_size / feature_layers: only for version 'eagle3'")
        if self.version == "eagle3" and self.token_map_size is not None:
            raise ValueError("EagleTrainConfig.token_map_size: only for version 'eagle' (EAGLE-3: draft_vocab_size)")


def build_draft_vocab(
    # [N] token ids of the training data
    token_ids: torch.Tensor,
    vocab_size: int,
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's maps for the `draft_vocab_size` most frequent ids: d2t [D] (target id = draft id + d2t[draft id],
    draft ids in ascending target-id order) and t2d [V] (bool: the target id is in the draft vocabulary)."""
    kept = most_frequent_tokens(token_ids, vocab_size, draft_vocab_size)  # [D]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size), t2d


def ttt_attention_mask(width: int, step: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, W, (step + 1) * W] additive mask for unrolled step `step` over keys [step 0 | step 1 | ... | step]:
    query i sees step-0 keys j <= i, and from each later step only the key at its own index i."""
    index = torch.arange(width, device=device)
    causal = index[None, :] <= index[:, None]  # [W, W]
    own = index[None, :] == index[:, None]  # [W, W]
    allowed = torch.cat([causal] + [own] * step, dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def soft_cross_entropy(
    # [..., V] head logits
    logits: torch.Tensor,
    # [..., V] target probabilities
    target_probs: torch.Tensor,
) -> torch.Tensor:
    """[...]: -sum_v p(v) log q(v)."""
    return -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


class EagleObjective(Objective):
    """The trained head plus its loss."""

    def __init__(self, head: EagleHead, config: EagleTrainConfig, feature_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.head = head
        self.feature_layers = feature_layers
        self.min_batch_length = config.ttt_steps + 2 if head.config.version == "eagle3" else 2
        self.noise, self.ce_weight = config.noise, config.ce_weight
        self.ttt_steps, self.decay = config.ttt_steps, config.decay

    def forward(self, batch: TargetBatch, target: nn.Module) -> tuple[torch.Tensor, dict]:
        dtype = self.head.dtype  # the head trains in its own dtype (float32), whatever the target's
        with torch.no_grad():
            embeds = target.get_input_embeddings()(batch.input_ids).to(dtype)  # [B, L, H]
        batch = replace(batch, features=batch.features.to(dtype))
        lm_head = target.get_output_embeddings()
        if self.head.config.version == "eagle":
            return self._eagle_loss(batch, embeds, lm_head)
        return self._eagle3_loss(batch, embeds, lm_head)

    def _eagle_loss(self, batch: TargetBatch, embeds: torch.Tensor, lm_head: nn.Linear):
        features, length = batch.features, embeds.shape[1]
        inputs = features[:, :-1]  # [B, L-1, H]: f_i
        if self.noise > 0 and self.training:  # held-out measurements read the features as they are
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * self.noise
        positions = torch.arange(1, length, device=embeds.device).expand(embeds.shape[0], -1)  # [B, L-1]
        hidden = self.head(embeds[:, 1:], inputs, positions, attention_mask=None)  # [B, L-1, H]
        keep = batch.ahead(1)[1][:, :-1]  # [B, L-1]: x_{i+1} is a trained token
        hidden = hidden[keep]  # [N, H]
        count = keep.sum().clamp(min=1)
        regression = nn.functional.smooth_l1_loss(hidden.float(), features[:, 1:][keep].float(), reduction="none")
        regression = regression.mean(-1).sum() / count
        top, target_hidden = batch.argmax[:, 1:][keep], batch.hidden[:, 1:][keep]  # [N], [N, H]
        token_map = self.head.token_map  # [D] or None: the whole vocabulary
        vocab = None if token_map is None else map_mask(token_map, lm_head.weight.shape[0])  # [V] bool
        if vocab is not None:  # the head drafts over its token map: its loss is over the map, as it drafts
            draftable = vocab[top]  # [N]: the target's top token can be drafted
            hidden, top, target_hidden = hidden[draftable], top[draftable], target_hidden[draftable]
        logits = target_logits(hidden, lm_head, vocab)  # [M, D]: D = V without a map, M = N then
        with torch.no_grad():
            target_probs = torch.softmax(target_logits(target_hidden, lm_head, vocab), dim=-1)  # [M, D]
        ce = soft_cross_entropy(logits, target_probs).sum() / max(len(top), 1)
        guess = logits.argmax(-1) if token_map is None else token_map[logits.argmax(-1)]  # [M] target ids
        accuracy = (guess == top).float().sum() / count  # a target token outside the map counts as missed
        loss = regression + self.ce_weight * ce
        return loss, {"regression": float(regression.detach()), "ce": float(ce.detach()),
                      "accuracy": float(accuracy)}

    def _eagle3_loss(self, batch: TargetBatch, embeds: torch.Tensor, lm_head: nn.Linear):
        head, size, length = self.head, embeds.shape[0], embeds.shape[1]
        width = length - self.ttt_steps  # every unrolled step has a target for all W indices
        with torch.no_grad():
            # [B, L]: the target's distribution after the position predicts a trained token, its top one draftable
            trained = head.t2d[batch.argmax] & batch.ahead(1)[1]
            draft_target = target_logits(batch.hidden[trained], lm_head, head.t2d)  # [M, D] at those positions
            draft_probs = torch.softmax(draft_target, dim=-1)
            draft_top = draft_target.argmax(-1)  # [M]
            row = torch.full(trained.shape, -1, device=trained.device)  # [B, L]: the position's row of the M
            row[trained] = torch.arange(len(draft_top), device=trained.device)
        cache = DynamicCache()
        hidden = batch.features[:, :width]  # [B, W, F]
        total, accuracies, losses = embeds.new_zeros((), dtype=torch.float32), [], []
        for step in range(self.ttt_steps):
            window = slice(1 + step, 1 + step + width)  # tokens x_{i+1+s} and their next-token targets
            positions = torch.arange(window.start, window.stop, device=embeds.device).expand(size, -1)  # [B, W]
            mask = ttt_attention_mask(width, step, head.dtype, embeds.device).expand(size, -1, -1, -1)
            hidden = head(embeds[:, window], hidden, positions, mask, cache=cache,
                          from_target=step == 0)  # [B, W, H]
            keep = trained[:, window]  # [B, W]
            rows, count = row[:, window][keep], keep.sum().clamp(min=1)  # [N]
            logits = head.lm_head(head.norm(hidden[keep])).float()  # [N, D]
            ce = soft_cross_entropy(logits, draft_probs[rows]).sum() / count
            total = total + self.decay**step * ce
            accuracies.append(float((logits.argmax(-1) == draft_top[rows]).float().sum() / count))
            losses.append(float(ce.detach()))
        # accuracy: step 0's top-1 agreement with the target; the lists hold every unrolled step
        return total, {"accuracy": accuracies[0], "accuracy_steps": accuracies, "ce_steps": losses}

    def save(self, out: Path, target: nn.Module, rows: TrainingRows, result: dict) -> None:
        self.head.save_pretrained(out)


def init_head_from_target(head: EagleHead, target: nn.Module) -> list[str]:
    """Copy the target's last decoder layer into the head's layer wherever names and shapes match (and, for EAGLE-3,
    its final norm and the draft vocabulary's rows of its lm_head). Returns the names of the copied tensors."""
    last = target.model.layers[-1].state_dict()
    layer = head.layers[0] if head.config.version == "eagle" else head.midlayer
    copied = []
    with torch.no_grad():
        for name, tensor in layer.state_dict().items():
            if name in last and last[name].shape == tensor.shape:
                tensor.copy_(last[name])
                copied.append(name)
        if head.config.version == "eagle3":
            head.norm.weight.copy_(target.model.norm.weight)
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[head.t2d])
            copied += ["norm.weight", "lm_head.weight"]
    return copied


def _head_config(config: EagleTrainConfig, target: nn.Module) -> EagleConfig:
    overrides = {"base_model_name_or_path": str(config.base)}
    if config.intermediate_size is not None:
        overrides["intermediate_size"] = config.intermediate_size
    if config.version == "eagle3":
        if config.feature_layers is not None:
            overrides["feature_layers"] = config.feature_layers
        if config.draft_vocab_size is not None:
            overrides["draft_vocab_size"] = config.draft_vocab_size
    return EagleConfig.for_target(target, config.version, **overrides)


def make_objective(config: EagleTrainConfig, target: nn.Module, rows: TrainingRows) -> EagleObjective:
    """A new head for the target (its draft vocabulary the rows' most frequent trained tokens, its layer a copy of
    the target's last one unless `init_from_target` is off), wrapped in its loss."""
    head_config = _head_config(config, target)
    if config.version == "eagle3" and rows.input_ids.shape[1] <= config.ttt_steps + 1:
        raise ValueError(f"EagleTrainConfig.ttt_steps: expected less than the rows' length - 1 "
                         f"({rows.input_ids.shape[1]} tokens), got {config.ttt_steps}")
    head = EagleHead(head_config)
    if config.version == "eagle3" and head_config.draft_vocab_size is not None:
        d2t, t2d = build_draft_vocab(rows.tokens(), head_config.vocab_size, head_config.draft_vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    if config.token_map_size is not None:
        head.set_token_map(most_frequent_tokens(rows.tokens(), head_config.vocab_size, config.token_map_size))
    if config.init_from_target:
        init_head_from_target(head, target)
    layers = head_config.target_feature_layers(target.config.get_text_config(decoder=True).num_hidden_layers)
    return EagleObjective(head.to(target.device), config, tuple(layers))


def train_eagle(config: EagleTrainConfig) -> dict:
    return train(config, make_objective)
