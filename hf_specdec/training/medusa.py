"""Medusa training, an objective of the shared training loop (`skeleton.py`): stage 1 (Medusa-1) trains the heads on
a frozen target, from its cached final hidden states; stage 2 (Medusa-2) trains them together with a peft LoRA on
the target, which then runs on every batch.

Head i learns the token i + 2 positions after each hidden state (the rows' tokens: by default the target's own
text). Stage 1: loss = sum_i decay^i * CE_i. Stage 2: loss = loss_0 + heads_coef * sum_i decay^i * CE_i, where loss_0
is the LoRA model's next-token cross-entropy, or with `self_distillation` its KL divergence from the same model with
the adapters disabled (the original target); the heads learn at learning_rate * medusa_lr_multiplier. Each head's
own projection starts as a copy of the target's lm_head and its residual blocks at zero, so training starts from
"the target's own next-token guess". Only predictions of trained tokens count. Heads with a token map (shared
lm_head) draft over the map's ids only and learn so: the cross-entropy is over the lm_head's rows at the map, on
labels inside it. At the end a static tree is fitted to the heads' rank accuracies (as they draft: over the map)
measured on training rows and saved in their config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from hf_specdec.heads.medusa import LORA_FOLDER, MedusaConfig, MedusaHeads, fit_tree
from hf_specdec.heads.token_map import TokenMapLMHead, map_index, most_frequent_tokens
from hf_specdec.training.config import TrainConfig
from hf_specdec.training.generated import TrainingRows
from hf_specdec.training.skeleton import Objective, train
from hf_specdec.training.target_features import FINAL_LAYER, TargetBatch, run_target, target_batch

LLAMA_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TREE_MAX_RANK = 10  # candidates per head considered when fitting the tree
TREE_FIT_BATCHES = 4  # batches of rows the rank accuracies are measured on


@dataclass
class MedusaTrainConfig(TrainConfig):
    stage: int = field(default=1, metadata={"help": "1: heads on a frozen target (Medusa-1); 2: heads plus a LoRA on "
                                                    "the target (Medusa-2)"})
    num_heads: int = field(default=4, metadata={"help": "heads to train"})
    num_layers: int = field(default=1, metadata={"help": "residual blocks per head"})
    shared_lm_head: bool = field(
        default=False, metadata={"help": "heads project with the target's lm_head (small files) instead of their own"})
    token_map_size: int | None = field(
        default=None, metadata={"help": "with shared_lm_head: draft over the N most frequent trained tokens only "
                                        "(the heads' token map; default: the whole vocabulary)"})
    decay: float = field(default=0.8, metadata={"help": "loss weight decay per head"})
    tree_nodes: int = field(default=32, metadata={"help": "nodes of the tree fitted to the trained heads (0: none)"})
    lora_r: int = field(default=8, metadata={"help": "stage 2: LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "stage 2: LoRA alpha"})
    lora_dropout: float = field(default=0.05, metadata={"help": "stage 2: LoRA dropout"})
    lora_target_modules: list[str] = field(default_factory=lambda: list(LLAMA_LORA_MODULES),
                                           metadata={"help": "stage 2: module names the LoRA wraps"})
    self_distillation: bool = field(
        default=False, metadata={"help": "stage 2: loss_0 = KL from the target itself, not next-token CE"})
    heads_coef: float = field(default=0.2, metadata={"help": "stage 2: weight of the heads' loss"})
    medusa_lr_multiplier: float = field(default=4.0, metadata={"help": "stage 2: heads' learning rate / the LoRA's"})

    def _check(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(f"MedusaTrainConfig.stage: expected 1 or 2, got {self.stage!r}")
        for name in ("num_heads", "num_layers", "lora_r", "lora_alpha"):
            if getattr(self, name) < 1:
                raise ValueError(f"MedusaTrainConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.token_map_size is not None and (self.token_map_size < 1 or not self.shared_lm_head):
            raise ValueError(f"MedusaTrainConfig.token_map_size: expected >= 1 with shared_lm_head, got "
                             f"{self.token_map_size} (shared_lm_head={self.shared_lm_head})")
        if self.tree_nodes < 0:
            raise ValueError(f"MedusaTrainConfig.tree_nodes: expected >= 0, got {self.tree_nodes}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"MedusaTrainConfig.decay: expected a value in (0, 1], got {self.decay}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"MedusaTrainConfig.lora_dropout: expected a value in [0, 1), got {self.lora_dropout}")
        for name in ("heads_coef", "medusa_lr_multiplier"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MedusaTrainConfig.{name}: expected > 0, got {getattr(self, name)}")
        if not self.lora_target_modules:
            raise ValueError("MedusaTrainConfig.lora_target_modules: expected at least one module name")
        if self.self_distillation and self.stage != 2:
            raise ValueError("MedusaTrainConfig.self_distillation: only stage 2 trains the backbone; use stage=2")


def medusa_labels(batch: TargetBatch, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The positions some head learns from ([B, L] bool) and there, in order, head i's label (token t + 2 + i) and
    whether it is trained on ([N, K] each)."""
    ahead = [batch.ahead(2 + i) for i in range(num_heads)]
    labels = torch.stack([ids for ids, _ in ahead], dim=-1)  # [B, L, K]
    trained = torch.stack([trained for _, trained in ahead], dim=-1)  # [B, L, K]
    keep = trained.any(-1)
    return keep, labels[keep], trained[keep]


