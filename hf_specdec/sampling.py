"""Sampling pieces the proposers and the verifier share.

`sample` draws one index per row from unnormalised probabilities without a host sync: the exponential race
(gpt-fast's `multinomial_sample_one_no_sync`, vLLM's recovered-token sampler). With E_i independent Exp(1),
argmax_i p_i / E_i is index j with probability p_j / sum(p): E_i / p_i is Exp(p_i), and the smallest of
independent exponentials is the j-th with probability p_j / sum(p). It is exactly the law `torch.multinomial`
draws from, but it is one elementwise pass and an argmax, where `multinomial` checks its input on the host (two
syncs per call on CUDA). The noise comes from the caller's `torch.Generator`, so seeded runs repeat.

`prefix_free` names the user's logits processors that depend on the scores alone: a drafter applies those to its
own logits (`warp`), so it samples from the same warped law the target uses (`draft_distribution`, drawn from by
`draw_draft`).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
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
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)


def prefix_free(logits_processor: LogitsProcessorList) -> LogitsProcessorList:
    """The processors that depend only on the scores (what a draft model can apply to its own logits)."""
    return LogitsProcessorList([p for p in logits_processor if isinstance(p, PREFIX_FREE_PROCESSORS)])


def sample(
    # [..., V] non-negative, not necessarily normalised; rows that are all zero give index 0
    probs: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """[...]: one index per row, drawn with probability proportional to `probs` (see the module docstring)."""
    noise = torch.empty(probs.shape, dtype=probs.dtype, device=probs.device).exponential_(generator=generator)
    # exponential_ may round to exactly 0: p / 0 would be inf (or nan for p = 0); the smallest positive value
    # keeps every zero-probability index at 0
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def warp(
    # [..., V] float
    scores: torch.Tensor,
    # prefix-free processors (`prefix_free`)
    warpers: LogitsProcessorList,
) -> torch.Tensor:
    """[..., V]: the scores after the warpers (which read no prefix: each row is given a dummy one)."""
    flat = scores.reshape(-1, scores.shape[-1])
    prefix = torch.zeros((flat.shape[0], 1), dtype=torch.long, device=flat.device)
    return warpers(prefix, flat).reshape(scores.shape)


def draft_distribution(
    # [..., V] float
    scores: torch.Tensor,
    warpers: LogitsProcessorList,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """[..., V]: the softmax of the warped scores, on the generator's device (what a drafter `sample`s from)."""
    probs = torch.softmax(warp(scores, warpers), dim=-1)
    return probs if generator is None else probs.to(generator.device)


def draw_draft(
    # [..., V] float: a drafter's scores, unwarped
    scores: torch.Tensor,
    do_sample: bool,
    warpers: LogitsProcessorList,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's token per row ([...]) and the distribution it was drawn from ([..., V], None when greedy): the
    scores' argmax when greedy, else a `sample` from `draft_distribution`."""
    if not do_sample:
        return scores.argmax(dim=-1), None
    probs = draft_distribution(scores, warpers, generator)
    return sample(probs, generator), probs


def fit_vocab(
    # [..., V_draft]
    scores: torch.Tensor,
    size: int,
) -> torch.Tensor:
    """[..., size]: a drafter's scores on the target's vocabulary: cut to `size` entries, or padded with -inf (ids
    the drafter lacks are never proposed)."""
    extra = size - scores.shape[-1]
    return scores[..., :size] if extra <= 0 else torch.nn.functional.pad(scores, (0, extra), value=float("-inf"))
