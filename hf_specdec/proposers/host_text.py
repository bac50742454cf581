"""A host copy of every row's committed tokens for proposers that match on the text (n-gram lookup, suffix
decoding): the prompt copied once, then extended with the tokens each step emitted (`state.host.emitted`, part of
the engine's one host read per step), so no step copies the sequences back."""

from __future__ import annotations

import numpy as np

from hf_specdec.step import DecodeState


class HostText:
    def __init__(self, state: DecodeState) -> None:
        """The prompt of every row (once per call, at the prompt)."""
        self.tokens = np.zeros((state.batch_size, state.sequences.shape[1]), dtype=np.int64)  # padding included
        self.tokens[:, : state.prompt_length] = state.sequences[:, : state.prompt_length].cpu().numpy()
        self.starts: list[int] = state.pad_lengths.tolist()  # first token of each row after its left padding
        self.ends = [state.prompt_length] * state.batch_size  # tokens of each row the copy holds

    def catch_up(self, state: DecodeState) -> list[np.ndarray]:
        """Append what the last step emitted; returns each row's new tokens. Called after every step (or before
        the next proposal): the host view holds the last step's tokens only."""
        host, added = state.host, []
        for row, (length, end) in enumerate(zip(host.lengths, self.ends)):
            new = host.emitted[row, : length - end] if length > end else self.tokens[row, :0]
            self.tokens[row, end:length] = new
            self.ends[row] = max(length, end)
            added.append(new)
        return added

    def row(self, row: int) -> np.ndarray:
        """[L]: the row's tokens after its left padding."""
        return self.tokens[row, self.starts[row] : self.ends[row]]
