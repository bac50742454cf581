"""Training and evaluation of the test-bed models on a token stream.

Files are concatenated into one stream, each preceded by ``<|endoftext|>``.
Training samples random windows of that stream (seeded); evaluation is the
mean token cross-entropy over evenly spaced, non-overlapping windows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_specdec.training.skeleton import lr_factor


def token_stream(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> np.ndarray:
    """Token ids of ``texts`` concatenated, each text preceded by the eos token."""
    encoded = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    pieces = []
    for ids in encoded:
        pieces.append([tokenizer.eos_token_id])
        pieces.append(ids)
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings for one model."""

    steps: int
    batch_size: int = 8
    seq_len: int = 512
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0 or self.seq_len <= 1:
            raise ValueError("steps and batch_size must be positive and seq_len greater than 1")
        if self.learning_rate <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("learning_rate must be positive and min_lr_ratio in [0, 1]")
        if self.warmup_steps < 0 or self.grad_clip <= 0:
            raise ValueError("warmup_steps must be non-negative and grad_clip positive")

    def lr_factor(self, step: int) -> float:
        """Linear warm-up then cosine decay to ``min_lr_ratio``, for 0-based ``step``."""
        return lr_factor(step, self.steps, self.warmup_steps, self.min_lr_ratio)


@dataclass(frozen=True)
class TrainResult:
    """What a training run did."""

    steps: int
    tokens: int
    seconds: float
    final_train_loss: float


def train(model: PreTrainedModel, stream: np.ndarray, config: TrainConfig, desc: str = "train") -> TrainResult:
    """Train ``model`` in place with AdamW on random windows of ``stream``."""
    if len(stream) <= config.seq_len:
        raise ValueError("the token stream is shorter than one window")
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, config.lr_factor)
    model.train()
    start = time.perf_counter()
    smoothed = float("nan")
    progress = tqdm(range(config.steps), desc=desc, mininterval=10.0)
    for _ in progress:
        offsets = rng.integers(0, len(stream) - config.seq_len, size=config.batch_size)
        batch = torch.from_numpy(np.stack([stream[o : o + config.seq_len] for o in offsets]))
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        progress.set_postfix(loss=f"{smoothed:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
    model.eval()
    return TrainResult(
        steps=config.steps,
        tokens=config.steps * config.batch_size * config.seq_len,
        seconds=time.perf_counter() - start,
        final_train_loss=smoothed,
    )


@torch.no_grad()
def evaluate(model: PreTrainedModel, stream: np.ndarray, seq_len: int = 512, max_windows: int = 128) -> float:
    """Mean token cross-entropy (nats) over up to ``max_windows`` evenly spaced windows."""
    available = len(stream) // seq_len
    if available == 0:
        raise ValueError("the token stream is shorter than one window")
    starts = np.linspace(0, available - 1, num=min(available, max_windows)).round().astype(int) * seq_len
    model.eval()
    total, count = 0.0, 0
    for start in starts:
        window = torch.from_numpy(stream[start : start + seq_len]).unsqueeze(0)
        loss = model(input_ids=window, labels=window).loss
        total += loss.item() * (seq_len - 1)
        count += seq_len - 1
    return total / count
