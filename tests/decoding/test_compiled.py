"""Static shapes and compiled forwards stay lossless: greedy output is plain generate's and sampling follows the
target's law; each forward signature compiles once and later calls reuse it; bad setups fail before any work.

The compiled tests use inductor on a tiny model; the fast ones run in CI, the wide sweeps are marked slow."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CompileConfig, StaticCache
from transformers.modeling_outputs import CausalLMOutputWithPast

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.compile import CompiledForward, CompileSettings, compiled_forward
from hf_specdec.schedule.decision import width_ladder
from tests.conftest import ARCHITECTURES, VOCAB, make_draft, make_model, padded_batch
from tests.decoding import test_sampling_lossless as lossless
from tests.heads.medusa.test_model import heads_for
from tests.heads.test_token_map import shared_medusa
from tests.proposers.test_eagle import eagle_head
from tests.proposers.test_mlp_speculator import random_speculator

LENGTHS = [12, 7, 10]  # batch 3, left padded; longer than every sliding window in conftest
NEW_TOKENS = 16


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """transformers wraps every model's forward in one decorator, so all models share dynamo's recompile budget
    for that code object; each test starts from empty caches (a process serving a model or two stays far below)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _kwargs(mask: torch.Tensor, **extra) -> dict:
    return dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, **extra)


def _proposers(target: torch.nn.Module, schedule: str = "adaptive") -> dict[str, SpeculativeConfig]:
    return {
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, schedule=schedule),
        "same_draft": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=4,
                                        schedule=schedule),
        "random_draft_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3,
                                               tree_width=2, schedule=schedule),
        "same_draft_dynamic_tree": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target),
                                                     num_speculative_tokens=3, tree_width=2, tree_total_tokens=5,
                                                     schedule=schedule),
        "ngram_trie": SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=2, schedule=schedule),
        "ngram_sized_trie": SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=3,
                                              tree_total_tokens=4, schedule=schedule),
        "early_exit_dynamic_tree": SpeculativeConfig(method="early_exit", early_exit_layer=1, top_k=2, depth=3,
                                                     total_tokens=5, schedule=schedule),
        "mlp_speculator_tree": SpeculativeConfig(method="mlp_speculator", heads=random_speculator(target), top_k=2,
                                                 depth=3, total_tokens=5, schedule=schedule),
        "recycling": SpeculativeConfig(method="recycling", num_speculative_tokens=3, tree_total_tokens=6,
                                       schedule=schedule),
        # rows drafting n-gram chains and recycled trees in one step, at each step's fixed width
        "auto_recycling": SpeculativeConfig(method="auto", auto_methods=["ngram", "recycling"],
                                            num_speculative_tokens=3, schedule=schedule),
    }


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_static_shapes_match_plain_generate(arch):
    """cache_implementation="static" (no compile on a CPU, as in transformers): a fixed-capacity cache, fixed
    widths, rows that finish kept in place; the output is still plain generate's. Pinned to schedule="fixed":
    the test needs every proposer to draft, and the adaptive schedule stops asking rows whose lookup keeps
    finding nothing (tests/schedule/test_lossless.py covers it under static shapes)."""
    target = make_model(arch)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    expected = target.generate(ids, **_kwargs(mask))
    configs = _proposers(target, schedule="fixed")
    # fewer nodes than levels: under static shapes every level is drafted, and the kept path is shallower
    configs["same_draft_sparse_dynamic_tree"] = SpeculativeConfig(
        method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=5, tree_width=2, tree_total_tokens=3,
        schedule="fixed")
    for name, config in configs.items():
        out = hf_specdec.generate(target, ids, speculative=config, cache_implementation="static",
                                  return_dict_in_generate=True, **_kwargs(mask))
        assert torch.equal(out.sequences, expected), f"{arch}/{name}"
        assert out.spec_stats.num_draft_tokens > 0