def medusa_loss(
    # [N, K, V]: the heads' logits at N positions
    head_logits: torch.Tensor,
    # [N, K]: head i's label at each position (token t + 2 + i)
    labels: torch.Tensor,
    # [N, K] bool: the label is trained on
    trained: torch.Tensor,
    decay: float,
) -> tuple[torch.Tensor, list[float]]:
    """Weighted sum over heads of the cross-entropy of head i against its trained labels; and each head's loss."""
    total, per_head = head_logits.new_zeros((), dtype=torch.float32), []
    for i in range(head_logits.shape[1]):
        loss = torch.nn.functional.cross_entropy(head_logits[:, i].float(), labels[:, i], reduction="none")
        weight = trained[:, i].float()
        loss = (loss * weight).sum() / weight.sum().clamp(min=1)
        total = total + decay**i * loss
        per_head.append(float(loss.detach()))
    return total, per_head


def backbone_loss(
    # [B, L, V]: the LoRA model's logits
    logits: torch.Tensor,
    # [B, L]
    input_ids: torch.Tensor,
    # [B, L] bool: the token is trained on
    trained: torch.Tensor,
    # [B, L, V]: the target's own logits (adapters disabled), or None for the plain next-token loss
    teacher_logits: torch.Tensor | None,
) -> torch.Tensor:
    """Medusa-2's loss_0 at positions whose next token is trained on: next-token cross-entropy, or KL(target || LoRA
    model) (self-distillation)."""
    vocab = logits.shape[-1]
    weight = trained[:, 1:].reshape(-1).float()  # [B * (L - 1)]
    if teacher_logits is None:
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab).float(), input_ids[:, 1:].reshape(-1), reduction="none")
    else:
        loss = torch.nn.functional.kl_div(
            logits[:, :-1].reshape(-1, vocab).float().log_softmax(-1),
            teacher_logits[:, :-1].reshape(-1, vocab).float().log_softmax(-1), log_target=True, reduction="none",
        ).sum(-1)
    return (loss * weight).sum() / weight.sum().clamp(min=1)


@torch.no_grad()
def rank_accuracy(
    # [N, K, V]: the heads' logits at N positions
    head_logits: torch.Tensor,
    # [N, K]: head i's label at each position (token t + 2 + i)
    labels: torch.Tensor,
    # [N, K] bool: the label is trained on
    trained: torch.Tensor,
    max_rank: int,
) -> torch.Tensor:
    """[K, max_rank]: how often head i's rank-r candidate is its label (over trained labels)."""
    rows = []
    for i in range(head_logits.shape[1]):
        candidates = head_logits[:, i].topk(max_rank, dim=-1).indices  # [N, R]
        hits = (candidates == labels[:, i, None])[trained[:, i]]  # [M, R]
        rows.append(hits.float().mean(0) if len(hits) else hits.new_zeros(max_rank, dtype=torch.float32))
    return torch.stack(rows)


