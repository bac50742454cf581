"""The one training loop every drafter trains in: `train(config, make_objective)`.

A method contributes an `Objective`: the module it trains (heads, a draft model, a LoRA), its loss on a batch, the
target features its batches carry, and how the result is saved. The skeleton does the rest, the same for every
method:

1. accelerate setup (single process, several CPU processes over gloo, several GPUs);
2. the training rows: target-written (`generated.py`, cached and shared by every method's trainer) or raw text;
3. the target's features over the rows, computed once and cached on disk (`target_features.py`), unless the
   objective runs the target itself (`feature_layers = None`: Medusa-2 trains a LoRA on it);
4. a seeded loop (AdamW, linear warm-up then cosine decay to 10%, gradient clipping, optional bf16 autocast), with
   checkpoints every `save_every` steps that a rerun under the same settings resumes from (`checkpoints.py`);
5. with `eval_rows`, that many rows held out of training (a seeded choice), on which the loss and metrics are
   measured every `eval_every` steps and after the last: a drafter that fits its training rows better and better
   while the held-out ones stop improving is learning those rows, not the target;
6. the trained drafter and `train_metrics.json` (loss and per-step metrics, the held-out measurements) in
   `config.out`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_specdec.training import checkpoints
from hf_specdec.training.config import CHECKPOINT_DIR, METRICS_FILE, DataError, TrainConfig
from hf_specdec.training.generated import TrainingRows, read_source, training_rows
from hf_specdec.training.target_features import (
    FINAL_LAYER,
    TargetBatch,
    build_feature_cache,
    feature_key,
    target_batch,
)


class Objective(nn.Module):
    """What one method trains and how it is scored.

    `forward(batch, target)` returns the loss and a dict of metrics (floats, or lists of floats) for the step;
    `param_groups` what the optimizer updates; `save` writes the trained drafter (main process, after the last step).
    """

    # entries of the target's `hidden_states` the batches carry as `features` (FINAL_LAYER: the final normed hidden
    # state); None: the objective runs the target itself and batches carry token ids only
    feature_layers: tuple[int, ...] | None = FINAL_LAYER
    # the fewest positions a batch may have (batches are cut to their longest row)
    min_batch_length: int = 2

    def forward(self, batch: TargetBatch, target: nn.Module) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def param_groups(self, learning_rate: float) -> list[dict]:
        return [{"params": [p for p in self.parameters() if p.requires_grad], "lr": learning_rate}]

    def save(self, out: Path, target: nn.Module, rows: TrainingRows, result: dict) -> None:
        raise NotImplementedError


ObjectiveFactory = Callable[[TrainConfig, nn.Module, TrainingRows], Objective]


def lr_factor(step: int, steps: int, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_ratio` at `steps` (0-based `step`)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def load_target(config: TrainConfig, accelerator: Accelerator) -> nn.Module:
    """The frozen target in eval mode, in `config.target_dtype`, on the accelerator's device."""
    dtype = config.torch_dtype(accelerator.device.type == "cuda")
    target = AutoModelForCausalLM.from_pretrained(config.base, dtype=dtype, use_safetensors=True,
                                                  local_files_only=True)
    return target.requires_grad_(False).eval().to(accelerator.device)


# added to the seed for the choice of held-out rows (apart from the seeds of the training batches)
EVAL_SEED_OFFSET = 7919


def split_rows(count: int, eval_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows [count - eval_rows], held-out rows [eval_rows]): row indices, ascending; a seeded choice of
    the held-out ones (every row trains when there are none)."""
    if eval_rows == 0:
        return torch.arange(count), torch.arange(0)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET))
    return order[eval_rows:].sort().values, order[:eval_rows].sort().values


def _mean_metrics(measured: list[tuple[int, float, dict]]) -> dict:
    """"loss" and each metric (a float, or a list of floats per head or step) averaged over batches, each weighted by
    its rows."""
    total = sum(rows for rows, _, _ in measured)
    result = {"loss": sum(rows * loss for rows, loss, _ in measured) / total}
    for name, value in measured[0][2].items():
        if isinstance(value, list):
            result[name] = [sum(rows * m[name][i] for rows, _, m in measured) / total for i in range(len(value))]
        elif isinstance(value, float):
            result[name] = sum(rows * m[name] for rows, _, m in measured) / total
    return result


def evaluate(
    objective: Objective,
    target: nn.Module,
    rows: TrainingRows,
    # [E] the held-out row indices
    held_out: torch.Tensor,
    batch_size: int,
    device: torch.device,
    cache,
    autocast: bool,
) -> dict:
    """The objective's loss and metrics on the held-out rows (in batches of `batch_size`, in order), without
    gradients and in eval mode; neither the objective's modes nor any random state are changed for training."""
    modes = [(module, module.training) for module in objective.modules()]
    objective.eval()
    measured = []
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), torch.autocast(
                device.type, dtype=torch.bfloat16, enabled=autocast):
            for start in range(0, len(held_out), batch_size):
                index = held_out[start : start + batch_size]
                batch = target_batch(target, rows, index, device, cache, objective.feature_layers,
                                     objective.min_batch_length)
                loss, metrics = objective(batch, target)
                measured.append((len(index), float(loss), metrics))
    finally:
        for module, training in modes:
            module.train(training)
    return _mean_metrics(measured)


