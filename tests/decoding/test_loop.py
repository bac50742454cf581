"""A call ends for the adaptive schedule whatever its output: its rows' estimates start the next call's, for a
call that returns a tensor as for one that returns a dict with `spec_stats`."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.schedule import controller
from tests.conftest import make_draft, make_model, padded_batch


@pytest.mark.parametrize("return_dict", [False, True])
def test_every_call_ends_for_the_schedule(return_dict, monkeypatch):
    ended, tables = [], []
    finish = controller.Schedule.finish

    def counted(self):
        ended.append(self.steps)
        tables.extend(self.costs.values())
        return finish(self)

    monkeypatch.setattr(controller.Schedule, "finish", counted)
    target = make_model("llama")
    ids, mask = padded_batch([9, 6], seed=1, repeat_period=4)
    config = SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3)
    out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=12,
                              do_sample=False, eos_token_id=None, return_dict_in_generate=return_dict)
    assert isinstance(out, torch.Tensor) != return_dict
    assert len(ended) == 1 and ended[0] > 0
    assert tables[0].acceptance is not None, "the call's estimates were not kept for the next call"
    hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=12, do_sample=False,
                        eos_token_id=None, return_dict_in_generate=return_dict)
    assert len(ended) == 2
