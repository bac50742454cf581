"""The user's logits processors, applied at every verified position with that position's true prefix.

Plain `generate` runs the processor list once per token on `input_ids [B, L]`. A verify step scores many
positions of every row at once (k + 1 chain positions, or every node of a tree), and rows have different lengths,
so each position must see its row's committed tokens followed by the draft tokens on its path. Processors whose output does not
depend on the prefix (temperature, top-k, top-p, ...) run once over every position; any other processor runs
once per distinct prefix length, on the rows that share it. A processor of transformers' that holds per-row state
(`PER_ROW_STATE`: the repetition penalty's per-row `prompt_ignore_length`, the encoder repetition penalty's
prompts) is called on a shallow copy whose row tensors are sliced to the same rows; every other tensor a processor holds (the tokens it suppresses, its EOS ids) is
the same for every row, whatever its length. `prefix_allowed_tokens_fn` is called with the index of the row's prompt in
the batch, as in plain `generate` (rows keep their place in the batch for the whole call).
"""

from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EncoderRepetitionPenaltyLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from hf_specdec.sampling import PREFIX_FREE_PROCESSORS
from hf_specdec.step.state import DecodeState

# transformers' processors that speculation cannot run, each with the generate option that adds it and why. A
# processor must be a function of its (input_ids, scores) arguments: a verify step calls it on many positions at
# once, on subsets of rows, and more than once per emitted token.
UNSUPPORTED_PROCESSORS = {
    SynthIDTextWatermarkLogitsProcessor: (
        "watermarking_config",
        ("a SynthIDTextWatermarkingConfig's processor keeps state that assumes one call per generated token, in "
         "order (WatermarkingConfig's green lists depend on the prefix only and are supported)"),
    ),
    UnbatchedClassifierFreeGuidanceLogitsProcessor: (
        "guidance_scale",
        ("classifier-free guidance runs the model on its own unconditional context, one token per call, inside its "
         "processor"),
    ),
}


# transformers' processors that keep state per row of the batch: the tensor attributes whose first dimension is the
# batch, or the prompts the batch repeats (`num_return_sequences` copies of each, as the encoder repetition penalty
# holds its prompts); a custom processor holds none: it must be a function of its arguments
PER_ROW_STATE = {RepetitionPenaltyLogitsProcessor: ("prompt_ignore_length",),
                 EncoderRepetitionPenaltyLogitsProcessor: ("encoder_input_ids",)}


def check_processors(logits_processor: LogitsProcessorList) -> None:
    """Refuses, naming the generate option that added it, a processor speculation cannot run."""
    for processor in logits_processor:
        for kind, (option, why) in UNSUPPORTED_PROCESSORS.items():
            if isinstance(processor, kind):
                raise ValueError(
                    f"{option}: {why}, so it cannot be combined with speculative decoding; drop {option} or the "
                    "speculative config"
                )


