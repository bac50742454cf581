"""Training data shared by the head trainers: local text (or token) files as one token stream, and seeded windows."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def check_inputs(config) -> None:
    """Normalise and check the fields every trainer config has: `base` (a model folder), `data` (existing files),
    `out` and `tokenizer`; errors name the config class and the field."""
    owner = type(config).__name__
    config.base, config.out = Path(config.base), Path(config.out)
    config.data = [Path(p) for p in config.data]
    config.tokenizer = None if config.tokenizer is None else Path(config.tokenizer)
    if not (config.base / "config.json").is_file():
        raise ValueError(f"{owner}.base: no model at {config.base} (expected config.json)")
    missing = [str(p) for p in config.data if not p.is_file()]
    if not config.data or missing:
        raise ValueError(f"{owner}.data: expected existing files, missing {missing or 'all'}")


def token_stream(tokenizer, paths: list[Path], min_length: int, field: str) -> torch.Tensor:
    """[N]: every file's tokens followed by EOS. Files: text (.txt, .py, ...), or .jsonl records with a "text" or an
    "input_ids" field. `field` names the config field in the error when the stream is shorter than `min_length`."""
    ids: list[int] = []
    for path in paths:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            records = [{"text": path.read_text()}]
        for record in records:
            tokens = record["input_ids"] if "input_ids" in record else tokenizer(
                record["text"], add_special_tokens=False)["input_ids"]
            ids += tokens + [tokenizer.eos_token_id]
    if len(ids) < min_length:
        raise ValueError(f"{field}: {len(ids)} tokens, need at least {min_length} for one training window")
    return torch.tensor(ids)


def windows(
    # [N] the token stream
    stream: torch.Tensor,
    count: int,
    length: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """[count, length]: windows of the stream at seeded random offsets."""
    starts = torch.randint(0, len(stream) - length, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])
