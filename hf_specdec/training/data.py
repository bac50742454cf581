"""Training data shared by the head trainers: local text (or token) files as one token stream, and seeded windows."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_specdec.training.config import DataError


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
    "input_ids" field. `field` names the config field in the error (a `DataError`) when a record is not one of
    those, or the stream is shorter than `min_length`."""
    ids: list[int] = []
    for path in paths:
        for line_number, record in _records(path, field):
            if not isinstance(record, dict) or not ({"text", "input_ids"} & set(record)):
                raise DataError(f"{field}: {path} line {line_number}: expected a JSON object with a 'text' or an "
                                f"'input_ids' field, got {str(record)[:80]!r}")
            tokens = record["input_ids"] if "input_ids" in record else tokenizer(
                record["text"], add_special_tokens=False)["input_ids"]
            ids += tokens + [tokenizer.eos_token_id]
    if len(ids) < min_length:
        raise DataError(f"{field}: {len(ids)} tokens in {[str(p) for p in paths]}, need at least {min_length} for "
                        "one training window; give more text, or a shorter seq_len")
    return torch.tensor(ids)


def _records(path: Path, field: str) -> list[tuple[int, object]]:
    """(line number, record) of a .jsonl file's non-empty lines, or (1, {"text": the whole file}) for any other file."""
    if path.suffix != ".jsonl":
        return [(1, {"text": path.read_text()})]
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as error:
                raise DataError(f"{field}: {path} line {number} is not JSON ({error.msg})") from error
    return records


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
