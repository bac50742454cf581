"""EAGLE head training on a frozen target: EAGLE-1/2 (feature regression) and EAGLE-3 (training-time test).

* Data (`generated.py`): by default the target writes its own training text, so the head learns the distribution
  it will draft for: it continues prompt windows cut from the text files, or, with `prompt_records`, whole prompts
  (one per .jsonl record, e.g. chat-template renderings) up to `max_new_tokens` tokens or EOS. The rows are cached
  in the output folder (keyed by the settings and a hash of the source tokens), so a resume or a second training
  run reuses them. `data_source="text"` trains on windows of the raw text instead.
* Target features (`target_features.py`): the target runs once over the training rows and its features, final
  normed hidden states and top tokens are cached on disk (keyed, sharded, memory-mapped); steps read them back and
  recompute the target's logits through its lm_head, so the target never runs per step (`cache_features=False`
  runs it on every batch instead, with no disk use).
* `version="eagle"`: index i of a window feeds `cat(embed(x_{i+1}), f_i + noise)` (f = the target's final normed
  hidden state, noise uniform of width `noise`), and the head's output there regresses f_{i+1} (smooth L1) and,
  through the target's lm_head, matches the target's next-token distribution at i + 1 (soft cross-entropy, weight
  `ce_weight`), as EAGLE-1's recipe.
* `version="eagle3"`: the training-time test unrolls `ttt_steps` steps. Step 0 reads the fused target features f_i
  with token x_{i+1}; step s reads the head's own step s - 1 output at index i with token x_{i+1+s} (the drafting
  chain the head runs at inference) at position i + 1 + s. Attention at step s sees the step-0 keys causally and,
  from each later step r <= s, only the key at the query's own index (`ttt_attention_mask`). The loss is
  sum_s decay^s * soft CE against the target's distribution restricted to the draft vocabulary, on positions whose
  target argmax lies in that vocabulary.

Positions after a row's end (padding of prompt-record rows) count in no loss. Runs on accelerate like Medusa
training (single process, multi-process CPU over gloo, multi-GPU), checkpoints every `save_every` steps and resumes
from the last one.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, get_args

import torch
from accelerate import Accelerator
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_specdec.heads.eagle import EagleConfig, EagleHead, EagleVersion
from hf_specdec.training import checkpoints
from hf_specdec.training.data import check_inputs
from hf_specdec.training.generated import GENERATED_FILE, read_source, training_rows
from hf_specdec.training.target_features import (
    build_feature_cache,
    feature_key,
    target_batch,
    target_logits,
)

DataSource = Literal["generated", "text"]
FEATURES_DIR = "target_features"


@dataclass
class EagleTrainConfig:
    base: Path = field(metadata={"help": "target model folder (frozen)"})
    data: list[Path] = field(metadata={"help": "text files, or .jsonl with a 'text' or 'input_ids' field"})
    out: Path = field(metadata={"help": "output folder: the head, generated data, target features, checkpoints"})
    tokenizer: Path | None = field(default=None, metadata={"help": "tokenizer folder (default: the base folder)"})
    version: EagleVersion = field(default="eagle", metadata={"help": "'eagle' (EAGLE-1/2) or 'eagle3'"})
    data_source: DataSource = field(default="generated", metadata={"help": "'generated' by the target, or raw 'text'"})
    generated_data: Path | None = field(
        default=None, metadata={"help": f"cache of the generated rows (default: out/{GENERATED_FILE})"}
    )
    num_samples: int = field(default=512, metadata={"help": "rows the target generates"})
    prompt_records: bool = field(
        default=False, metadata={"help": "generated: each .jsonl record is one whole prompt, continued to EOS"}
    )
    prompt_len: int = field(default=64, metadata={"help": "text tokens before each generated continuation "
                                                          "(windows cut from the text; not with prompt_records)"})
    max_new_tokens: int = field(default=128, metadata={"help": "prompt_records: most tokens generated per prompt"})
    temperature: float = field(default=0.0, metadata={"help": "generation temperature (0: greedy)"})
    generate_batch_size: int = field(
        default=32, metadata={"help": "rows per target call when generating data and caching features"}
    )
    cache_features: bool = field(
        default=True, metadata={"help": "run the target once and train from its cached features (False: every step)"}
    )
    feature_cache: Path | None = field(
        default=None, metadata={"help": f"folder of the cached target features (default: out/{FEATURES_DIR})"}
    )
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 1e-3
    warmup_steps: int = field(default=20, metadata={"help": "linear warm-up, then cosine decay to 10%"})
    grad_clip: float = 0.5
    noise: float = field(default=0.2, metadata={"help": "eagle: width of the uniform noise on input features"})
    ce_weight: float = field(default=0.1, metadata={"help": "eagle: weight of the soft cross-entropy"})
    ttt_steps: int = field(default=7, metadata={"help": "eagle3: unrolled training-time-test steps"})
    decay: float = field(default=0.8, metadata={"help": "eagle3: loss weight decay per unrolled step"})
    draft_vocab_size: int | None = field(default=None, metadata={"help": "eagle3: most frequent tokens kept"})
    feature_layers: tuple[int, ...] | None = field(default=None, metadata={"help": "eagle3: fused target layers"})
    intermediate_size: int | None = field(default=None, metadata={"help": "head MLP width (default: the target's)"})
    init_from_target: bool = field(default=True, metadata={"help": "start from the target's last layer"})
    save_every: int = 100
    seed: int = 0
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (None: torch's choice)"})

    def __post_init__(self) -> None:
        check_inputs(self)
        self.generated_data = None if self.generated_data is None else Path(self.generated_data)
        self.feature_cache = None if self.feature_cache is None else Path(self.feature_cache)
        self.feature_layers = None if self.feature_layers is None else tuple(int(i) for i in self.feature_layers)
        if self.version not in get_args(EagleVersion):
            raise ValueError(
                f"EagleTrainConfig.version: expected one of {get_args(EagleVersion)}, got {self.version!r}"
            )
        if self.data_source not in get_args(DataSource):
            raise ValueError(
                f"EagleTrainConfig.data_source: expected one of {get_args(DataSource)}, got {self.data_source!r}"
            )
        for name in ("num_samples", "prompt_len", "max_new_tokens", "generate_batch_size", "steps", "batch_size",
                     "seq_len", "ttt_steps", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"EagleTrainConfig.{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("draft_vocab_size", "intermediate_size", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"EagleTrainConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.prompt_records:
            self._check_prompt_records()
        elif self.data_source == "generated" and self.prompt_len >= self.seq_len:
            raise ValueError(
                f"EagleTrainConfig.prompt_len: expected less than seq_len {self.seq_len}, got {self.prompt_len}"
            )
        if self.feature_cache is not None and not self.cache_features:
            raise ValueError(f"EagleTrainConfig.feature_cache: {self.feature_cache} given with cache_features=False; "
                             f"drop one of them")
        if self.version == "eagle3" and self.ttt_steps + 1 >= self.seq_len:
            raise ValueError(f"EagleTrainConfig.ttt_steps: expected less than seq_len - 1, got {self.ttt_steps}")
        for name in ("temperature", "noise", "ce_weight", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"EagleTrainConfig.{name}: expected >= 0, got {getattr(self, name)}")
        for name in ("learning_rate", "grad_clip"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EagleTrainConfig.{name}: expected > 0, got {getattr(self, name)}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"EagleTrainConfig.decay: expected a value in (0, 1], got {self.decay}")
        if self.version == "eagle" and (self.draft_vocab_size is not None or self.feature_layers is not None):
            raise ValueError("EagleTrainConfig.draft_vocab_size / feature_layers: only for version 'eagle3'")

    def _check_prompt_records(self) -> None:
        if self.data_source != "generated":
            raise ValueError(f"EagleTrainConfig.prompt_records: only with data_source 'generated', got data_source "
                             f"{self.data_source!r}")
        others = [str(p) for p in self.data if p.suffix != ".jsonl"]
        if others:
            raise ValueError(f"EagleTrainConfig.data: prompt_records reads .jsonl files of prompt records ('text' or "
                             f"'input_ids'), got {others}")
        if self.max_new_tokens >= self.seq_len:
            raise ValueError(f"EagleTrainConfig.max_new_tokens: expected less than seq_len {self.seq_len}, got "
                             f"{self.max_new_tokens}")

    @property
    def generated_path(self) -> Path:
        return self.generated_data or self.out / GENERATED_FILE

    @property
    def feature_cache_dir(self) -> Path:
        return self.feature_cache or self.out / FEATURES_DIR


def build_draft_vocab(
    # [N] token ids of the training data
    token_ids: torch.Tensor,
    vocab_size: int,
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's maps for the `draft_vocab_size` most frequent ids: d2t [D] (target id = draft id + d2t[draft id],
    draft ids in ascending target-id order) and t2d [V] (bool: the target id is in the draft vocabulary)."""
    counts = torch.bincount(token_ids.flatten(), minlength=vocab_size)
    # ties broken by id so the choice is deterministic
    order = torch.argsort(counts * vocab_size + (vocab_size - 1 - torch.arange(vocab_size)), descending=True)
    kept = torch.sort(order[:draft_vocab_size]).values  # [D]
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


