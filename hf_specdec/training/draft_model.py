"""Draft-model training, an objective of the shared training loop (`skeleton.py`): a draft cut from the target
(`pruned_draft.py`: some of its layers, its embeddings and lm_head shared) learns to imitate the whole target.

The loss is the KL divergence from the target's next-token distribution to the draft's, at every position whose next
token is trained on (the target's logits recomputed from its cached final hidden state through its lm_head). The
draft's own layers and final norm train; the shared embeddings and lm_head stay the target's. With `token_map_size`
the draft drafts over the most frequent trained tokens only, and learns so: the KL is between both distributions
restricted to the map, at positions whose target top token lies in it. The result is saved with `save_pruned_draft`
(only the draft's own tensors, in bfloat16, and its map) and loads with `load_pruned_draft(folder, target)`.

With `parallel_tokens` N > 1 the draft learns parallel drafting as PARD trains it (arXiv 2504.18583): besides the
text, each row carries N - 1 copies of itself made of mask tokens (`pard_token`) at the text's positions, and the
mask at position j of copy i sees the text up to j - i and the masks of copies 1 .. i - 1 at j - i + 1 .. j - 1: the
chain of i masks a drafting step feeds after the text. It learns the target's distribution at j there, i tokens
further ahead than the text's own position j - i does. One forward over the three copies' attention pattern trains
every offset at once; `SpeculativeConfig(parallel_drafting=True)` then drafts N tokens per draft forward (the mask id
is saved in the draft's config as `pard_token`). `init_draft` starts from a saved draft (PARD adapts a trained one).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from hf_specdec.heads.token_map import TokenMapLMHead, map_mask, most_frequent_tokens
from hf_specdec.pruned_draft import check_target_layers, load_pruned_draft, pruned_copy, save_pruned_draft
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
    parallel_tokens: int = field(
        default=1, metadata={"help": "PARD: also learn to predict 2 .. N tokens ahead from N - 1 mask tokens fed "
                                     "after the text, for parallel drafting of N tokens per forward; 1: an ordinary "
                                     "draft"})
    pard_token: int | None = field(
        default=None, metadata={"help": "with --parallel-tokens > 1: the mask token id (one the text never holds; "
                                        "saved in the draft's config)"})
    init_draft: str | None = field(
        default=None, metadata={"help": "start from the draft saved in this folder (cut from --target-layers, which "
                                        "must match; with its token map) instead of the target's layers"})

    def _check(self) -> None:
        self.target_layers = tuple(int(i) for i in self.target_layers)
        if self.token_map_size is not None and self.token_map_size < 1:
            raise ValueError(f"DraftTrainConfig.token_map_size: expected >= 1, got {self.token_map_size}")
        if isinstance(self.parallel_tokens, bool) or self.parallel_tokens < 1:
            raise ValueError(f"DraftTrainConfig.parallel_tokens: expected an int >= 1, got {self.parallel_tokens!r}")
        if (self.parallel_tokens > 1) != (self.pard_token is not None):
            raise ValueError("DraftTrainConfig.pard_token: the mask token id parallel drafting feeds; give it exactly "
                             f"when parallel_tokens > 1 (parallel_tokens={self.parallel_tokens}, "
                             f"pard_token={self.pard_token})")
        if self.init_draft is not None and self.token_map_size is not None:
            raise ValueError("DraftTrainConfig.init_draft: the saved draft brings its own token map; drop "
                             "token_map_size")
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
        parallel_tokens: int = 1,
        pard_token: int | None = None,
    ) -> None:
        super().__init__()
        self.draft = draft
        self.register_buffer("token_map", token_map)
        self.parallel_tokens, self.pard_token = parallel_tokens, pard_token

    def forward(self, batch: TargetBatch, target: nn.Module) -> tuple[torch.Tensor, dict]:
        decoder = self.draft.model
        dtype = decoder.norm.weight.dtype  # the draft's own layers train in float32
        copies = self.parallel_tokens
        with torch.no_grad():
            embed = target.get_input_embeddings()
            embeds = embed(batch.input_ids).to(dtype)  # [B, L, H]
        batch_size, length = batch.input_ids.shape
        keep = trained = batch.ahead(1)[1]  # [B, L]: the position predicts a trained token
        lm_head, vocab = target.get_output_embeddings(), None
        if self.token_map is not None:  # a draft with a token map learns over the map, as it drafts
            vocab = map_mask(self.token_map, lm_head.weight.shape[0])  # [V]
            keep = keep & vocab[batch.argmax]
        if copies == 1:
            hidden = decoder(inputs_embeds=embeds).last_hidden_state[:, None]  # [B, 1, L, H]
        else:
            with torch.no_grad():
                mask_embed = embed(torch.tensor([self.pard_token], device=embeds.device)).to(dtype)  # [1, H]
            inputs = torch.cat([embeds, mask_embed.expand(batch_size, (copies - 1) * length, -1)], dim=1)
            layout = parallel_attention(length, copies, dtype, embeds.device)  # [1, 1, N L, N L]
            positions = torch.arange(length, device=embeds.device).repeat(copies)[None]  # [1, N L]
            hidden = decoder(inputs_embeds=inputs, attention_mask=layout.expand(batch_size, -1, -1, -1),
                             position_ids=positions.expand(batch_size, -1)).last_hidden_state
            hidden = hidden.reshape(batch_size, copies, length, -1)  # [B, N, L, H]
        with torch.no_grad():
            log_target = torch.log_softmax(target_logits(batch.hidden[keep], lm_head, vocab), dim=-1)  # [M, D]
        total, metrics, counted = 0.0, {}, 0
        for ahead in range(copies):  # copy i at position j: the text up to j - i, then i masks
            rows = keep.clone()
            rows[:, :ahead] = False  # no text before the masks
            log_draft = torch.log_softmax(target_logits(hidden[:, ahead][rows], lm_head, vocab), dim=-1)
            reference = log_target[rows[keep]]
            kl = (reference.exp() * (reference - log_draft)).sum(-1)  # [M_i]
            total = total + kl.sum()
            counted += int(rows.sum())
            guess = log_draft.argmax(-1)
            if self.token_map is not None:
                guess = self.token_map[guess]
            # over every trained position with text before the masks: top tokens outside a map count as missed
            correct = (guess == batch.argmax[rows]).float().sum() / trained[:, ahead:].sum().clamp(min=1)
            metrics["accuracy" if ahead == 0 else f"accuracy_{ahead + 1}"] = float(correct)
        return total / max(counted, 1), metrics

    def save(self, out: Path, target: nn.Module, rows: TrainingRows, result: dict) -> None:
        if self.pard_token is not None:
            self.draft.config.pard_token = self.pard_token
        save_pruned_draft(self.draft, out, token_map=self.token_map)


@functools.lru_cache(maxsize=8)  # the same few row lengths every step
def parallel_attention(
    length: int,
    copies: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """[1, 1, N L, N L] additive mask (0 where attended, the dtype's minimum elsewhere) over the text (copy 0) and
    N - 1 copies of mask tokens, each L long: copy 0 is causal; copy i at position j attends to the text at
    positions <= j - i and to copy m at position j - i + m for 1 <= m <= i (itself included). Kept for later steps of
    the same shape: read it, never write into it."""
    index = torch.arange(copies * length, device=device)
    copy, position = index // length, index % length  # [N L] each
    query_copy, query_pos = copy[:, None], position[:, None]
    key_copy, key_pos = copy[None, :], position[None, :]
    text = (key_copy == 0) & (key_pos <= query_pos - query_copy)
    chain = (key_copy >= 1) & (key_copy <= query_copy) & (key_pos == query_pos - query_copy + key_copy)
    allowed = text | chain
    layout = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return layout[None, None]


def make_objective(config: DraftTrainConfig, target: nn.Module, rows: TrainingRows) -> DraftObjective:
    """A draft of the target's `target_layers`, its embeddings and lm_head shared (and frozen with the target), and
    with `token_map_size` its token map (the rows' most frequent trained tokens)."""
    parallel = dict(parallel_tokens=config.parallel_tokens, pard_token=config.pard_token)
    if config.init_draft is not None:  # its own layers train in float32, as a fresh cut's
        draft = load_pruned_draft(config.init_draft, target)
        layers = check_target_layers(target.config.get_text_config(decoder=True).num_hidden_layers,
                                     config.target_layers)
        if list(layers) != list(draft.config.pruned_draft["target_layers"]):
            raise ValueError(f"DraftTrainConfig.init_draft: the draft in {config.init_draft} was cut from the "
                             f"target's layers {draft.config.pruned_draft['target_layers']}, not target_layers "
                             f"{list(layers)}; pass those layers")
        draft.model.layers.float()
        draft.model.norm.float()
        token_map = draft.lm_head.ids if isinstance(draft.lm_head, TokenMapLMHead) else None
        return DraftObjective(draft.train(), token_map, **parallel)
    token_map = None
    if config.token_map_size is not None:
        vocab_size = target.config.get_text_config(decoder=True).vocab_size
        token_map = most_frequent_tokens(rows.tokens(), vocab_size, config.token_map_size).to(target.device)
    return DraftObjective(pruned_copy(target, config.target_layers), token_map, **parallel)


def train_draft(config: DraftTrainConfig) -> dict:
    return train(config, make_objective)
