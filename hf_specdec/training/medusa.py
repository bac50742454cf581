"""Medusa training on accelerate: stage 1 (Medusa-1) trains the heads on a frozen target; stage 2 (Medusa-2) trains
them together with a peft LoRA on the target.

Head i learns the token i + 2 positions after each hidden state. Stage 1: loss = sum_i decay^i * CE_i. Stage 2:
loss = loss_0 + heads_coef * sum_i decay^i * CE_i, where loss_0 is the LoRA model's next-token cross-entropy, or
with `self_distillation` its KL divergence from the same model with the adapters disabled (the original target);
the heads learn at learning_rate * medusa_lr_multiplier. Each head's own projection starts as a copy of the
target's lm_head and its residual blocks at zero, so training starts from "the target's own next-token guess".

Runs single process, multi-process CPU (gloo) and multi-GPU under `accelerate launch`; checkpoints every
`save_every` steps and resumes from the last one. Data: local text files, or .jsonl records with a "text" or an
"input_ids" field, concatenated with EOS between documents. With `distill_samples`, the target first continues
that many windows of the data greedily and the heads train on its own output, the text they will see at decode
time (written once to OUT/self_distillation.jsonl and reused on resume). At the end a static tree is fitted to the
heads' measured rank accuracies and saved in their config.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_specdec.heads.files import LORA_FOLDER
from hf_specdec.heads.medusa import MedusaConfig, MedusaHeads, fit_tree
from hf_specdec.training import checkpoints
from hf_specdec.training.data import check_inputs, token_stream, windows

DISTILLATION_FILE = "self_distillation.jsonl"
LLAMA_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TREE_MAX_RANK = 10  # candidates per head considered when fitting the tree
TREE_FIT_BATCHES = 4  # batches of windows the rank accuracies are measured on
DISTILL_PROMPT_TOKENS = 64  # short real prompts: most of what the heads learn is the target's own text
DISTILL_BATCH_SIZE = 32


@dataclass
class MedusaTrainConfig:
    base: Path = field(metadata={"help": "target model folder"})
    data: list[Path] = field(metadata={"help": "text files, or .jsonl with a 'text' or 'input_ids' field"})
    out: Path = field(metadata={"help": "output folder: the adapter (stage 2: plus lora/), checkpoints in checkpoint/"})
    tokenizer: Path | None = field(default=None, metadata={"help": "tokenizer folder (default: the base folder)"})
    stage: int = field(default=1, metadata={"help": "1: heads on a frozen target; 2: heads plus a LoRA on the target"})
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = field(default=False, metadata={"help": "heads project with the target's lm_head"})
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 1e-3
    decay: float = 0.8
    save_every: int = 100
    seed: int = 0
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (None: torch's choice)"})
    distill_samples: int = field(default=0, metadata={"help": "train on this many greedy continuations by the target"})
    distill_new_tokens: int = field(default=128, metadata={"help": "tokens per self-distillation continuation"})
    tree_nodes: int = field(default=32, metadata={"help": "nodes of the tree fitted to the trained heads (0: none)"})
    lora_r: int = field(default=8, metadata={"help": "stage 2: LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "stage 2: LoRA alpha"})
    lora_dropout: float = field(default=0.05, metadata={"help": "stage 2: LoRA dropout"})
    lora_target_modules: list[str] = field(default_factory=lambda: list(LLAMA_LORA_MODULES),
                                           metadata={"help": "stage 2: module names the LoRA wraps"})
    self_distillation: bool = field(default=False, metadata={"help": "stage 2: loss_0 = KL from the target itself"})
    heads_coef: float = field(default=0.2, metadata={"help": "stage 2: weight of the heads' loss"})
    medusa_lr_multiplier: float = field(default=4.0, metadata={"help": "stage 2: heads' learning rate / the LoRA's"})

    def __post_init__(self) -> None:
        check_inputs(self)
        if self.stage not in (1, 2):
            raise ValueError(f"MedusaTrainConfig.stage: expected 1 or 2, got {self.stage!r}")
        for name in ("num_heads", "num_layers", "steps", "batch_size", "seq_len", "save_every", "distill_new_tokens",
                     "lora_r", "lora_alpha"):
            if getattr(self, name) < 1:
                raise ValueError(f"MedusaTrainConfig.{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("distill_samples", "tree_nodes"):
            if getattr(self, name) < 0:
                raise ValueError(f"MedusaTrainConfig.{name}: expected >= 0, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"MedusaTrainConfig.threads: expected >= 1 or None, got {self.threads}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"MedusaTrainConfig.decay: expected a value in (0, 1], got {self.decay}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"MedusaTrainConfig.lora_dropout: expected a value in [0, 1), got {self.lora_dropout}")
        for name in ("learning_rate", "heads_coef", "medusa_lr_multiplier"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MedusaTrainConfig.{name}: expected > 0, got {getattr(self, name)}")
        if not self.lora_target_modules:
            raise ValueError("MedusaTrainConfig.lora_target_modules: expected at least one module name")
        if self.self_distillation and self.stage != 2:
            raise ValueError("MedusaTrainConfig.self_distillation: only stage 2 trains the backbone; use stage=2")


@torch.no_grad()
def _self_distillation_records(model, tokenizer, stream: torch.Tensor, config: MedusaTrainConfig,
                               accelerator: Accelerator) -> list[dict]:
    """The target's greedy continuations of seeded windows of the data (prompt tokens included)."""
    prompts = windows(stream, config.distill_samples, DISTILL_PROMPT_TOKENS,
                       torch.Generator().manual_seed(config.seed + 17))
    records = []
    with accelerator.split_between_processes(prompts) as mine:
        for batch in tqdm(mine.split(DISTILL_BATCH_SIZE), desc="self-distillation data",
                          disable=not accelerator.is_local_main_process):
            batch = batch.to(accelerator.device)
            out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=config.distill_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            for row in out.cpu().tolist():
                new = row[DISTILL_PROMPT_TOKENS:]
                end = new.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in new else len(new)
                records.append({"input_ids": row[:DISTILL_PROMPT_TOKENS] + new[:end]})
    return gather_object(records)


