"""A host copy of every row's committed tokens for proposers that read the text (n-gram lookup, suffix decoding, a
draft with another tokenizer): the prompt copied once, then extended with the tokens each step emitted
(`state.host.emitted`, part of the engine's one host read per step), so no step copies the sequences back."""

from __future__ import annotations

import numpy as np
import torch

from hf_specdec.step import DecodeState


class HostText:
    def __init__(
        self,
        state: DecodeState,
        # [B, P] or None: with a mask, the copy leaves out every masked prompt token (right padding too); without,
        # each row's left padding (`state.pad_lengths`)
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        """The prompt of every row (once per call, at the prompt)."""
        batch, prompt_length = state.batch_size, state.prompt_length
        # row b is tokens[b, : ends[b] - skipped[b]]
        self.tokens = np.zeros((batch, state.sequences.shape[1]), dtype=np.int64)
        prompt = state.sequences[:, :prompt_length].cpu().numpy()
        if attention_mask is None:
            keep = np.arange(prompt_length)[None, :] >= state.pad_lengths.cpu().numpy()[:, None]
        else:
            keep = attention_mask[:, :prompt_length].bool().cpu().numpy()
        self.skipped: list[int] = []  # prompt tokens of each row the copy leaves out
        for row in range(batch):
            real = prompt[row, keep[row]]
            self.tokens[row, : real.size] = real
            self.skipped.append(prompt_length - real.size)
        self.ends = [prompt_length] * batch  # each row's length in the engine's sequences when last read

    def catch_up(self, state: DecodeState) -> list[np.ndarray]:
        """Append what the last step emitted; returns each row's new tokens. Called after every step (or before
        the next proposal): the host view holds the last step's tokens only."""
        host, added = state.host, []
        for row, (length, end, skipped) in enumerate(zip(host.lengths, self.ends, self.skipped)):
            new = host.emitted[row, : length - end] if length > end else self.tokens[row, :0]
            self.tokens[row, end - skipped : length - skipped] = new
            self.ends[row] = max(length, end)
            added.append(new)
        return added

    def row(self, row: int) -> np.ndarray:
        """[L]: the row's tokens (its prompt's padding left out)."""
        return self.tokens[row, : self.ends[row] - self.skipped[row]]
