"""Suffix cache files: a round trip drafts the same, damaged or foreign files and other vocabularies are clear
errors, and tokenizer fingerprints tell vocabularies apart."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest
from safetensors.numpy import save_file

from hf_specdec.suffix import SuffixCache, SuffixConfig, propose_suffix_draft, tokenizer_fingerprint
from hf_specdec.testbed.tokenizer import train_tokenizer

FINGERPRINT = "sha256:" + "0" * 64


def _filled_cache(config: SuffixConfig) -> tuple[SuffixCache, list[list[int]]]:
    rng = random.Random(0)
    cache = SuffixCache(config, vocab_size=50, tokenizer_fingerprint=FINGERPRINT)
    phrases = [[rng.randrange(50) for _ in range(6)] for _ in range(8)]
    outputs = [[t for _ in range(10) for t in rng.choice(phrases)] for _ in range(12)]
    for output in outputs:
        cache.add(output)
    running = cache.start_request(outputs[0][:5])
    running.extend(outputs[1][:20])  # a request still running: its output so far is saved too
    return cache, outputs


def test_round_trip_drafts_exactly_the_same(tmp_path):
    config = SuffixConfig(max_depth=12, max_cached_requests=10, max_spec_factor=2.0, min_token_prob=0.2)
    cache, outputs = _filled_cache(config)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    loaded = SuffixCache.load(path, vocab_size=50, tokenizer_fingerprint=FINGERPRINT)
    assert loaded.config == config
    assert (loaded.vocab_size, loaded.tokenizer_fingerprint) == (50, FINGERPRINT)
    before, after = cache.info(), loaded.info()
    assert (after.num_requests, after.num_tokens, after.num_nodes) == (10, before.num_tokens, before.num_nodes)
    drafted = 0
    for output in outputs:
        for cut in range(3, len(output), 7):
            context = output[:cut]
            draft = propose_suffix_draft(cache, None, context, 8)
            assert propose_suffix_draft(loaded, None, context, 8) == draft
            drafted += draft.num_tokens > 0
    assert drafted > 50
    with loaded.reading() as tree:
        tree.check()


def test_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    cache, _ = _filled_cache(SuffixConfig())
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    with pytest.raises(ValueError, match="written for a vocabulary of 50 tokens, this model has 51"):
        SuffixCache.load(path, vocab_size=51)
    other = "sha256:" + "1" * 64
    with pytest.raises(ValueError, match=f"written with the tokenizer {FINGERPRINT}, this one is {other}"):
        SuffixCache.load(path, tokenizer_fingerprint=other)
    loaded = SuffixCache.load(path)  # no check asked: the file's vocabulary binds the cache
    with pytest.raises(ValueError, match="vocabulary of 50 tokens, used with one of 51"):
        loaded.bind(51, None)


def test_saving_needs_a_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="not tied to a vocabulary; pass vocab_size= and tokenizer_fingerprint="):
        SuffixCache().save(tmp_path / "cache.safetensors")


def _write(path, tokens, lengths, **overrides):
    tokens, lengths = np.asarray(tokens, dtype=np.int32), np.asarray(lengths, dtype=np.int64)
    digest = hashlib.sha256(tokens.astype("<i4").tobytes())
    digest.update(lengths.astype("<i8").tobytes())
    metadata = {"format": "hf_specdec.suffix_cache", "format_version": "1", "vocab_size": "50",
                "tokenizer_fingerprint": FINGERPRINT, "config": json.dumps(SuffixConfig().to_dict()),
                "sha256": digest.hexdigest()}
    metadata.update(overrides)
    save_file({"tokens": tokens, "lengths": lengths}, str(path), metadata={k: v for k, v in metadata.items() if v})


def test_damaged_and_foreign_files_are_clear_errors(tmp_path):
    cache, _ = _filled_cache(SuffixConfig())
    good = tmp_path / "good.safetensors"
    cache.save(good)
    data = good.read_bytes()
    bad = tmp_path / "bad.safetensors"

    def refused(content: bytes, message: str) -> None:
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            SuffixCache.load(bad)

    refused(data[:-10], "is not a suffix cache file \\(damaged or another format\\)")
    refused(b"not a file at all", "is not a suffix cache file")
    refused(data[:-1] + bytes([data[-1] ^ 1]), "is damaged: its checksum does not match")
    save_file({"weight": np.zeros(3, dtype=np.float32)}, str(bad))
    with pytest.raises(ValueError, match=r"holds tensors \['weight'\]"):
        SuffixCache.load(bad)
    _write(bad, [1, 2], [2], format="")
    with pytest.raises(ValueError, match=r"metadata lacks \['format'\]"):
        SuffixCache.load(bad)
    _write(bad, [1, 2], [2], format_version="9")
    with pytest.raises(ValueError, match="format version '9'"):
        SuffixCache.load(bad)
    _write(bad, [1, 2], [3])
    with pytest.raises(ValueError, match="lengths do not add up"):
        SuffixCache.load(bad)
    _write(bad, [1, 50], [2])
    with pytest.raises(ValueError, match=r"token ids outside \[0, 50\)"):
        SuffixCache.load(bad)
    _write(bad, [1, 2], [2], config=json.dumps({"max_depth": 0}))
    with pytest.raises(ValueError, match="SuffixConfig.max_depth: expected an int >= 1"):
        SuffixCache.load(bad)
    _write(bad, [1, 2], [2], config=json.dumps({"depth": 3}))
    with pytest.raises(ValueError, match=r"unknown settings \['depth'\]"):
        SuffixCache.load(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SuffixCache.load(tmp_path / "missing.safetensors")
    _write(bad, [1, 2, 3], [1, 2])  # a well-formed file written by hand loads
    assert SuffixCache.load(bad).num_tokens == 3


def test_tokenizer_fingerprints_tell_vocabularies_apart():
    first = train_tokenizer(["def add(a, b): return a + b"] * 20, vocab_size=512)
    second = train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=512)
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(first)
    assert tokenizer_fingerprint(first).startswith("sha256:")
    assert tokenizer_fingerprint(first) != tokenizer_fingerprint(second)
    with pytest.raises(ValueError, match="expected a tokenizer with get_vocab\\(\\), got int"):
        tokenizer_fingerprint(3)