def test_static_cache_rooms_come_in_buckets_and_take_max_cache_len(monkeypatch):
    """A static cache's room for committed tokens is the next power of two of what the call can hold (calls in one
    bucket share compiled graphs; a short call after a long one does not attend over the long one's room), and
    transformers' `max_cache_len` pre-sizes it; the output is plain generate's."""
    from hf_specdec.cache.ragged import RaggedKVCache
    from hf_specdec.compile import static_room

    assert [static_room(n) for n in (1, 64, 65, 200, 1000, 1025)] == [64, 64, 128, 256, 1024, 2048]
    rooms = []
    original = RaggedKVCache.make_static

    def recording(cache, committed, region, model_call=None):
        original(cache, committed, region, model_call)
        rooms.append((cache.static.committed, cache.kv.capacity - cache.static.committed))

    monkeypatch.setattr(RaggedKVCache, "make_static", recording)
    target = make_model("llama")
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    for extra in (dict(max_new_tokens=60), dict(max_new_tokens=4), dict(max_new_tokens=4, max_cache_len=90)):
        kwargs = _kwargs(mask) | extra
        out = hf_specdec.generate(target, ids, speculative=config, cache_implementation="static", **kwargs)
        assert torch.equal(out, target.generate(ids, **kwargs))
    # 12 + 60 tokens -> 128; 12 + 4 -> 64; max_cache_len 90 less the verify width (5) -> 128
    assert rooms == [(128, 5), (64, 5), (128, 5)]


def _compile_config(**options) -> CompileConfig:
    return CompileConfig(fullgraph=True, **options)


def test_compiled_greedy_matches_plain_generate_and_compiles_once_per_shape():
    """The verify forward is compiled once per shape; a second call (and a call with other prompts of the same
    batch and width, or a shorter length limit in the same cache bucket) compiles nothing; the output is plain
    generate's every time. First with schedule="fixed" (its shapes are known: k + 1 or 1), then adaptive: widths
    from its ladder only, each compiled once."""
    target = make_model("llama")
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, schedule="fixed")
    compiled = compiled_forward(target, _settings_of(target))
    for seed, new_tokens in ((3, NEW_TOKENS), (3, NEW_TOKENS), (8, NEW_TOKENS), (8, NEW_TOKENS - 5)):
        ids, mask = padded_batch(LENGTHS, seed=seed, repeat_period=5)
        kwargs = _kwargs(mask) | dict(max_new_tokens=new_tokens)
        expected = target.generate(ids, **kwargs)
        out = hf_specdec.generate(target, ids, speculative=config, compile_config=_compile_config(),
                                  return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), seed
        assert out.spec_stats.num_accepted_tokens > 0
        assert set(compiled.compiles.values()) == {1}, compiled.compiles  # each verify shape compiled once
        assert len(compiled.compiles) == 2, compiled.compiles  # and no new cache capacity
    # k + 1 tokens per row, or 1 when the lookup found nothing in any row
    assert {dict(signature)["input_ids"] for signature in compiled.compiles} == {(3, 5), (3, 1)}
    adaptive = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    for seed in (3, 8):
        ids, mask = padded_batch(LENGTHS, seed=seed, repeat_period=5)
        out = hf_specdec.generate(target, ids, speculative=adaptive, compile_config=_compile_config(),
                                  return_dict_in_generate=True, **_kwargs(mask))
        assert torch.equal(out.sequences, target.generate(ids, **_kwargs(mask))), seed
        assert set(compiled.compiles.values()) == {1}, compiled.compiles
    assert {dict(signature)["input_ids"] for signature in compiled.compiles} <= {(3, w + 1) for w in width_ladder(4)}


def _settings_of(model, compile_config: CompileConfig | None = None):
    """The settings the engine derives from a compile config (the key of the model's compiled forward)."""
    from transformers import GenerationConfig

    from hf_specdec.compile import CompileSettings

    config = GenerationConfig(compile_config=compile_config or _compile_config())
    return CompileSettings.from_generation(model, config)


