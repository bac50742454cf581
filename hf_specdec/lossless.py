"""Is a speculative output plain `generate`'s? Where a greedy output parts from it, and whether rounding can explain
it; `check_greedy` runs both on a user's own model and inputs and says.

In bfloat16 or float16 a verify forward computes a position's logits in a wider batch of tokens than plain
decoding's one-token forward, and low-precision matrix products round differently with the shape: where plain
decoding's best tokens are (nearly) tied, the argmax can flip and the two continuations part. Such a parting is a
*near-tie*: at the first difference, plain's score of the token the other output took was at most `TIE_SPACINGS`
representable steps of the model's dtype (its spacing at the best score) below plain's best. (bfloat16 logits tie
exactly surprisingly often: a spacing at a logit of 16 to 32 is 0.125, and three tokens can share the best score.)
Any other difference is a fault. In float32 the spacing is 2^16 times finer than bfloat16's, so a near-tie there is
a true tie.

`first_difference` finds the parting of each row, `divergences` classifies them from plain generate's scores
(`output_scores=True`); `check_greedy` runs plain `generate` and hf_specdec's on the same inputs and returns a
`LosslessReport`. `hf-specdec demo` and `hf-specdec bench` report their outputs the same way.

    report = hf_specdec.check_greedy(model, input_ids, SpeculativeConfig(method="ngram"), attention_mask=mask,
                                     max_new_tokens=64)
    print(report)            # identical, or each parting with its gap
    assert report.lossless   # identical, or parting only at near-ties
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_specdec.config import SpeculativeConfig
from hf_specdec.integration import generate

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


def _trimmed(
    # [B, P + N] and [B, P + M]: two outputs for the same prompts
    a: torch.Tensor,
    b: torch.Tensor,
    pad_token_id: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two over the columns both have where the wider one's extra columns hold only `pad_token_id` (a call
    whose rows all stopped early may end there); otherwise as they are."""
    width = min(a.shape[1], b.shape[1])
    wider = a if a.shape[1] > width else b
    if pad_token_id is not None and bool((wider[:, width:] == pad_token_id).all()):
        return a[:, :width], b[:, :width]
    return a, b


def same_output(
    # [B, P + N] and [B, P + M]: two outputs for the same prompts
    a: torch.Tensor,
    b: torch.Tensor,
    pad_token_id: int | None = None,
) -> bool:
    """Equal outputs, but for trailing columns of padding on one side (see `_trimmed`)."""
    a, b = _trimmed(a, b, pad_token_id)
    return a.shape == b.shape and torch.equal(a, b)


def divergences(
    # [B, P + N] plain generate's output
    plain: torch.Tensor,
    # [B, P + M] the other output, same prompts
    other: torch.Tensor,
    prompt_length: int,
    # N tensors [B, V]: plain generate's scores at each new token (`output_scores=True`)
    plain_scores: Sequence[torch.Tensor],
    dtype: torch.dtype,
    pad_token_id: int | None = None,
) -> list[Divergence]:
    """Each row whose new tokens differ from plain's (trailing padding on one side aside, as `same_output`
    compares): where, and whether it is a near-tie."""
    if plain.shape[0] != other.shape[0]:
        raise ValueError(f"divergences: {plain.shape[0]} plain rows against {other.shape[0]} other rows")
    plain, other = _trimmed(plain, other, pad_token_id)
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


class PlainScores:
    """Plain generate's scores on each of a list of batches, computed once, when first asked for (an output that
    differs from plain's there), and checked to give plain's output again (`outputs`, set once plain has run)."""

    def __init__(self, model, batches: Sequence[tuple[torch.Tensor, torch.Tensor | None]], kwargs: dict) -> None:
        # batches: ([B, P] token ids, [B, P] attention mask or None); kwargs: plain generate's, greedy
        self.model, self.batches, self.kwargs = model, batches, kwargs
        self.outputs: Sequence[torch.Tensor] | None = None  # per batch: [B, P + N] plain generate's output
        self.scores: dict[int, Sequence[torch.Tensor]] = {}

    def __call__(self, index: int) -> Sequence[torch.Tensor]:
        """N tensors [B, V]: plain generate's scores at each new token of batch `index`."""
        if index not in self.scores:
            ids, mask = self.batches[index]
            out = self.model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True,
                                      **self.kwargs)
            if not same_output(out.sequences, self.outputs[index], self.kwargs.get("pad_token_id")):
                raise RuntimeError("plain generate gave another output when run again: it is not deterministic "
                                   "here, so outputs cannot be compared with it")
            self.scores[index] = out.scores
        return self.scores[index]

    def divergences(self, index: int, other: torch.Tensor) -> list[Divergence]:
        """Where `other` [B, P + M], an output on batch `index`, parts from plain's."""
        return divergences(self.outputs[index], other, self.batches[index][0].shape[1], self(index),
                           self.model.dtype, self.kwargs.get("pad_token_id"))


