"""`SuffixConfig`: the settings of suffix decoding, validated before any work is done. Defaults are vLLM's."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class SuffixConfig:
    """How the suffix trees are built and how drafts are scored. Every error names the field."""

    max_depth: int = field(
        default=24,
        metadata={
            "help": "longest token string the trees count (vLLM's suffix_decoding_max_tree_depth); bounds both the "
            "matched context and the draft: a match of m tokens drafts at most max_depth - m tokens. Updates cost "
            "O(max_depth) per token, lookups O(max_depth^2)"
        },
    )
    max_cached_requests: int = field(
        default=10000,
        metadata={
            "help": "outputs of earlier requests kept in the global tree, first in first out; 0 turns the global "
            "tree off"
        },
    )
    max_spec_factor: float = field(
        default=1.0,
        metadata={"help": "a match of m tokens drafts at most floor(m * max_spec_factor + max_spec_offset) tokens"},
    )
    max_spec_offset: float = field(default=0.0, metadata={"help": "see max_spec_factor"})
    min_token_prob: float = field(
        default=0.1,
        metadata={
            "help": "a draft token is proposed only while its running probability (the product of count ratios "
            "from the match to it) is at least this"
        },
    )

    def __post_init__(self) -> None:
        _check_int("max_depth", self.max_depth, 1)
        _check_int("max_cached_requests", self.max_cached_requests, 0)
        _check_number("max_spec_factor", self.max_spec_factor)
        if self.max_spec_factor < 0:
            raise ValueError(f"SuffixConfig.max_spec_factor: expected a number >= 0, got {self.max_spec_factor!r}")
        _check_number("max_spec_offset", self.max_spec_offset)
        _check_number("min_token_prob", self.min_token_prob)
        if not 0 < self.min_token_prob <= 1:
            raise ValueError(
                f"SuffixConfig.min_token_prob: expected a probability in (0, 1], got {self.min_token_prob!r}"
            )

    def draft_budget(self, match_length: int, max_tokens: int) -> int:
        """Most draft tokens a match of `match_length` tokens may propose: min(max_tokens, floor(match_length *
        max_spec_factor + max_spec_offset)), and never below 0."""
        return max(0, min(max_tokens, math.floor(match_length * self.max_spec_factor + self.max_spec_offset)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SuffixConfig:
        """The config saved by `to_dict`; unknown keys are an error naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"SuffixConfig: unknown settings {unknown}; known ones are {sorted(known)}")
        return cls(**values)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"SuffixConfig.{name}: expected an int >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"SuffixConfig.{name}: expected a finite number, got {value!r}")
