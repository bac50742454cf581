"""benchmarks/schedule_replay.py replays the schedule on a recording (a smoke test on a synthetic one; the real
recordings need the real model's tokenizer): n-gram lookup with lookahead and draft classes, and the model drafter's
accepted counts."""

from types import SimpleNamespace

import numpy as np


def test_replay_runs_fixed_and_adaptive_with_lookahead(benchmark_script):
    replay = benchmark_script("schedule_replay")
    k = 3
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5]
    # n-gram outcomes per position: (lookup depth, accepted), a class and a chain; the model drafter's accepted counts
    ngram = [[k, k] if 2 <= n <= 9 else [0, 0] for n in range(len(tokens) - 1)]
    chains = [np.array(tokens[n + 1 : n + 1 + k]) if 2 <= n <= 9 else np.array([], dtype=np.int64)
              for n in range(len(tokens))]
    lookups = SimpleNamespace(chains=[chains] * 2, classes=[[3 if 2 <= n <= 9 else 0 for n in range(len(tokens))]] * 2)
    data = {"k": k, "records": [{"tokens": tokens, "ngram": ngram, "eagle3": [1] * (len(tokens) - 1)}] * 2}
    medians = [1.0 + 0.05 * width for width in range(k + 1)]
    seconds = replay.StepClock(medians)
    fixed, per_call = replay.replay(data, "ngram", k, "fixed", seconds)
    adaptive, _ = replay.replay(data, "ngram", k, "adaptive", seconds, lookups)
    assert fixed > 1.5 and adaptive > 1.2  # the repeated stretch is drafted either way
    np.testing.assert_allclose(per_call, [fixed, fixed])  # two identical calls under a fixed k
    assert replay.replay(data, "eagle3", 1, "fixed", seconds)[0] > 1.5
    # calls replayed in another order come back in recorded order
    np.testing.assert_array_equal(replay.replay(data, "ngram", k, "fixed", seconds, order=[1, 0])[1], per_call)
    # step times drawn from recorded steps: a single sample per width replays as the medians do; stalls in the
    # drafting widths' samples cost the fixed schedule its speedup
    single = replay.StepClock(medians, [[t] for t in medians], np.random.default_rng(0))
    assert replay.replay(data, "ngram", k, "fixed", single)[0] == fixed
    stalled = [[medians[0]]] + [[t, 3 * t] for t in medians[1:]]
    noisy, _ = replay.replay(data, "ngram", k, "fixed", replay.StepClock(medians, stalled, np.random.default_rng(0)))
    assert noisy < fixed
