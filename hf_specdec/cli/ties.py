"""Where a greedy output parts from plain `generate`'s, and whether rounding can explain it.

In bfloat16 or float16 a verify forward computes a position's logits in a wider batch of tokens than plain
decoding's one-token forward, and low-precision matrix products round differently with the shape: where plain
decoding's best tokens are (nearly) tied, the argmax can flip and the two continuations part. Such a parting is a
*near-tie*: at the first difference, plain's score of the token the other output took was at most `TIE_SPACINGS`
representable steps of the model's dtype (its spacing at the best score) below plain's best. (bfloat16 logits tie
exactly surprisingly often: a spacing at a logit of 16 to 32 is 0.125, and three tokens can share the best score.)
Any other difference is a fault. In float32 the spacing is 2^16 times finer than bfloat16's, so a near-tie there is
a true tie.

`first_difference` finds the parting of each row, `divergences` classifies them from plain generate's scores
(`output_scores=True`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# how far below plain's best score, in spacings of the model's dtype, the token an output took may have scored for
# its parting to count as a near-tie. Measured on SmolLM2-135M-Instruct in bfloat16 (the README's Low precision),
# every parting was at 0 to 1 spacings without logits processors and at 0 to 2 with a repetition penalty (which
# divides scores by 1.2, off the grid of representable logits); twice the largest leaves room for a longer or
# deeper model's rounding, while the token a fault takes lies in general far below
TIE_SPACINGS = 4.0
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def spacing(value: float, dtype: torch.dtype) -> float:
    """The distance between adjacent representable numbers of `dtype` around `value`."""
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"spacing: dtype {dtype}: expected one of {', '.join(map(str, MANTISSA_BITS))}")
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - MANTISSA_BITS[dtype])


def first_difference(
    # [N] new tokens of plain generate's output for one row (padding after its end included)
    plain: torch.Tensor,
    # [M] the other output's new tokens for the same row
    other: torch.Tensor,
) -> int | None:
    """The index of the first new token where the two differ (a longer output differs where the shorter ends), or
    None if they are equal."""
    length = min(len(plain), len(other))
    unequal = (plain[:length] != other[:length]).nonzero()
    if len(unequal):
        return int(unequal[0])
    return None if len(plain) == len(other) else length


@dataclass(frozen=True)
class Divergence:
    """Where one row's output parts from plain generate's."""

    row: int
    # index of the first differing new token
    position: int
    # plain's best score there minus its score of the other output's token, in spacings of the model's dtype at the
    # best score (None past the end of either output)
    gap_in_spacings: float | None

    @property
    def near_tie(self) -> bool:
        """Rounding explains it: the other output's token scored within `TIE_SPACINGS` of plain's best."""
        return self.gap_in_spacings is not None and self.gap_in_spacings <= TIE_SPACINGS


def divergences(
    # [B, P + N] plain generate's output
    plain: torch.Tensor,
    # [B, P + M] the other output, same prompts
    other: torch.Tensor,
    prompt_length: int,
    # N tensors [B, V]: plain generate's scores at each new token (`output_scores=True`)
    plain_scores: Sequence[torch.Tensor],
    dtype: torch.dtype,
) -> list[Divergence]:
    """Each row whose new tokens differ from plain's: where, and whether it is a near-tie."""
    if plain.shape[0] != other.shape[0]:
        raise ValueError(f"divergences: {plain.shape[0]} plain rows against {other.shape[0]} other rows")
    found = []
    for row in range(plain.shape[0]):
        position = first_difference(plain[row, prompt_length:], other[row, prompt_length:])
        if position is None:
            continue
        gap = None
        if position < len(plain_scores) and prompt_length + position < other.shape[1]:
            scores = plain_scores[position][row].float()  # [V]
            best = float(scores.max())
            gap = (best - float(scores[other[row, prompt_length + position]])) / spacing(best, dtype)
        found.append(Divergence(row, position, gap))
    return found
