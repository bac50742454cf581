"""Training data shared by the head trainers: local text (or token) files as one token stream, and seeded windows."""

from __future__ import annotations

import json
from collections.abc import Iterator
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
    """[N]: every file's tokens followed by EOS (`records`). `field` names the config field in the error (a
    `DataError`) when the stream is shorter than `min_length`."""
    ids: list[int] = []
    for _, tokens in records(tokenizer, paths, field):
        ids += tokens + [tokenizer.eos_token_id]
    if len(ids) < min_length:
        raise DataError(f"{field}: {len(ids)} tokens in {[str(p) for p in paths]}, need at least {min_length} for "
                        "one training window; give more text, or a shorter seq_len")
    return torch.tensor(ids)


def records(tokenizer, paths: list[Path], field: str) -> Iterator[tuple[str, list[int]]]:
    """(where, token ids) of each record: a .jsonl file's non-empty lines, objects with an "input_ids" or a "text"
    field (tokenized as it is: no special tokens added, since a chat prompt carries them from its template); any
    other file is one text record. `where` names the field, file and line for errors; a line that is no such
    object is a `DataError` naming them."""
    for path in paths:
        if path.suffix != ".jsonl":
            yield f"{field}: {path}", tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{field}: {path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where} is not JSON ({error.msg})") from error
            if not isinstance(record, dict) or not ({"text", "input_ids"} & record.keys()):
                raise DataError(f"{where}: expected a JSON object with a 'text' or an 'input_ids' field, got "
                                f"{line[:80]!r}")
            yield where, (record["input_ids"] if "input_ids" in record
                          else tokenizer(record["text"], add_special_tokens=False)["input_ids"])


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
