"""`DecodeState.report`: the step's one host read, and what proposers ship with it."""

from __future__ import annotations

import torch

from hf_specdec.step import DecodeState


def test_shipments_travel_with_the_report_in_order_and_are_cleared():
    state = DecodeState.start(torch.tensor([[1, 2, 3], [4, 5, 6]]), None, max_length=10, extra_capacity=4,
                              pad_token_id=0)
    first = state.ship(torch.tensor([[7, -1, 9], [10, 11, 12]]))
    second = state.ship(torch.tensor([[5], [6]], dtype=torch.int32))
    host = state.report(torch.tensor([2, 1]), torch.tensor([1, 0]), tokens=torch.tensor([[8, 9], [3, 0]]))
    assert (first, second) == (0, 1)
    assert host.num_emitted == [2, 1] and host.emitted.tolist() == [[8, 9], [3, 0]]
    assert [part.tolist() for part in host.shipped] == [[[7, -1, 9], [10, 11, 12]], [[5], [6]]]
    assert state.report(torch.tensor([1, 1]), torch.tensor([0, 0])).shipped == ()  # the next step ships nothing
    host = state.report(torch.tensor([1, 1]), torch.tensor([0, 0]), tokens=torch.tensor([[4], [2]]))
    assert host.emitted.tolist() == [[4], [2]] and host.shipped == ()