class EagleObjective(nn.Module):
    """The trained head plus its loss, one module so data-parallel wrappers see a single forward per step."""

    def __init__(self, head: EagleHead, config: EagleTrainConfig) -> None:
        super().__init__()
        self.head = head
        self.noise, self.ce_weight = config.noise, config.ce_weight
        self.ttt_steps, self.decay = config.ttt_steps, config.decay

    def forward(
        self,
        # [B, L] bool: real tokens (positions after a row's end count in no loss)
        valid: torch.Tensor,
        # [B, L, H] the target's embeddings of the tokens
        embeds: torch.Tensor,
        # [B, L, F] target features (eagle: final normed hidden state; eagle3: fused layers)
        features: torch.Tensor,
        # [B, L, H] the target's final normed hidden state
        target_hidden: torch.Tensor,
        # [B, L] the target's top token after each position
        target_argmax: torch.Tensor,
        target_lm_head: nn.Linear,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if self.head.config.version == "eagle":
            return self._eagle_loss(valid, embeds, features, target_hidden, target_argmax, target_lm_head)
        return self._eagle3_loss(valid, embeds, features, target_hidden, target_argmax, target_lm_head)

    def _eagle_loss(self, valid, embeds, features, target_hidden, target_argmax, target_lm_head):
        length = embeds.shape[1]
        inputs = features[:, :-1]  # [B, L-1, H]: f_i
        if self.noise > 0:
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * self.noise
        positions = torch.arange(1, length, device=embeds.device).expand(embeds.shape[0], -1)  # [B, L-1]
        hidden = self.head(embeds[:, 1:], inputs, positions, attention_mask=None)  # [B, L-1, H]
        weight = valid[:, 1:].float()  # [B, L-1]: the predicted token is real
        count = weight.sum().clamp(min=1)
        regression = nn.functional.smooth_l1_loss(hidden.float(), features[:, 1:].float(), reduction="none")
        regression = (regression.mean(-1) * weight).sum() / count
        logits = self.head.logits(hidden, target_lm_head)  # [B, L-1, V]
        with torch.no_grad():
            target_probs = torch.softmax(target_logits(target_hidden[:, 1:], target_lm_head), dim=-1)
        ce = (soft_cross_entropy(logits, target_probs) * weight).sum() / count
        accuracy = ((logits.argmax(-1) == target_argmax[:, 1:]).float() * weight).sum() / count
        loss = regression + self.ce_weight * ce
        return loss, {"regression": float(regression.detach()), "ce": float(ce.detach()),
                      "accuracy": float(accuracy)}

    def _eagle3_loss(self, valid, embeds, features, target_hidden, target_argmax, target_lm_head):
        head, batch, length = self.head, embeds.shape[0], embeds.shape[1]
        width = length - self.ttt_steps  # every unrolled step has a target for all W indices
        with torch.no_grad():
            draft_target = target_logits(target_hidden, target_lm_head, head.t2d)  # [B, L, D]
            draft_probs = torch.softmax(draft_target, dim=-1)
            trained = head.t2d[target_argmax] & valid  # [B, L]: a real token whose target choice is draftable
        cache = DynamicCache()
        hidden = features[:, :width]  # [B, W, F]
        total, accuracies, losses = embeds.new_zeros((), dtype=torch.float32), [], []
        for step in range(self.ttt_steps):
            window = slice(1 + step, 1 + step + width)  # tokens x_{i+1+s} and their next-token targets
            positions = torch.arange(window.start, window.stop, device=embeds.device).expand(batch, -1)  # [B, W]
            mask = ttt_attention_mask(width, step, head.dtype, embeds.device).expand(batch, -1, -1, -1)
            hidden = head(embeds[:, window], hidden, positions, mask, past_key_values=cache,
                          from_target=step == 0)  # [B, W, H]
            logits = head.lm_head(head.norm(hidden)).float()  # [B, W, D]
            weight = trained[:, window].float()  # [B, W]
            ce = (soft_cross_entropy(logits, draft_probs[:, window]) * weight).sum() / weight.sum().clamp(min=1)
            total = total + self.decay**step * ce
            agree = (logits.argmax(-1) == draft_target[:, window].argmax(-1)).float() * weight
            accuracies.append(float(agree.sum() / weight.sum().clamp(min=1)))
            losses.append(float(ce.detach()))
        # accuracy: step 0's top-1 agreement with the target; the lists hold every unrolled step
        return total, {"accuracy": accuracies[0], "accuracy_steps": accuracies, "ce_steps": losses}


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


def train_eagle(config: EagleTrainConfig) -> dict:
    if config.threads:
        torch.set_num_threads(config.threads)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.base, local_files_only=True)
    source = read_source(config, tokenizer)  # bad data files fail here, before the target loads
    dtype = torch.bfloat16 if accelerator.device.type == "cuda" else torch.float32  # CPUs are slow in bf16
    target = AutoModelForCausalLM.from_pretrained(config.base, dtype=dtype, use_safetensors=True,
                                                  local_files_only=True)
    target.requires_grad_(False).eval().to(accelerator.device)
    data = training_rows(config, accelerator, target, source)
    head_config = _head_config(config, target)
    if config.version == "eagle3" and data.input_ids.shape[1] <= config.ttt_steps + 1:
        raise ValueError(f"EagleTrainConfig.ttt_steps: expected less than the rows' length - 1 "
                         f"({data.input_ids.shape[1]} tokens), got {config.ttt_steps}")
    layers = head_config.target_feature_layers(target.config.get_text_config(decoder=True).num_hidden_layers)
    cache = None
    if config.cache_features:
        key = feature_key(config.base, target.dtype, layers, data)
        cache = build_feature_cache(target, data, layers, config.feature_cache_dir, key, config.generate_batch_size,
                                    accelerator)

    torch.manual_seed(config.seed)
    head = EagleHead(head_config)
    if config.version == "eagle3" and head_config.draft_vocab_size is not None:
        d2t, t2d = build_draft_vocab(data.tokens(), head_config.vocab_size, head_config.draft_vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    if config.init_from_target:
        init_head_from_target(head, target)
    objective = EagleObjective(head.to(dtype), config)
    optimizer = torch.optim.AdamW(objective.parameters(), lr=config.learning_rate, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
    objective, optimizer, scheduler = accelerator.prepare(objective, optimizer, scheduler)

    checkpoint = config.out / "checkpoint"
    start = checkpoints.resume(accelerator, checkpoint)
    generator = torch.Generator()
    history, metrics_history = [], []
    progress = tqdm(range(start, config.steps), desc=f"{config.version} head",
                    disable=not accelerator.is_local_main_process)
    for step in progress:
        generator.manual_seed(config.seed * 1_000_003 + step * 101 + accelerator.process_index)
        rows = torch.randint(0, len(data.input_ids), (config.batch_size,), generator=generator)
        batch = target_batch(target, data, rows, accelerator.device, cache, layers)
        loss, metrics = objective(batch.valid, batch.embeds, batch.features, batch.hidden, batch.argmax,
                                  target.get_output_embeddings())
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(objective.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        history.append(float(loss.detach()))
        metrics_history.append(metrics)
        progress.set_postfix(loss=f"{history[-1]:.3f}", acc=f"{metrics['accuracy']:.2f}")
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            checkpoints.save(accelerator, checkpoint, step + 1)
    accelerator.wait_for_everyone()
    result = {"steps": config.steps, "loss_history": history, "metrics_history": metrics_history,
              "config": {k: str(v) for k, v in asdict(config).items()}}
    if accelerator.is_main_process:
        accelerator.unwrap_model(objective).head.save_pretrained(config.out)
        (config.out / "train_metrics.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    return result


def _lr_factor(step: int, config: EagleTrainConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to 10% at `steps`."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))
