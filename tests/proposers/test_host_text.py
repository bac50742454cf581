"""The host copy of each row's committed tokens: the prompt without its padding, then what each step emitted."""

from __future__ import annotations

import numpy as np
import torch

from hf_specdec.proposers.host_text import HostText
from hf_specdec.step import DecodeState
from hf_specdec.step.state import HostView

PAD = 0


def _state(ids: list[list[int]], mask: list[list[int]]) -> tuple[DecodeState, torch.Tensor]:
    attention_mask = torch.tensor(mask)
    return DecodeState.start(torch.tensor(ids), attention_mask, max_length=16, extra_capacity=2,
                             pad_token_id=PAD), attention_mask


def _step(state: DecodeState, emitted: list[list[int]]) -> None:
    """What the engine's host view says after a step that emitted these tokens (padded to one width)."""
    width = max(len(e) for e in emitted)
    tokens = np.array([e + [PAD] * (width - len(e)) for e in emitted], dtype=np.int64)
    lengths = [length + len(e) for length, e in zip(state.host.lengths, emitted)]
    state.host = HostView(lengths, [False] * len(emitted), [len(e) for e in emitted], [0] * len(emitted), tokens)


def test_left_padding_the_mask_and_the_pad_lengths_agree():
    state, mask = _state([[PAD, PAD, 5, 6], [7, 8, 9, 10]], [[0, 0, 1, 1], [1, 1, 1, 1]])
    by_mask, by_pad_lengths = HostText(state, mask), HostText(state)
    for text in (by_mask, by_pad_lengths):
        assert [text.row(b).tolist() for b in range(2)] == [[5, 6], [7, 8, 9, 10]]
        _step(state, [[11, 12], [13]])
        assert [new.tolist() for new in text.catch_up(state)] == [[11, 12], [13]]
        assert [text.row(b).tolist() for b in range(2)] == [[5, 6, 11, 12], [7, 8, 9, 10, 13]]
        state.host = HostView.start(2, 4)  # the next text starts from the prompt again


def test_right_padding_is_left_out_with_the_mask():
    state, mask = _state([[5, 6, PAD, PAD], [7, 8, 9, 10]], [[1, 1, 0, 0], [1, 1, 1, 1]])
    text = HostText(state, mask)
    assert [text.row(b).tolist() for b in range(2)] == [[5, 6], [7, 8, 9, 10]]
    _step(state, [[11], [12, 13]])
    _ = text.catch_up(state)
    _step(state, [[14, 15], [16]])
    assert [new.tolist() for new in text.catch_up(state)] == [[14, 15], [16]]
    assert [text.row(b).tolist() for b in range(2)] == [[5, 6, 11, 14, 15], [7, 8, 9, 10, 12, 13, 16]]
    assert HostText(state).row(0).tolist()[:4] == [5, 6, PAD, PAD]  # without the mask only left padding goes