def test_compiled_sampling_follows_the_target_law():
    """The chi-square law test of `test_sampling_lossless` through the compiled verify forward."""
    target = lossless.make_target()
    law = lossless.exact_law(target, lossless.TEMPERATURE)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, seed=3)
    samples = _compiled_draws(target, config)
    pvalues = lossless.chi_square_pvalues(samples, law)
    assert lossless.accepted(pvalues), pvalues


def _compiled_draws(target, config: SpeculativeConfig) -> torch.Tensor:
    prompts = lossless.PROMPT.expand(lossless.N, -1)
    out = hf_specdec.generate(target, prompts, attention_mask=torch.ones_like(prompts), speculative=config,
                              max_new_tokens=lossless.NEW_TOKENS, do_sample=True, temperature=lossless.TEMPERATURE,
                              top_k=lossless.TOP_K, top_p=1.0, compile_config=_compile_config(),
                              return_dict_in_generate=True)
    assert out.spec_stats.num_draft_tokens > 100 and out.spec_stats.num_accepted_tokens > 0
    return out.sequences[:, lossless.PROMPT.shape[1] :]


def _every_proposer(target: torch.nn.Module, arch: str) -> dict[str, SpeculativeConfig]:
    configs = _proposers(target)
    if arch in ("llama", "qwen2", "mistral", "phi3", "gemma2"):  # heads built for a Llama-like target
        configs["medusa_tree"] = SpeculativeConfig(method="medusa", heads=heads_for(target),
                                                   tree_paths=[(0,), (1,), (0, 0)])
        configs["eagle_dynamic_tree"] = SpeculativeConfig(method="eagle", heads=eagle_head(target), top_k=2, depth=3,
                                                          total_tokens=5)
        mapped = eagle_head(target, seed=1)  # drafting over half the vocabulary (a token map)
        mapped.set_token_map(torch.arange(0, VOCAB, 2))
        configs["eagle_token_map"] = SpeculativeConfig(method="eagle", heads=mapped, num_speculative_tokens=3)
        shared = shared_medusa(target)
        shared.set_token_map(torch.arange(0, VOCAB, 3))
        configs["medusa_token_map"] = SpeculativeConfig(method="medusa", heads=shared, tree_paths=[(0,), (1,), (0, 0)])
    configs["draft_token_map"] = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target),
                                                   draft_token_map=torch.arange(1, VOCAB, 2), num_speculative_tokens=3)
    return configs


# In CI two architectures share the proposers out: an absolute-position one runs the draft models (whose caches
# carry positions of their own: a chain of the target's copy, another model's tree), one with a sliding window the
# heads, early exit and tries. Every architecture with every proposer is marked slow.
CI_SHARES = {"gpt2": ("ngram", "random_draft_tree", "same_draft_dynamic_tree"),
             "mistral": ("ngram_trie", "ngram_sized_trie", "early_exit_dynamic_tree", "mlp_speculator_tree",
                         "medusa_tree", "eagle_dynamic_tree", "eagle_token_map", "medusa_token_map", "recycling",
                         "auto_recycling")}


@pytest.mark.parametrize("arch, share", [*(pytest.param(a, s, id=f"{a}-share") for a, s in CI_SHARES.items()),
                                         *(pytest.param(a, None, id=a, marks=pytest.mark.slow)
                                           for a in sorted(ARCHITECTURES))])
def test_captured_graphs_match_plain_generate_on_every_architecture(arch, share):
    """Every forward traced into one graph per shape (`fullgraph=True`) and run by `aot_eager` (captured and
    functionalised, eager kernels: the plumbing of compiled forwards without inductor's build time)."""
    target = make_model(arch)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    expected = target.generate(ids, **_kwargs(mask))
    configs = _every_proposer(target, arch)
    for name in share or configs:
        out = hf_specdec.generate(target, ids, speculative=configs[name],
                                  compile_config=_compile_config(backend="aot_eager"), **_kwargs(mask))
        assert torch.equal(out, expected), f"{arch}/{name}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_compiled_greedy_on_architectures_and_proposers(arch):
    """Inductor on every proposer (minutes on a CPU)."""
    target = make_model(arch)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    expected = target.generate(ids, **_kwargs(mask))
    for name, config in _every_proposer(target, arch).items():
        out = hf_specdec.generate(target, ids, speculative=config, compile_config=_compile_config(), **_kwargs(mask))
        assert torch.equal(out, expected), f"{arch}/{name}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["noisy_draft", "noisy_draft_dynamic_tree", "medusa_tree", "eagle", "eagle3"])