class MedusaObjective(Objective):
    """The heads (and in stage 2 the LoRA model) plus their loss."""

    def __init__(self, heads: MedusaHeads, config: MedusaTrainConfig, model: nn.Module | None) -> None:
        super().__init__()
        self.heads = heads
        self.config = config
        self.model = model  # stage 2: the peft LoRA model around the target
        self.feature_layers = FINAL_LAYER if model is None else None

    def forward(self, batch: TargetBatch, target: nn.Module) -> tuple[torch.Tensor, dict]:
        lm_head = target.get_output_embeddings()
        keep, labels, trained = medusa_labels(batch, self.heads.config.num_heads)
        token_map = self.heads.token_map  # [D] or None
        if token_map is not None:  # the heads draft over the map's ids only, and learn over them
            vocab_size = lm_head.weight.shape[0]
            lm_head = TokenMapLMHead(lm_head, token_map, vocab_size, compact=True)
            labels = map_index(token_map, vocab_size)[labels]  # [N, K]: indices in the map, -1 outside it
            trained = trained & (labels >= 0)
            labels = labels.clamp(min=0)
        if self.model is None:
            hidden = batch.features[keep].to(self.heads.dtype)  # [N, H]
            loss, per_head = medusa_loss(self.heads(hidden, lm_head), labels, trained, self.config.decay)
            return loss, {"head_loss": per_head}
        out = self.model(batch.input_ids, output_hidden_states=True)
        teacher = None
        if self.config.self_distillation:
            with torch.no_grad(), self.model.disable_adapter():
                teacher = self.model(batch.input_ids).logits
        heads_loss, per_head = medusa_loss(self.heads(out.hidden_states[-1][keep], lm_head), labels, trained,
                                           self.config.decay)
        backbone = backbone_loss(out.logits, batch.input_ids, batch.trained, teacher)
        return backbone + self.config.heads_coef * heads_loss, {"backbone_loss": float(backbone.detach()),
                                                               "head_loss": per_head}

    def param_groups(self, learning_rate: float) -> list[dict]:
        heads = {"params": list(self.heads.parameters()), "lr": learning_rate}
        if self.model is None:
            return [heads]
        lora = [p for p in self.model.parameters() if p.requires_grad]
        return [{"params": lora, "lr": learning_rate},
                {**heads, "lr": learning_rate * self.config.medusa_lr_multiplier}]

    def save(self, out: Path, target: nn.Module, rows: TrainingRows, result: dict) -> None:
        heads = self.heads.eval()
        model = target if self.model is None else self.model.eval()
        if self.config.tree_nodes:
            accuracy = self._rank_accuracy(model, target.get_output_embeddings(), rows)
            heads.config = replace(heads.config, tree_paths=fit_tree(accuracy, self.config.tree_nodes))
            result["rank_accuracy"] = accuracy.tolist()
        heads.save_pretrained(out)
        if self.model is not None:
            self.model.save_pretrained(out / LORA_FOLDER)

    @torch.no_grad()
    def _rank_accuracy(self, model: nn.Module, lm_head: nn.Module, rows: TrainingRows) -> torch.Tensor:
        """[K, TREE_MAX_RANK]: the heads' rank accuracies on seeded batches of the training rows."""
        generator = torch.Generator().manual_seed(self.config.seed + 29)
        total = 0
        for _ in range(TREE_FIT_BATCHES):
            index = torch.randint(0, len(rows.input_ids), (self.config.batch_size,), generator=generator)
            batch = target_batch(model, rows, index, lm_head.weight.device, None, None)
            if self.model is None:
                hidden = run_target(model, FINAL_LAYER, batch.input_ids)[1]
            else:
                hidden = model(batch.input_ids, output_hidden_states=True).hidden_states[-1]
            keep, labels, trained = medusa_labels(batch, self.heads.config.num_heads)
            logits = self.heads(hidden[keep].to(self.heads.dtype), self.heads.draft_lm_head(lm_head))  # as drafted
            total = total + rank_accuracy(logits, labels, trained, TREE_MAX_RANK)
        return total / TREE_FIT_BATCHES


def make_objective(config: MedusaTrainConfig, target: nn.Module, rows: TrainingRows) -> MedusaObjective:
    """New heads for the target (their projections copies of its lm_head), and in stage 2 a LoRA around it."""
    text = target.config.get_text_config(decoder=True)
    heads = MedusaHeads(MedusaConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                                     num_heads=config.num_heads, num_layers=config.num_layers,
                                     shared_lm_head=config.shared_lm_head, base_model_name_or_path=str(config.base)))
    if config.token_map_size is not None:
        heads.set_token_map(most_frequent_tokens(rows.tokens(), text.vocab_size, config.token_map_size))
    if not config.shared_lm_head:
        with torch.no_grad():
            for head in heads.heads:
                head[-1].weight.copy_(target.get_output_embeddings().weight)
    model = None
    if config.stage == 2:
        lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=list(config.lora_target_modules), task_type="CAUSAL_LM")
        model = get_peft_model(target, lora).train()
    return MedusaObjective(heads.to(target.device), config, model)


def train_medusa(config: MedusaTrainConfig) -> dict:
    return train(config, make_objective)
