"""Sampling pieces the proposers and the verifier share: which of the user's logits processors depend on the
scores alone (a drafter applies those to its own logits, so it samples from the same warped law the target uses)."""

from __future__ import annotations

from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

PREFIX_FREE_PROCESSORS = (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)


def prefix_free(logits_processor: LogitsProcessorList) -> LogitsProcessorList:
    """The processors that depend only on the scores (what a draft model can apply to its own logits)."""
    return LogitsProcessorList([p for p in logits_processor if isinstance(p, PREFIX_FREE_PROCESSORS)])
