"""Features recorded by hooks equal the model's own `hidden_states` entries, on every test architecture."""

from __future__ import annotations

import threading

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


def test_a_tap_records_its_own_threads_forwards_only():
    """`generate` calls in threads share the model and its modules' hooks: a forward another thread runs while a tap
    is entered is not recorded by it (before, the last forward of any thread was, and a concurrent EAGLE call read
    another call's features, of another batch size)."""
    model = make_model("llama")
    ids, mask = padded_batch([7, 4], seed=1)
    other, other_mask = padded_batch([5, 6, 3], seed=2)
    tap = FeatureTap(model, (-1,))
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        with tap:
            model(ids, attention_mask=mask)
            thread = threading.Thread(target=lambda: model(other, attention_mask=other_mask))
            thread.start()
            thread.join()
    (recorded,) = tap.features()
    torch.testing.assert_close(recorded, expected, rtol=0, atol=0)


def test_concurrent_generate_calls_with_eagle_heads_match_plain_generate():
    """Threads generating on one model with one EAGLE head, each its own prompts: every output is plain generate's
    (before, calls crashed reading features another thread's forward had recorded)."""
    import hf_specdec
    from hf_specdec import SpeculativeConfig
    from tests.proposers.test_eagle import eagle_head

    model = make_model("llama")
    config = SpeculativeConfig(method="eagle", heads=eagle_head(model, "eagle"), num_speculative_tokens=3)
    batches = [padded_batch([5 + i, 4, 9][: 1 + i % 3], seed=10 + i, repeat_period=3) for i in range(12)]
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = [model.generate(ids, attention_mask=mask, **kwargs) for ids, mask in batches]
    results, errors = {}, []
    start = threading.Barrier(4)

    def work(thread: int) -> None:
        start.wait()
        for i in range(thread, len(batches), 4):
            try:
                ids, mask = batches[i]
                results[i] = hf_specdec.generate(model, ids, attention_mask=mask, speculative=config, **kwargs)
            except Exception as error:  # noqa: BLE001 - reported below with the call
                errors.append((i, repr(error)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i, out in results.items():
        assert torch.equal(out, expected[i]), i
    assert len(results) == len(batches)