def test_compiled_sampling_follows_the_target_law_for_drafters(name):
    target = lossless.make_target()
    law = lossless.exact_law(target, lossless.TEMPERATURE)
    pvalues = lossless.chi_square_pvalues(_compiled_draws(target, lossless.PROPOSERS[name](target)), law)
    assert lossless.accepted(pvalues), f"{name}: p = {pvalues}"


def test_static_cache_too_short_fails_before_any_forward(forward_counter):
    target = make_model("llama")
    ids, mask = padded_batch([6, 4], seed=1)
    count = forward_counter(target)
    short = StaticCache(config=target.config, max_cache_len=6 + 8)  # room for the prompt and max_new_tokens only
    with pytest.raises(ValueError, match=rf"{CACHE_KWARG}: a StaticCache of max_cache_len=14; speculative decoding "
                                         r"needs the prompt \(6\) \+ max_new_tokens \(8\) \+ the draft budget \(6 "
                                         r"verified tokens per step\) = 20 slots; build it with max_cache_len >= 20"):
        hf_specdec.generate(target, ids, attention_mask=mask, past_key_values=short, max_new_tokens=8,
                            speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=5))
    assert count() == 0


def test_uncompilable_target_or_drafter_fails_before_any_forward(forward_counter):
    target = make_model("llama")
    ids, mask = padded_batch([6, 4], seed=1)
    count = forward_counter(target)
    draft = make_draft()
    draft._can_compile_fullgraph = False
    with pytest.raises(ValueError, match=r"compile_config: the draft model \(LlamaForCausalLM\) cannot be compiled"):
        hf_specdec.generate(target, ids, attention_mask=mask, max_new_tokens=4, compile_config=_compile_config(),
                            speculative=SpeculativeConfig(method="draft", draft_model=draft))
    target._can_compile_fullgraph = False
    with pytest.raises(ValueError, match=r"compile_config: the target \(LlamaForCausalLM\) cannot be compiled"):
        hf_specdec.generate(target, ids, attention_mask=mask, max_new_tokens=4, compile_config=_compile_config(),
                            spec_method="ngram")
    assert count() == 0


