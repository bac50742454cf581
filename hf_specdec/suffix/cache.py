"""`SuffixCache`: what suffix decoding remembers across requests, and `SuffixRequest`: one request's view of it.

Design
------
* The cache holds one *global* `SuffixTree` over the outputs of requests (earlier ones, and the ones still being
  generated, so that rows generated side by side help each other). At most `max_cached_requests` outputs are
  kept: starting a request beyond that evicts the oldest output, first in first out (its counts are removed; an
  output evicted while its request still runs is no longer extended). `max_cached_requests=0` keeps none.
* Each request also has a *local* tree over its own prompt and output so far, created by `start_request` and
  dropped by `SuffixRequest.finish`; only its request's thread touches it, so it needs no lock.
* Every use of the global tree (adding tokens, evicting, drafting from it, saving, clearing, inspecting) holds the
  cache's lock, so concurrent `generate` calls in threads can share one cache.
* Memory is bounded by `max_cached_requests` times the output length (the trees have at most two nodes per
  token); `info()` reports it.
* A cache is tied to one vocabulary: `bind` (or the constructor) records the vocabulary size and tokenizer
  fingerprint, later bindings must agree, and `save`/`load` store and check them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from hf_specdec.suffix.config import SuffixConfig
from hf_specdec.suffix.files import CacheFile, read_cache_file, write_cache_file
from hf_specdec.suffix.tree import SuffixTree

# Token ids are stored as int32.
MAX_TOKEN_ID = 2**31 - 1


@dataclass(frozen=True)
class SuffixCacheInfo:
    """How much a `SuffixCache` holds."""

    # outputs in the global tree (finished or still being generated)
    num_requests: int
    num_tokens: int
    num_nodes: int
    # estimated bytes of the global tree (nodes, dicts and tokens)
    memory_bytes: int
    max_cached_requests: int


class SuffixCache:
    """The global suffix tree shared by requests, bounded and thread safe (see the module docstring).

    Example::

        cache = SuffixCache(SuffixConfig(max_cached_requests=1000), vocab_size=len(tokenizer),
                            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
        cache.add(tokenizer("an output from the logs")["input_ids"])
        cache.save("warm.safetensors")
    """

    def __init__(
        self,
        config: SuffixConfig | None = None,
        *,
        vocab_size: int | None = None,
        tokenizer_fingerprint: str | None = None,
    ) -> None:
        if config is None:
            config = SuffixConfig()
        if not isinstance(config, SuffixConfig):
            raise ValueError(f"SuffixCache.config: expected a SuffixConfig, got {type(config).__name__}")
        self.config = config
        self._lock = threading.Lock()
        self._tree = self._new_tree() if config.max_cached_requests else None
        self.vocab_size: int | None = None
        self.tokenizer_fingerprint: str | None = None
        if vocab_size is not None or tokenizer_fingerprint is not None:
            self.bind(vocab_size, tokenizer_fingerprint)

    @classmethod
    def shared(cls, config: SuffixConfig, vocab_size: int) -> SuffixCache:
        """The process-wide cache for these settings and vocabulary size: what `SpeculativeConfig(method="suffix")`
        drafts from when it is given no `suffix_cache`, so that later calls (with any config of the same settings)
        draft from the outputs of earlier ones. Models whose tokenizers differ but share a vocabulary size share it
        too (their drafts then just match less); pass each its own `suffix_cache` to keep them apart."""
        key = (config, vocab_size)
        with _SHARED_LOCK:
            cache = _SHARED.get(key)
            if cache is None:
                cache = _SHARED[key] = cls(config, vocab_size=vocab_size)
            return cache

    def _new_tree(self) -> SuffixTree:
        # drafting never takes a child under min_token_prob of its parent, so half of it is a safe index threshold
        return SuffixTree(self.config.max_depth, heavy_fraction=self.config.min_token_prob / 2)

    # ------------------------------------------------------------------ vocabulary

    def bind(self, vocab_size: int | None, tokenizer_fingerprint: str | None) -> None:
        """Ties the cache to a vocabulary; a cache already tied to another one raises, naming the difference."""
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or not 0 < vocab_size <= MAX_TOKEN_ID + 1):
            raise ValueError(f"SuffixCache.vocab_size: expected an int in [1, 2**31], got {vocab_size!r}")
        if tokenizer_fingerprint is not None and not isinstance(tokenizer_fingerprint, str):
            raise ValueError(
                f"SuffixCache.tokenizer_fingerprint: expected a str (see tokenizer_fingerprint()), got "
                f"{type(tokenizer_fingerprint).__name__}"
            )
        with self._lock:
            if vocab_size is not None and self.vocab_size not in (None, vocab_size):
                raise ValueError(
                    f"SuffixCache: built for a vocabulary of {self.vocab_size} tokens, used with one of {vocab_size}; "
                    "use a separate cache per tokenizer"
                )
            if tokenizer_fingerprint is not None and self.tokenizer_fingerprint not in (None, tokenizer_fingerprint):
                raise ValueError(
                    f"SuffixCache: built for the tokenizer with fingerprint {self.tokenizer_fingerprint}, used with "
                    f"{tokenizer_fingerprint}; use a separate cache per tokenizer"
                )
            if vocab_size is not None:
                self.vocab_size = vocab_size
            if tokenizer_fingerprint is not None:
                self.tokenizer_fingerprint = tokenizer_fingerprint

    def _checked_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        values = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if any(isinstance(value, bool) or not isinstance(value, int) for value in values):
            raise ValueError(f"{what}: expected token ids (ints), got {values[:8]!r}...")
        limit = MAX_TOKEN_ID if self.vocab_size is None else self.vocab_size - 1
        if values and (min(values) < 0 or max(values) > limit):
            raise ValueError(f"{what}: token ids must lie in [0, {limit}], got min {min(values)} and max {max(values)}")
        return values

    # ------------------------------------------------------------------ requests

    def start_request(self, prompt: Sequence[int]) -> SuffixRequest:
        """A request's local tree over `prompt` (token ids) and a place for its output in the global tree
        (evicting the oldest output when the cache is full)."""
        return SuffixRequest(self, self._checked_tokens(prompt, "SuffixCache.start_request: prompt"))

    def _register_output(self) -> tuple[SuffixTree, int] | None:
        if self._tree is None:
            return None
        with self._lock:
            return self._tree, self._new_output()

    def _new_output(self) -> int:
        """A new output in the global tree, evicting the oldest ones beyond max_cached_requests (lock held)."""
        while self._tree.num_sequences >= self.config.max_cached_requests:
            self._tree.remove_oldest()
        return self._tree.new_sequence()

    def add(self, output: Sequence[int]) -> None:
        """Adds a finished output (token ids) to the global tree, as if a request had generated it; for warming a
        cache from logs."""
        tokens = self._checked_tokens(output, "SuffixCache.add: output")
        if self._tree is None:
            return
        with self._lock:
            seq = self._new_output()
            self._tree.extend(seq, tokens)
            self._tree.finish(seq)

    @contextmanager
    def reading(self) -> Iterator[SuffixTree | None]:
        """The global tree (None when `max_cached_requests` is 0), held under the cache's lock."""
        with self._lock:
            yield self._tree

    def clear(self) -> None:
        """Forgets every cached output (requests still running stop adding theirs)."""
        with self._lock:
            if self._tree is not None:
                self._tree = self._new_tree()

    # ------------------------------------------------------------------ inspection

    def info(self) -> SuffixCacheInfo:
        """Sizes and estimated memory of the global tree. O(nodes) (about 30 ms per million nodes), holding the
        lock; `num_requests` and `num_tokens` are O(1)."""
        with self._lock:
            tree = self._tree
            if tree is None:
                return SuffixCacheInfo(0, 0, 0, 0, 0)
            return SuffixCacheInfo(tree.num_sequences, tree.num_tokens, tree.num_nodes, tree.memory_bytes(),
                                   self.config.max_cached_requests)

    @property
    def num_requests(self) -> int:
        with self._lock:
            return 0 if self._tree is None else self._tree.num_sequences

    @property
    def num_tokens(self) -> int:
        with self._lock:
            return 0 if self._tree is None else self._tree.num_tokens

    def __repr__(self) -> str:
        return (f"SuffixCache(requests={self.num_requests}/{self.config.max_cached_requests}, "
                f"tokens={self.num_tokens}, vocab_size={self.vocab_size})")

    # ------------------------------------------------------------------ files

    def save(self, path: str | os.PathLike) -> None:
        """Writes the cached outputs, the config, the vocabulary size and the tokenizer fingerprint to a
        safetensors file (see `hf_specdec.suffix.files`)."""
        if self.vocab_size is None or self.tokenizer_fingerprint is None:
            raise ValueError(
                "SuffixCache.save: the cache is not tied to a vocabulary; pass vocab_size= and "
                "tokenizer_fingerprint= (hf_specdec.suffix.tokenizer_fingerprint(tokenizer)) to SuffixCache or bind()"
            )
        with self._lock:
            tree = self._tree
            sequences = () if tree is None else tuple(tree.sequence(seq) for seq in tree.sequence_ids())
            file = CacheFile(sequences, self.vocab_size, self.tokenizer_fingerprint, self.config)
            write_cache_file(path, file)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        vocab_size: int | None = None,
        tokenizer_fingerprint: str | None = None,
    ) -> SuffixCache:
        """A cache with the outputs and config saved in `path`. With `vocab_size` / `tokenizer_fingerprint`
        given, a file written for another vocabulary is refused with an error naming both."""
        file = read_cache_file(path)
        if vocab_size is not None and vocab_size != file.vocab_size:
            raise ValueError(
                f"SuffixCache.load: {str(path)!r} was written for a vocabulary of {file.vocab_size} tokens, this "
                f"model has {vocab_size}"
            )
        if tokenizer_fingerprint is not None and tokenizer_fingerprint != file.tokenizer_fingerprint:
            raise ValueError(
                f"SuffixCache.load: {str(path)!r} was written with the tokenizer {file.tokenizer_fingerprint}, this "
                f"one is {tokenizer_fingerprint}"
            )
        cache = cls(file.config, vocab_size=file.vocab_size, tokenizer_fingerprint=file.tokenizer_fingerprint)
        for sequence in file.sequences:
            cache.add(sequence)
        return cache