@dataclass(frozen=True)
class LosslessReport:
    """What `check_greedy` found."""

    # [B, P + N] plain generate's output and hf_specdec's (trailing padding on one side cut)
    plain: torch.Tensor
    speculative: torch.Tensor
    # each row whose output parts from plain's
    divergences: tuple[Divergence, ...]
    dtype: torch.dtype

    @property
    def identical(self) -> bool:
        return not self.divergences

    @property
    def faults(self) -> tuple[Divergence, ...]:
        """The partings rounding does not explain."""
        return tuple(d for d in self.divergences if not d.near_tie)

    @property
    def lossless(self) -> bool:
        """Identical to plain generate's output, or parting from it only at near-ties."""
        return not self.faults

    def __str__(self) -> str:
        rows = self.plain.shape[0]
        if self.identical:
            return f"identical to plain generate on all {rows} rows"
        lines = [(f"{len(self.divergences)} of {rows} rows part from plain generate's output, "
                  f"{len(self.faults)} where rounding does not explain it ({self.dtype}, near-tie: at most "
                  f"{TIE_SPACINGS:g} spacings)")]
        for d in self.divergences:
            gap = "past the end of an output" if d.gap_in_spacings is None else (
                f"the token taken scored {d.gap_in_spacings:.2f} spacings below plain's best")
            lines.append(f"  row {d.row}, new token {d.position}: {gap}: {'near-tie' if d.near_tie else 'FAULT'}")
        return "\n".join(lines)


def check_greedy(
    model,
    # [B, P]
    input_ids: torch.Tensor,
    speculative: SpeculativeConfig,
    # [B, P] or None
    attention_mask: torch.Tensor | None = None,
    **generate_kwargs,
) -> LosslessReport:
    """Greedy plain `model.generate` and hf_specdec's speculative `generate` with `speculative` on the same inputs
    and `generate_kwargs` (max_new_tokens, logits processors, stopping, ...), compared row by row: where an output
    parts from plain's, plain's scores there say whether it is a near-tie (in low precision, rounding's call) or a
    fault. Sampled outputs differ by design, so sampling is refused (the library's chi-square tests check that
    its sampling follows the target's distribution)."""
    if not isinstance(speculative, SpeculativeConfig):
        raise TypeError(f"check_greedy: speculative: expected a SpeculativeConfig, got {type(speculative).__name__}")
    if generate_kwargs.get("do_sample"):
        raise ValueError("check_greedy: do_sample=True: sampled outputs differ from plain generate's by design; "
                         "compare greedy outputs (drop do_sample)")
    taken = {"return_dict_in_generate", "output_scores"} & set(generate_kwargs)
    if taken:
        raise ValueError(f"check_greedy: {', '.join(sorted(taken))}: set by check_greedy itself; drop them")
    kwargs = {**generate_kwargs, "do_sample": False}
    plain = model.generate(input_ids, attention_mask=attention_mask, return_dict_in_generate=True,
                           output_scores=True, **kwargs)
    ours = generate(model, input_ids, attention_mask=attention_mask, speculative=speculative, **kwargs)
    ours = ours.sequences if hasattr(ours, "sequences") else ours
    pad = kwargs.get("pad_token_id", model.generation_config.pad_token_id)
    found = divergences(plain.sequences, ours, input_ids.shape[1], plain.scores, model.dtype, pad)
    return LosslessReport(*_trimmed(plain.sequences, ours, pad), tuple(found), model.dtype)