def test_static_cache_is_accepted_and_comes_back_filled():
    """An empty StaticCache passed in sets the capacity and comes back holding plain generate's keys and values."""
    target = make_model("gemma2")  # sliding-window layers: the StaticCache keeps their window
    ids, mask = padded_batch([9, 6], seed=2, repeat_period=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True)
    expected = target.generate(ids, past_key_values=StaticCache(config=target.config, max_cache_len=40), **kwargs)
    cache = StaticCache(config=target.config, max_cache_len=40)
    out = hf_specdec.generate(target, ids, past_key_values=cache, spec_method="ngram", **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.past_key_values is cache and cache.get_seq_length() == expected.past_key_values.get_seq_length()
    fed = torch.cat([mask, mask.new_ones(2, 5)], dim=1)  # every position fed but the last token
    for ours, theirs in zip(cache.layers, expected.past_key_values.layers):
        seen = fed[:, None, :, None].bool()
        if ours.keys.shape[2] < fed.shape[1]:  # a sliding layer: its window of the last positions
            continue
        length = fed.shape[1]
        torch.testing.assert_close(ours.keys[:, :, :length] * seen, theirs.keys[:, :, :length] * seen)
    with pytest.raises(ValueError, match=f"{CACHE_KWARG}: a filled StaticCache"):
        hf_specdec.generate(target, out.sequences, past_key_values=cache, spec_method="ngram", max_new_tokens=2)


# every proposer `_every_proposer` builds for a Llama target, one GPU test each (a failure names its proposer)
CUDA_GRAPH_PROPOSERS = ("ngram", "same_draft", "random_draft_tree", "same_draft_dynamic_tree", "ngram_trie",
                        "ngram_sized_trie", "early_exit_dynamic_tree", "mlp_speculator_tree", "medusa_tree",
                        "eagle_dynamic_tree", "eagle_token_map", "medusa_token_map", "draft_token_map", "recycling",
                        "auto_recycling")


def test_the_cuda_graph_tests_cover_every_proposer():
    assert sorted(CUDA_GRAPH_PROPOSERS) == sorted(_every_proposer(make_model("llama"), "llama"))


@pytest.fixture(scope="module")
def cuda_target():
    """A Llama target on CUDA, its padded prompts and plain greedy output, shared by the CUDA-graph tests so that its
    compiled forward (one per shape) is too (only the GPU-marked tests, skipped without CUDA, ask for it)."""
    target = make_model("llama").to("cuda")
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    ids, mask = ids.cuda(), mask.cuda()
    return target, ids, mask, target.generate(ids, **_kwargs(mask))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", CUDA_GRAPH_PROPOSERS)
def test_cuda_graphs_match_plain_generate(cuda_target, name):
    """transformers' default CompileConfig (mode="reduce-overhead": CUDA graphs) on CUDA, float32 so greedy output
    can be compared token for token; a second call replays the captured graphs without compiling."""
    target, ids, mask, expected = cuda_target
    config = _every_proposer(target, "llama")[name]
    for drafter in (config.heads, config.draft_model):
        if drafter is not None:
            drafter.to("cuda")
    compiled = compiled_forward(target, _settings_of(target, CompileConfig()))
    for call in range(2):
        out = hf_specdec.generate(target, ids, speculative=config, compile_config=CompileConfig(), **_kwargs(mask))
        parted = (out != expected).nonzero().tolist()
        assert not parted, f"{name}, call {call + 1}: [row, position] where it parts from plain: {parted[:4]}"
    assert set(compiled.compiles.values()) == {1}, compiled.compiles


def test_outputs_of_cuda_graphs_are_copied_before_the_next_replay(monkeypatch):
    """A CUDA graph's replay writes its outputs into the same memory every time: emulated here (a forward whose
    outputs are one buffer overwritten per call), a compiled forward under mode="reduce-overhead" hands out copies,
    so a step's logits survive the next forward of the same shape; without CUDA graphs nothing is copied."""
    buffer = torch.zeros(2, 3)

    def replayed_graph(**inputs):
        buffer.copy_(inputs["input_ids"].float())
        return CausalLMOutputWithPast(logits=buffer, hidden_states=(buffer, buffer))

    monkeypatch.setattr(torch, "compile", lambda function, **options: replayed_graph)
    module = torch.nn.Linear(1, 1)
    graphs = CompiledForward(module, CompileSettings(mode="reduce-overhead"))
    first = graphs(input_ids=torch.ones(2, 3))
    second = graphs(input_ids=torch.full((2, 3), 2.0))
    assert torch.equal(first.logits, torch.ones(2, 3)) and torch.equal(first.hidden_states[1], torch.ones(2, 3))
    assert torch.equal(second.logits, torch.full((2, 3), 2.0)) and type(first) is CausalLMOutputWithPast
    # a caller that keeps part of the output gets that part, copied
    logits, last = graphs(keep=lambda out: (out.logits, out.hidden_states[-1][:, -1:]), input_ids=torch.ones(2, 3))
    graphs(input_ids=torch.full((2, 3), 3.0))
    assert torch.equal(logits, torch.ones(2, 3)) and torch.equal(last, torch.ones(2, 1))
    plain = CompiledForward(module, CompileSettings(mode=None))
    first = plain(input_ids=torch.ones(2, 3))
    plain(input_ids=torch.full((2, 3), 2.0))
    assert first.logits is buffer  # the emulation overwrites what is not copied
