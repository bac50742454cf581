"""The batch-size rules a user can set on top of the adaptive schedule, as vLLM spells them: no speculation from
`disable_by_batch_size` rows up, and a per-batch-size cap on k (`num_speculative_tokens_per_batch_size`)."""

from __future__ import annotations

from typing import Any

FIELD = "SpeculativeConfig.num_speculative_tokens_per_batch_size"


def check_batch_size_schedule(value: Any, max_k: int) -> tuple[tuple[int, int, int], ...]:
    """`[[start, end, k], ...]` validated (ints, 1 <= start <= end, 0 <= k <= num_speculative_tokens, sorted,
    non-overlapping), as a tuple of triples; raises ValueError naming the entry at fault."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{FIELD}: expected a non-empty list of [start, end, k] entries, got {value!r}")
    entries = []
    for i, entry in enumerate(value):
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or any(isinstance(x, bool) or not isinstance(x, int) for x in entry)):
            raise ValueError(f"{FIELD}[{i}]: expected [start, end, k] (three ints), got {entry!r}")
        start, end, k = entry
        if start < 1 or end < start:
            raise ValueError(f"{FIELD}[{i}]: batch sizes [start, end] need 1 <= start <= end, got {list(entry)}")
        if not 0 <= k <= max_k:
            raise ValueError(
                f"{FIELD}[{i}]: k = {k} must be in [0, num_speculative_tokens = {max_k}] (0 turns speculation off)"
            )
        if entries and start <= entries[-1][1]:
            raise ValueError(
                f"{FIELD}[{i}]: range {list(entry)} overlaps or comes before {list(entries[-1])}; give the ranges "
                f"sorted by batch size, without overlaps"
            )
        entries.append((start, end, k))
    return tuple(entries)


def batch_size_cap(
    batch_size: int,
    max_k: int,
    disable_by_batch_size: int | None,
    per_batch_size: tuple[tuple[int, int, int], ...] | None,
) -> int:
    """The most draft tokens a step may propose per row with `batch_size` rows generating (a batch size no range
    covers keeps `max_k`)."""
    if disable_by_batch_size is not None and batch_size >= disable_by_batch_size:
        return 0
    for start, end, k in per_batch_size or ():
        if start <= batch_size <= end:
            return k
    return max_k
