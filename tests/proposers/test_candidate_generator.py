"""Our proposers inside transformers' own assisted loop give plain generate's greedy output."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_specdec import SpeculativeConfig
from hf_specdec.proposers.candidate_generator import ProposerCandidateGenerator
from tests.conftest import make_draft, make_model, padded_batch


@pytest.mark.parametrize("method", ["draft_same", "draft_random", "ngram"])
def test_candidate_generator_in_transformers_assisted_loop(method, forward_counter):
    target = make_model("llama")
    ids, _ = padded_batch([14], seed=9, repeat_period=4)
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    config = {
        "draft_same": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=4),
        "draft_random": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=4),
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4),
    }[method]
    built = []

    def candidate_generator(generation_config, logits_processor=None, **_):
        built.append(ProposerCandidateGenerator.from_config(config, target, generation_config, logits_processor))
        return built[-1]

    target._get_candidate_generator = candidate_generator  # transformers' only (private) hook for this
    count = forward_counter(target)
    out = target.generate(ids, prompt_lookup_num_tokens=4, **kwargs)
    assert built, "transformers did not use our candidate generator"
    assert torch.equal(out, expected)
    if method == "draft_same":
        # transformers verifies the prompt and the first drafts in one forward: k + 1 tokens in every forward
        assert count() == -(-20 // 5), "a copy of the target must always be accepted"


def test_draft_heads_are_refused_up_front():
    """Medusa and EAGLE read the target's hidden states, which transformers' loop never hands to a candidate
    generator: a clear error when the generator is built, not a crash mid-generation."""
    from transformers import GenerationConfig

    from hf_specdec.heads import EagleConfig, EagleHead
    from tests.heads.medusa.test_model import heads_for

    target = make_model("llama")
    for config in (SpeculativeConfig(method="medusa", heads=heads_for(target)),
                   SpeculativeConfig(method="eagle", heads=EagleHead(EagleConfig.for_target(target)))):
        with pytest.raises(ValueError, match="transformers' assisted loop does not pass to a candidate generator"):
            ProposerCandidateGenerator.from_config(config, target, GenerationConfig(max_length=30))
