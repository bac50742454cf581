"""Suffix cache files: the cached outputs in a safetensors file, with the vocabulary they were tokenized with.

Layout
------
* tensors: `tokens` (int32 [N]: every cached output, concatenated oldest first) and `lengths` (int64 [R]: the
  length of each output).
* metadata (strings): `format` = "hf_specdec.suffix_cache", `format_version` = "1", `vocab_size`,
  `tokenizer_fingerprint` (see `tokenizer_fingerprint`), `config` (the SuffixConfig as JSON with sorted keys) and
  `sha256` (over the little-endian bytes of `tokens` then `lengths`).

The tree itself is not stored: loading adds the outputs again (O(N x max_depth)), so a file can never describe an
inconsistent tree, and the checksum turns any damage to the tokens into a clear error. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from hf_specdec.suffix.config import SuffixConfig

FORMAT = "hf_specdec.suffix_cache"
FORMAT_VERSION = "1"
_METADATA_KEYS = ("format", "format_version", "vocab_size", "tokenizer_fingerprint", "config", "sha256")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of a tokenizer's vocabulary (every token string with its id): two tokenizers with the same
    fingerprint map text to the same ids. Takes anything with `get_vocab()` (transformers tokenizers,
    `tokenizers.Tokenizer`)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(get_vocab):
        raise ValueError(
            f"tokenizer_fingerprint: expected a tokenizer with get_vocab(), got {type(tokenizer).__name__}"
        )
    items = sorted((int(index), str(token)) for token, index in get_vocab().items())
    return "sha256:" + hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class CacheFile:
    """What a suffix cache file holds."""

    # the cached outputs, oldest first
    sequences: tuple[np.ndarray, ...]
    vocab_size: int
    tokenizer_fingerprint: str
    config: SuffixConfig


def _checksum(tokens: np.ndarray, lengths: np.ndarray) -> str:
    digest = hashlib.sha256(tokens.astype("<i4").tobytes())
    digest.update(lengths.astype("<i8").tobytes())
    return digest.hexdigest()


def write_cache_file(path: str | os.PathLike, file: CacheFile) -> None:
    """Writes `file` to `path` (through a temporary file, so an interrupted write never leaves a damaged file)."""
    lengths = np.array([len(sequence) for sequence in file.sequences], dtype=np.int64)
    tokens = (np.concatenate([np.asarray(s, dtype=np.int32) for s in file.sequences]) if file.sequences
              else np.zeros(0, dtype=np.int32))
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "vocab_size": str(file.vocab_size),
        "tokenizer_fingerprint": file.tokenizer_fingerprint,
        "config": json.dumps(file.config.to_dict(), sort_keys=True),
        "sha256": _checksum(tokens, lengths),
    }
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    save_file({"tokens": tokens, "lengths": lengths}, str(partial), metadata=metadata)
    os.replace(partial, path)


def read_cache_file(path: str | os.PathLike) -> CacheFile:
    """Reads and checks a file written by `write_cache_file`; a damaged or foreign file is a ValueError naming
    what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"suffix cache file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="np") as handle:
            metadata = handle.metadata() or {}
            names = set(handle.keys())
            if names != {"tokens", "lengths"}:
                raise ValueError(f"holds tensors {sorted(names)}, expected ['lengths', 'tokens']")
            tokens = handle.get_tensor("tokens")
            lengths = handle.get_tensor("lengths")
    except ValueError as error:
        raise ValueError(f"{str(path)!r} is not a suffix cache file: {error}") from error
    except Exception as error:  # safetensors' parse errors
        raise ValueError(f"{str(path)!r} is not a suffix cache file (damaged or another format): {error}") from error
    missing = [key for key in _METADATA_KEYS if key not in metadata]
    if metadata.get("format") != FORMAT or missing:
        raise ValueError(f"{str(path)!r} is not a suffix cache file: metadata lacks {missing or ['format']}")
    if metadata["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{str(path)!r}: suffix cache format version {metadata['format_version']!r}; this version of hf_specdec "
            f"reads version {FORMAT_VERSION!r}"
        )
    if tokens.dtype != np.int32 or tokens.ndim != 1 or lengths.dtype != np.int64 or lengths.ndim != 1:
        raise ValueError(f"{str(path)!r} is damaged: tokens must be int32 [N] and lengths int64 [R]")
    if metadata["sha256"] != _checksum(tokens, lengths):
        raise ValueError(f"{str(path)!r} is damaged: its checksum does not match its tokens")
    try:
        vocab_size = int(metadata["vocab_size"])
        config = SuffixConfig.from_dict(json.loads(metadata["config"]))
    except (ValueError, TypeError) as error:
        raise ValueError(f"{str(path)!r} is damaged: {error}") from error
    if (lengths < 0).any() or int(lengths.sum()) != tokens.size:
        raise ValueError(f"{str(path)!r} is damaged: the lengths do not add up to the tokens")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"{str(path)!r} is damaged: token ids outside [0, {vocab_size})")
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    sequences = tuple(tokens[bounds[i] : bounds[i + 1]] for i in range(lengths.size))
    return CacheFile(sequences, vocab_size, metadata["tokenizer_fingerprint"], config)
