"""What a call's proposers leave with the cache it returns, for a later call continuing from that cache.

A transformers cache keeps the target's keys and values, not what a proposer built beside them: an EAGLE head's own
keys and values over the same text, which it computed from the target's features, cannot be rebuilt from a filled
cache (the features are gone), and a draft model's would have to be computed again over the whole text. The engine
attaches the proposers' state (`Proposer.carry`) to the cache it returns, with the number of positions the cache
held then; a later call passing that cache (or a deep copy of it) as `past_key_values` finds the state in
`DecodeState.carried`, and each proposer takes its own. A cache whose length
changed since (extended by plain `generate`, cropped) carries nothing. What is carried only helps drafting: the
target verifies every draft, so output never depends on it.
"""

from __future__ import annotations

from typing import Any

ATTRIBUTE = "_hf_specdec_carried"


def attach(
    cache: Any,  # the transformers cache a call returns
    carried: tuple,
) -> None:
    """Attach the proposers' state to `cache` (nothing when there is none)."""
    if cache is not None and carried:
        setattr(cache, ATTRIBUTE, (cache.get_seq_length(), carried))


def carried_by(cache: Any) -> tuple:
    """The proposers' state attached to `cache`, if it still holds the positions it held then; else ()."""
    entry = getattr(cache, ATTRIBUTE, None)
    if entry is None or entry[0] != cache.get_seq_length():
        return ()
    return entry[1]