def medusa_loss(
    # [B, L, K, V]
    head_logits: torch.Tensor,
    # [B, L]
    input_ids: torch.Tensor,
    decay: float,
) -> tuple[torch.Tensor, list[float]]:
    """Weighted sum over heads of the cross-entropy of head i at t against token t + 2 + i; and each head's loss."""
    total, per_head = head_logits.new_zeros((), dtype=torch.float32), []
    for i in range(head_logits.shape[2]):
        shift = 2 + i
        loss = torch.nn.functional.cross_entropy(
            head_logits[:, :-shift, i].reshape(-1, head_logits.shape[-1]).float(), input_ids[:, shift:].reshape(-1)
        )
        total = total + decay**i * loss
        per_head.append(float(loss.detach()))
    return total, per_head


def backbone_loss(
    # [B, L, V]: the LoRA model's logits
    logits: torch.Tensor,
    # [B, L]
    input_ids: torch.Tensor,
    # [B, L, V]: the target's own logits (adapters disabled), or None for the plain next-token loss
    teacher_logits: torch.Tensor | None,
) -> torch.Tensor:
    """Medusa-2's loss_0: next-token cross-entropy, or KL(target || LoRA model) per position (self-distillation)."""
    vocab = logits.shape[-1]
    if teacher_logits is None:
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab).float(), input_ids[:, 1:].reshape(-1)
        )
    return torch.nn.functional.kl_div(
        logits.reshape(-1, vocab).float().log_softmax(-1), teacher_logits.reshape(-1, vocab).float().log_softmax(-1),
        log_target=True, reduction="batchmean",
    )


@torch.no_grad()
def rank_accuracy(
    # [B, L, K, V]
    head_logits: torch.Tensor,
    # [B, L]
    input_ids: torch.Tensor,
    max_rank: int,
) -> torch.Tensor:
    """[K, max_rank]: how often head i's rank-r candidate at t is token t + 2 + i."""
    rows = []
    for i in range(head_logits.shape[2]):
        shift = 2 + i
        candidates = head_logits[:, :-shift, i].topk(max_rank, dim=-1).indices  # [B, L - shift, R]
        hits = candidates == input_ids[:, shift:, None]
        rows.append(hits.float().reshape(-1, max_rank).mean(0))
    return torch.stack(rows)


def _heads_for(base, config: MedusaTrainConfig) -> MedusaHeads:
    text = base.config.get_text_config(decoder=True)
    heads = MedusaHeads(MedusaConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                                     num_heads=config.num_heads, num_layers=config.num_layers,
                                     shared_lm_head=config.shared_lm_head, base_model_name_or_path=str(config.base)))
    if not config.shared_lm_head:
        with torch.no_grad():
            for head in heads.heads:
                head[-1].weight.copy_(base.get_output_embeddings().weight)
    return heads


def _with_lora(base, config: MedusaTrainConfig):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules), task_type="CAUSAL_LM")
    return get_peft_model(base, lora)