class PositionScorer:
    """Turns raw target logits of a verify step into the scores plain `generate` would have seen."""

    def __init__(self, logits_processor: LogitsProcessorList) -> None:
        check_processors(logits_processor)
        self.logits_processor = logits_processor
        self.all_prefix_free = all(isinstance(p, PREFIX_FREE_PROCESSORS) for p in logits_processor)

    def __call__(
        self,
        state: DecodeState,
        # [B, W, V] raw logits of the verified positions (chain positions or tree nodes)
        logits: torch.Tensor,
        # [B, W, D]: the draft tokens between each row's committed text and each position (its path)
        path_tokens: torch.Tensor,
        # [B, W]: how many of those path tokens each position follows (its depth)
        depths: torch.Tensor,
        # the same depths on the host when every row shares them (a chain, a static tree): the prefix lengths are
        # then grouped on the host, with no device read
        host_depths: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Returns processed float32 scores [B, W, V]: position (b, w) sees the prefix
        sequences[b, :lengths[b]] + path_tokens[b, w, :depths[b, w]]."""
        batch, width, vocab = logits.shape
        scores = logits.to(torch.float32, copy=True)  # as plain generate: processors may work in place
        if len(self.logits_processor) == 0:
            return scores
        if self.all_prefix_free:
            flat_ids = state.sequences.new_zeros((batch * width, 1))
            return self.logits_processor(flat_ids, scores.reshape(batch * width, vocab)).reshape(batch, width, vocab)
        out = torch.empty_like(scores)
        for length, (rows, cols) in _by_prefix_length(state, depths, host_depths):
            committed = state.lengths[rows, None]  # [g, 1]
            column = torch.arange(length, device=logits.device)[None, :]
            along_path = (column - committed).clamp(min=0, max=max(path_tokens.shape[2] - 1, 0))
            path = path_tokens[rows, cols].gather(1, along_path) if path_tokens.shape[2] else along_path
            prefix = torch.where(column < committed, state.sequences[rows, :length], path)
            processors = LogitsProcessorList(_select_rows(p, rows, batch) for p in self.logits_processor)
            out[rows, cols] = processors(prefix, scores[rows, cols])
        return out


def _by_prefix_length(
    state: DecodeState,
    # [B, W]
    depths: torch.Tensor,
    host_depths: tuple[int, ...] | None,
):
    """(prefix length, (rows [g], cols [g])) for every distinct prefix length of the verified positions: on the
    host when the depths are known there, else read from the device (a host sync per step, and one per length)."""
    if host_depths is None:
        prefix_lengths = state.lengths[:, None] + depths  # [B, W]
        for length in prefix_lengths.unique().tolist():
            yield length, (prefix_lengths == length).nonzero(as_tuple=True)
        return
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for row, committed in enumerate(state.host.lengths):
        for col, depth in enumerate(host_depths):
            rows, cols = groups.setdefault(committed + depth, ([], []))
            rows.append(row)
            cols.append(col)
    device = depths.device
    for length in sorted(groups):
        rows, cols = groups[length]
        yield length, (torch.tensor(rows, device=device), torch.tensor(cols, device=device))


def _select_rows(
    processor,
    # [g] long: the rows of the batch it is called on
    rows: torch.Tensor,
    batch_size: int,
):
    """The processor as it applies to `rows` of the batch: its per-row tensor attributes (`PER_ROW_STATE`) are
    sliced (one per prompt: each row takes its prompt's, rows being the prompts' copies in order). Other tensors are not, even where their length happens to be the batch size (two suppressed tokens in a
    batch of two). A `prefix_allowed_tokens_fn` is called with each prefix's row of the batch, not its place among
    `rows`."""
    if isinstance(processor, PrefixConstrainedLogitsProcessor):
        return _with_batch_rows(processor, rows)
    names = next((names for kind, names in PER_ROW_STATE.items() if isinstance(processor, kind)), ())
    row_state = {name: getattr(processor, name) for name in names
                 if isinstance(getattr(processor, name, None), torch.Tensor) and getattr(processor, name).dim() >= 1}
    if not row_state:
        return processor
    selected = copy.copy(processor)
    for name, value in row_state.items():
        copies = max(batch_size // value.shape[0], 1)
        setattr(selected, name, value[rows.to(value.device) // copies])
    return selected


def _with_batch_rows(
    processor: PrefixConstrainedLogitsProcessor,
    # [g] long: the batch row of each prefix the processor is called on
    rows: torch.Tensor,
) -> PrefixConstrainedLogitsProcessor:
    """The processor whose callback gets `(batch_id, prefix)` for the prefix at place i of its input, `batch_id`
    as plain `generate` gives it: the index of the row's prompt (transformers builds the processor with
    `num_return_sequences` as its beam count, so a prompt's copies share their prompt's index)."""
    prompts = [row // processor._num_beams for row in rows.tolist()]
    allowed = processor._prefix_allowed_tokens_fn
    return PrefixConstrainedLogitsProcessor(lambda place, prefix: allowed(prompts[place], prefix), num_beams=1)