class SuffixRequest:
    """One request's suffix state: the local tree over its prompt and output so far, and its output's place in the
    cache's global tree. Used from one thread; `finish` (or leaving a `with` block) drops the local tree."""

    def __init__(self, cache: SuffixCache, prompt: list[int]) -> None:
        self.cache = cache  # the cache that started the request
        self._local: SuffixTree | None = cache._new_tree()
        self._local_seq = self._local.new_sequence()
        self._local.extend(self._local_seq, prompt)
        self._output = cache._register_output()

    @property
    def local(self) -> SuffixTree:
        if self._local is None:
            raise ValueError("SuffixRequest: the request is finished; its local tree is gone")
        return self._local

    def extend(self, tokens: Sequence[int]) -> None:
        """Adds newly generated tokens (ids) to the local tree and to the request's output in the global tree."""
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        self.local.extend(self._local_seq, tokens)
        if self._output is not None:
            tree, seq = self._output
            with self.cache._lock:
                if tree is self.cache._tree and tree.has_sequence(seq):
                    tree.extend(seq, tokens)
                else:  # evicted, or the cache was cleared
                    self._output = None

    def finish(self) -> None:
        """The request is done: its output stays in the global tree, its local tree is dropped."""
        if self._output is not None:
            tree, seq = self._output
            with self.cache._lock:
                if tree.has_sequence(seq):
                    tree.finish(seq)
            self._output = None
        self._local = None

    def __enter__(self) -> SuffixRequest:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()


# the process-wide caches of `SuffixCache.shared`, by (config, vocabulary size)
_SHARED: dict[tuple[SuffixConfig, int], SuffixCache] = {}
_SHARED_LOCK = threading.Lock()