def train(config: TrainConfig, make_objective: ObjectiveFactory) -> dict:
    """Train the objective `make_objective(config, target, rows)` builds; returns what `train_metrics.json` holds."""
    if config.threads:
        torch.set_num_threads(config.threads)
    checkpoints.check_settings(config.out / CHECKPOINT_DIR, config)  # before the target answers anything
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.base, local_files_only=True)
    source = read_source(config, tokenizer)  # bad data files fail here, before the target loads
    target = load_target(config, accelerator)
    rows = training_rows(config, accelerator, target, source)
    if config.eval_rows >= len(rows.input_ids):
        raise DataError(f"{type(config).__name__}.eval_rows: {config.eval_rows} held out of the data's "
                         f"{len(rows.input_ids)} rows leaves none to train on; hold out fewer")
    trained_rows, held_out = split_rows(len(rows.input_ids), config.eval_rows, config.seed)
    torch.manual_seed(config.seed)
    # what the objective reads of the rows (a draft vocabulary's token counts, a tree fitted after training) comes
    # from the training rows alone, so the held-out rows stay unseen
    training = rows.select(trained_rows)
    objective = make_objective(config, target, training)
    layers = objective.feature_layers
    cache = None
    if layers is not None and config.cache_features:
        key = feature_key(config.base, target.dtype, layers, rows)
        cache = build_feature_cache(target, rows, layers, config.feature_cache_dir, key, config.generate_batch_size,
                                    accelerator)

    optimizer = torch.optim.AdamW(objective.param_groups(config.learning_rate), betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.steps, config.warmup_steps))
    objective, optimizer, scheduler = accelerator.prepare(objective, optimizer, scheduler)
    state = checkpoints.resume(accelerator, config.out / CHECKPOINT_DIR)

    generator = torch.Generator()
    min_length = accelerator.unwrap_model(objective).min_batch_length
    history, metrics_history, eval_history = state.loss_history, state.metrics_history, state.eval_history
    eval_every = config.eval_every or config.save_every
    autocast = config.mixed_precision == "bf16"
    name = type(accelerator.unwrap_model(objective)).__name__.removesuffix("Objective").lower()
    progress = tqdm(range(state.step, config.steps), desc=name, disable=not accelerator.is_local_main_process)
    for step in progress:
        generator.manual_seed(config.seed * 1_000_003 + step * 101 + accelerator.process_index)
        index = trained_rows[torch.randint(0, len(trained_rows), (config.batch_size,), generator=generator)]
        batch = target_batch(target, rows, index, accelerator.device, cache, layers, min_length)
        with torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, metrics = objective(batch, target)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(objective.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        history.append(float(loss.detach()))
        metrics_history.append(metrics)
        # the main process measures (the others' measurements would be the same; it writes the history)
        if len(held_out) and accelerator.is_main_process and ((step + 1) % eval_every == 0
                                                              or step + 1 == config.steps):
            measured = evaluate(accelerator.unwrap_model(objective), target, rows, held_out, config.batch_size,
                                accelerator.device, cache, autocast)
            eval_history.append({"step": step + 1, **measured})
        shown = {k: f"{v:.2f}" for k, v in metrics.items() if isinstance(v, float)}
        if eval_history:
            shown["eval_loss"] = f"{eval_history[-1]['loss']:.3f}"
        progress.set_postfix(loss=f"{history[-1]:.3f}", **shown)
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            state.step = step + 1
            checkpoints.save(accelerator, config.out / CHECKPOINT_DIR, state, config)
    accelerator.wait_for_everyone()
    result = {"steps": config.steps, "loss_history": history, "metrics_history": metrics_history,
              "eval_history": eval_history, "config": config.values()}
    if accelerator.is_main_process:
        accelerator.unwrap_model(objective).save(config.out, target, training, result)
        (config.out / METRICS_FILE).write_text(json.dumps(result, indent=2, sort_keys=True))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group: one left to the interpreter's exit can abort a rank
    return result