def _step_loss(
    config: MedusaTrainConfig,
    model: torch.nn.Module,
    heads: MedusaHeads,
    lm_head: torch.nn.Module,
    # [B, L]
    input_ids: torch.Tensor,
    accelerator: Accelerator,
) -> tuple[torch.Tensor, list[float]]:
    """Stage 1: the heads' loss on the frozen target's hidden states. Stage 2: loss_0 + heads_coef * heads' loss,
    through the LoRA model (`model`)."""
    if config.stage == 1:
        with torch.no_grad():
            hidden = model(input_ids, output_hidden_states=True).hidden_states[-1]
        return medusa_loss(heads(hidden, lm_head), input_ids, config.decay)
    out = model(input_ids, output_hidden_states=True)
    teacher = None
    if config.self_distillation:
        with torch.no_grad(), accelerator.unwrap_model(model).disable_adapter():
            teacher = model(input_ids).logits
    heads_loss, per_head = medusa_loss(heads(out.hidden_states[-1], lm_head), input_ids, config.decay)
    return backbone_loss(out.logits, input_ids, teacher) + config.heads_coef * heads_loss, per_head


def train_medusa(config: MedusaTrainConfig) -> dict:
    if config.threads:
        torch.set_num_threads(config.threads)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.base, local_files_only=True)
    dtype = torch.bfloat16 if accelerator.device.type == "cuda" else torch.float32  # CPUs are slow in bf16
    base = AutoModelForCausalLM.from_pretrained(config.base, dtype=dtype, use_safetensors=True, local_files_only=True)
    base.requires_grad_(False).eval().to(accelerator.device)
    stream = token_stream(tokenizer, config.data, config.seq_len + config.num_heads + 2, "MedusaTrainConfig.data")
    if config.distill_samples:
        distilled = config.out / DISTILLATION_FILE
        if not distilled.is_file():
            records = _self_distillation_records(base, tokenizer, stream, config, accelerator)
            if accelerator.is_main_process:
                config.out.mkdir(parents=True, exist_ok=True)
                distilled.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
            accelerator.wait_for_everyone()
        stream = token_stream(tokenizer, [distilled], config.seq_len + config.num_heads + 2, "MedusaTrainConfig.data")

    torch.manual_seed(config.seed)
    heads = _heads_for(base, config)
    if config.stage == 1:
        model, trained = base, [heads]
        groups = [{"params": heads.parameters(), "lr": config.learning_rate}]
    else:
        model = _with_lora(base, config).train()
        trained = [heads, model]
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": config.learning_rate},
                  {"params": heads.parameters(), "lr": config.learning_rate * config.medusa_lr_multiplier}]
    optimizer = torch.optim.AdamW(groups)
    *trained, optimizer = accelerator.prepare(*trained, optimizer)
    heads = trained[0]
    model = trained[1] if config.stage == 2 else model
    lm_head = base.get_output_embeddings()

    checkpoint = config.out / "checkpoint"
    start = checkpoints.resume(accelerator, checkpoint)
    generator = torch.Generator()
    history = []
    progress = tqdm(range(start, config.steps), desc=f"medusa-{config.stage}",
                    disable=not accelerator.is_local_main_process)
    for step in progress:
        generator.manual_seed(config.seed * 1_000_003 + step * 101 + accelerator.process_index)
        input_ids = windows(stream, config.batch_size, config.seq_len, generator).to(accelerator.device)
        loss, per_head = _step_loss(config, model, heads, lm_head, input_ids, accelerator)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        history.append(float(loss.detach()))
        progress.set_postfix(loss=f"{history[-1]:.3f}", heads=" ".join(f"{x:.2f}" for x in per_head))
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            checkpoints.save(accelerator, checkpoint, step + 1)
    accelerator.wait_for_everyone()
    result = {"steps": config.steps, "loss_history": history, "config": {k: str(v) for k, v in asdict(config).items()}}
    if accelerator.is_main_process:
        heads = accelerator.unwrap_model(heads).eval()
        model = accelerator.unwrap_model(model).eval()
        if config.tree_nodes:
            accuracy = _measure_rank_accuracy(model, heads, lm_head, stream, config, accelerator.device)
            heads.config = replace(heads.config, tree_paths=fit_tree(accuracy, config.tree_nodes))
            result["rank_accuracy"] = accuracy.tolist()
        heads.save_pretrained(config.out)
        if config.stage == 2:
            model.save_pretrained(config.out / LORA_FOLDER)
        (config.out / "train_metrics.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    return result


@torch.no_grad()
def _measure_rank_accuracy(model, heads: MedusaHeads, lm_head, stream: torch.Tensor, config: MedusaTrainConfig,
                           device: torch.device) -> torch.Tensor:
    """[K, TREE_MAX_RANK]: the heads' rank accuracies on seeded windows of the training data."""
    generator = torch.Generator().manual_seed(config.seed + 29)
    total = 0
    for _ in range(TREE_FIT_BATCHES):
        input_ids = windows(stream, config.batch_size, config.seq_len, generator).to(device)
        hidden = model(input_ids, output_hidden_states=True).hidden_states[-1]
        total = total + rank_accuracy(heads(hidden, lm_head), input_ids, TREE_MAX_RANK)
    return total / TREE_FIT_BATCHES
