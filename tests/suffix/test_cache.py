"""SuffixCache: first-in first-out eviction and the memory bound, requests evicted or cleared while they run,
concurrent requests in threads, the vocabulary binding, and what it reports."""

from __future__ import annotations

import random
import threading
import time
import tracemalloc

import pytest

from hf_specdec.suffix import SuffixCache, SuffixConfig, propose_suffix_draft
from tests.conftest import run_racing_threads
from tests.suffix.reference import string_counts


def _assert_global_counts(cache: SuffixCache, outputs) -> None:
    with cache.reading() as tree:
        tree.check()
        expected = string_counts(outputs, tree.max_depth)
        assert {s: tree.count(s) for s in expected} == dict(expected)
        assert tree.num_strings == len(expected)


def test_oldest_outputs_are_evicted_first():
    cache = SuffixCache(SuffixConfig(max_depth=4, max_cached_requests=3))
    outputs = [[10 * i + j for j in range(5)] + [1, 2] for i in range(10)]
    for n, output in enumerate(outputs, start=1):
        cache.add(output)
        assert cache.num_requests == min(n, 3)
        _assert_global_counts(cache, outputs[max(0, n - 3) : n])
    assert cache.num_tokens == 21
    assert cache.info().num_requests == 3


def test_memory_stays_bounded_by_max_cached_requests():
    rng = random.Random(0)
    cache = SuffixCache(SuffixConfig(max_cached_requests=5))
    sizes = []
    for _ in range(60):
        cache.add([rng.randrange(300) for _ in range(200)])
        info = cache.info()
        assert info.num_tokens <= 5 * 200 and info.num_nodes <= 2 * info.num_tokens + 1
        sizes.append(info.memory_bytes)
    assert max(sizes[10:]) <= 1.5 * sizes[5]  # full after 5 outputs; more outputs replace, never add


def test_memory_estimate_is_close_to_what_python_allocates():
    rng = random.Random(1)
    outputs = [[rng.randrange(2000) for _ in range(300)] for _ in range(40)]
    outputs += [output[:150] + [rng.randrange(2000) for _ in range(150)] for output in outputs]  # repeats
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = SuffixCache()
        for output in outputs:
            cache.add(output)
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    estimate = cache.info().memory_bytes
    assert 0.75 * allocated <= estimate <= 1.25 * allocated, (estimate, allocated)


def test_a_request_evicted_or_cleared_while_running_stops_adding_its_output():
    cache = SuffixCache(SuffixConfig(max_depth=4, max_cached_requests=1))
    first = cache.start_request([1])
    first.extend([2, 3])
    second = cache.start_request([1])  # evicts the first request's output
    first.extend([4])  # still fine for its own local tree
    assert first.local.count([3, 4]) == 1
    second.extend([5, 6])
    _assert_global_counts(cache, [[5, 6]])
    cache.clear()
    assert cache.num_requests == 0
    second.extend([7])
    second.finish()
    _assert_global_counts(cache, [])
    assert propose_suffix_draft(cache, first, [1, 2, 3, 4, 1], 3).tokens == (2,)  # local only, 1-token match
    first.finish()


def test_zero_cached_requests_keeps_no_global_tree():
    cache = SuffixCache(SuffixConfig(max_cached_requests=0))
    cache.add([1, 2, 3])
    with cache.start_request([7, 1, 2]) as request:
        request.extend([3, 1, 2])
        draft = propose_suffix_draft(cache, request, [7, 1, 2, 3, 1, 2], 2)
    assert (draft.tokens, draft.source) == ((3, 1), "local")
    assert cache.info().num_requests == cache.num_tokens == 0
    with cache.reading() as tree:
        assert tree is None


def test_concurrent_requests_from_threads_keep_the_global_tree_exact():
    cache = SuffixCache(SuffixConfig(max_depth=6, max_cached_requests=6))  # evicts while others read and write
    with cache.reading() as tree:  # hand the GIL to another thread in the middle of updates and lookups
        new_node, continuations = tree._new_node, tree.continuations
        tree._new_node = lambda *args: (time.sleep(0), new_node(*args))[1]
        tree.continuations = lambda *args: (time.sleep(0), continuations(*args))[1]
    outputs: list[list[int]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def serve(worker: int) -> None:
        try:
            rng = random.Random(worker)
            start.wait()
            for _ in range(4):
                prompt = [rng.randrange(5) for _ in range(10)]
                context, output = list(prompt), []
                with cache.start_request(prompt) as request:
                    for step in range(150):
                        new = [rng.randrange(5) for _ in range(rng.randint(1, 3))]
                        if step % 5 == 0:  # mostly updates, which race hardest, and drafts now and then
                            draft = propose_suffix_draft(cache, request, context, 3)
                            # a draft read while the tree changed could see a child more frequent than its parent
                            assert all(0 < p <= 1 for p in draft.probs)
                            assert all(p <= draft.probs[q] for p, q in zip(draft.probs, draft.parents) if q >= 0)
                            new = list(draft.tokens[:2]) + new
                        request.extend(new)
                        context += new
                        output += new
                outputs.append(output)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    run_racing_threads(serve, 8)
    assert not errors, errors
    with cache.reading() as tree:
        held = [tree.sequence(seq).tolist() for seq in tree.sequence_ids()]
    assert len(held) == 6 and all(output in outputs for output in held)  # the newest six, none cut short
    _assert_global_counts(cache, held)


def test_vocabulary_binding_and_bad_tokens():
    cache = SuffixCache(vocab_size=100)
    cache.bind(100, "sha256:abc")
    cache.bind(None, "sha256:abc")
    with pytest.raises(ValueError, match="vocabulary of 100 tokens, used with one of 50"):
        cache.bind(50, None)
    with pytest.raises(ValueError, match="fingerprint sha256:abc, used with sha256:def"):
        cache.bind(None, "sha256:def")
    with pytest.raises(ValueError, match=r"add: output: token ids must lie in \[0, 99\], got min 5 and max 100"):
        cache.add([5, 100])
    with pytest.raises(ValueError, match=r"start_request: prompt: token ids must lie in \[0, 99\]"):
        cache.start_request([-1])
    with pytest.raises(ValueError, match="expected token ids"):
        cache.add([1.5])
    with pytest.raises(ValueError, match="SuffixCache.vocab_size: expected an int"):
        SuffixCache(vocab_size=0)
    with pytest.raises(ValueError, match="SuffixCache.config: expected a SuffixConfig, got dict"):
        SuffixCache({"max_depth": 3})
    assert "requests=0/10000" in repr(cache)
