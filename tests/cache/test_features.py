"""Features recorded by hooks equal the model's own `hidden_states` entries, on every test architecture."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.cache.features import FeatureTap
from tests.conftest import ARCHITECTURES, make_model, padded_batch

# decoders named otherwise (`h` / `ln_f`, `final_layer_norm`)
UNTAPPED = ("gpt2", "gpt_neox", "opt")


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_tapped_entries_equal_output_hidden_states(arch):
    model = make_model(arch)
    count = model.config.num_hidden_layers
    entries = (0, 1, count - 1, -1, count, -2)
    ids, mask = padded_batch([7, 4], seed=1)
    tap = FeatureTap(model, entries)
    if arch in UNTAPPED:  # no `layers` + `norm` decoder: the cache asks for output_hidden_states instead
        assert not tap.supported
        return
    assert tap.supported
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        with tap:
            model(ids, attention_mask=mask)
    for entry, recorded in zip(entries, tap.features()):
        torch.testing.assert_close(recorded, expected[entry], rtol=0, atol=0, msg=f"entry {entry}")
    assert not model.get_decoder().layers[0]._forward_pre_hooks  # the hooks are gone after `with`


def test_unsupported_models_and_entries():
    model = make_model("llama")
    assert not FeatureTap(model, (model.config.num_hidden_layers + 1,)).supported
    assert not FeatureTap(torch.nn.Linear(2, 2), (-1,)).supported


def test_generate_reads_features_without_asking_for_every_layer():
    """With an EAGLE-3 head on a tapped architecture the target is never asked for `output_hidden_states`; the
    output is plain generate's."""
    import hf_specdec
    from hf_specdec import SpeculativeConfig
    from tests.proposers.test_eagle import eagle_head

    model = make_model("llama")
    ids, mask = padded_batch([9, 5], seed=2, repeat_period=3)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    asked = []
    model.register_forward_pre_hook(lambda module, args, kwargs: asked.append(kwargs.get("output_hidden_states")),
                                    with_kwargs=True)
    config = SpeculativeConfig(method="eagle", heads=eagle_head(model, "eagle3"), num_speculative_tokens=3,
                               schedule="fixed")
    out = hf_specdec.generate(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                              speculative=config)
    assert torch.equal(out, expected)
    assert asked and not any(asked)
