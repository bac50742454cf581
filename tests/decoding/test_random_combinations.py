"""Random combinations of architecture, padding, proposer, draft shape, schedule and generate options, each checked
against plain `generate`: the same sequences, and the same scores, logits and hidden states where asked for (for the
rows still generating: a row's entries after it ended are zeros here, computed on padding there); about a quarter of
the cases run eager attention and compare the attention weights too, laid out over plain's cache. A case makes two
calls with one config (the suffix cache, the schedule's estimates and the drafters' state carry over); about half
the calls that return a cache are then continued from it (a few new tokens, greedy), so what proposers carry with
the cache is exercised too. The options include the prompt's embeddings given with its ids (noisy, so drafters that
read the ids see other text than the target), a streamer (what it receives is compared too), stop strings (the
text of a row's own tokens, through the test bed's byte-level tokenizer) and a `prefix_allowed_tokens_fn` (a
half to a quarter of the vocabulary banned, by the prompt's index and the last token). Every case is seeded;
`HF_SPECDEC_RANDOM_CASES=N` runs N of them (default 32), `HF_SPECDEC_RANDOM_START=S` from case S on,
`HF_SPECDEC_RANDOM_LONGEST=T` asks for up to T new tokens per call (default 30). Greedy cases
compare with plain greedy decoding; sampling cases use `top_k=1`, which makes sampling deterministic, so they compare
exactly too (with temperature, top-p, min-p, typical and epsilon warpers in the processor list, and sometimes
`num_return_sequences`). Right padding is left out of sampling cases on sliding-window models: there a short row's
last prompt position sees no key in its window, and plain generate samples from NaN scores.

Found with it: token lists as long as the batch applied one token per row (`test_greedy_equality.py`), EAGLE heads
for GPT-2-style configs (`test_eagle.py`), a dynamic tree with fewer nodes than levels under static shapes
(`test_compiled.py`)."""

from __future__ import annotations

import copy
import functools
import os
import random
from dataclasses import dataclass

import pytest
import torch
import transformers
from transformers import AutoTokenizer, DynamicCache, StopStringCriteria
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.config import RECYCLED_CANDIDATES
from hf_specdec.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, MlpSpeculator, MlpSpeculatorConfig
from hf_specdec.suffix import SuffixCache
from hf_specdec.testbed.loading import testbed_dir
from tests.conftest import ARCHITECTURES, DECODER, SPECIAL, VOCAB, make_draft, make_model, noisy_copy, padded_batch
from tests.decoding.test_greedy_equality import NEWER_ARCHITECTURES, allowed_by_prompt

CASES = int(os.environ.get("HF_SPECDEC_RANDOM_CASES", "32"))
START = int(os.environ.get("HF_SPECDEC_RANDOM_START", "0"))
LONGEST = int(os.environ.get("HF_SPECDEC_RANDOM_LONGEST", "30"))  # the most new tokens a call asks for
SLIDING = {"phi3", "mistral", "gemma2", "gemma3_text", "gpt_oss"}
ATTENDING = 10**6  # seeds the draw of the cases that ask for attention weights, apart from the others
CONSTRAINING = 2 * 10**6  # seeds the draw of the calls with a `prefix_allowed_tokens_fn`, apart from the others
CALLS = 2  # right-padded, a short row's last prompt position sees no key in its window


@dataclass
class Call:
    ids: torch.Tensor  # [B, P]
    kwargs: dict  # generate's
    name: str


@dataclass
class Case:
    """Calls on one target with one speculative config (its suffix cache, estimates and drafters carry over)."""

    arch: str
    calls: list[Call]
    config: SpeculativeConfig


def _config(rng: random.Random, target: torch.nn.Module) -> tuple[str, SpeculativeConfig]:
    text = target.config.get_text_config()
    k = rng.randint(1, 5)
    shape = rng.choice(["chain", "chain", "branches", "dynamic"])
    if shape == "dynamic":
        k = max(k, 3)  # room for the tree's nodes
    tree = {"chain": {}, "branches": {"tree_width": rng.randint(2, 3)},
            "dynamic": {"tree_width": 2, "tree_total_tokens": rng.choice([3, 5, "auto"])}}[shape]
    kind = rng.choice(["draft", "ngram", "suffix", "hybrid", "early_exit", "eagle", "eagle3", "medusa",
                       "mlp_speculator", "recycling", "auto"])
    torch.manual_seed(rng.randint(0, 99))
    if kind == "draft":
        draft = rng.choice([lambda: copy.deepcopy(target), lambda: noisy_copy(target, seed=1), make_draft])()
        values = dict(method="draft", draft_model=draft, num_speculative_tokens=k, **tree)
    elif kind == "ngram":
        values = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3, **tree)
    elif kind == "suffix":
        values = dict(method="suffix", suffix_cache=SuffixCache())
    elif kind == "hybrid":
        fallback = SpeculativeConfig(method="draft", draft_model=noisy_copy(target, seed=2), num_speculative_tokens=k)
        values = dict(method="suffix", suffix_cache=SuffixCache(), fallback=fallback, fallback_min_score=1.5)
    elif kind == "early_exit":
        values = dict(method="early_exit", early_exit_layer=1, num_speculative_tokens=k, **tree)
    elif kind in ("eagle", "eagle3"):
        values = dict(method="eagle", heads=EagleHead(EagleConfig.for_target(target, kind)).eval(),
                      num_speculative_tokens=k, **tree)
    elif kind == "medusa":
        heads = MedusaHeads(MedusaConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size, num_heads=3))
        values = dict(method="medusa", heads=heads.eval(), num_speculative_tokens=min(k, 3),
                      **({"tree_width": 2} if shape != "chain" else {}))
    elif kind == "recycling":  # a chain of best candidates, or its default tree of some size
        tree = ({"tree_paths": [(0,) * depth for depth in range(1, k + 1)]} if shape == "chain" else
                {"tree_total_tokens": min(rng.choice([2, 6, 12]), RECYCLED_CANDIDATES ** k)})
        values = dict(method="recycling", num_speculative_tokens=k, **tree)
    elif kind == "mlp_speculator":
        speculator = MlpSpeculator(MlpSpeculatorConfig(emb_dim=text.hidden_size, vocab_size=text.vocab_size))
        values = dict(method="mlp_speculator", heads=speculator.eval(), num_speculative_tokens=min(k, 3))
    else:
        drafters = rng.choice([
            {"draft_model": noisy_copy(target, seed=3)},
            {"heads": EagleHead(EagleConfig.for_target(target, rng.choice(["eagle", "eagle3"]))).eval()},
            {"heads": MedusaHeads(MedusaConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size)).eval()},
            {"heads": MlpSpeculator(MlpSpeculatorConfig(emb_dim=text.hidden_size, vocab_size=text.vocab_size)).eval(),
             "draft_model": make_draft()},
        ])
        values = dict(method="auto", num_speculative_tokens=k, **drafters)
        if rng.random() < 0.5:  # token recycling as one more candidate
            values["auto_methods"] = (*SpeculativeConfig(**values).auto_candidates, "recycling")
    values["schedule"] = rng.choice(["fixed", "adaptive"])
    return f"{kind}/{shape}/{values['schedule']}", SpeculativeConfig(**values)


def _model(arch: str) -> torch.nn.Module:
    if arch in ARCHITECTURES:
        return make_model(arch)
    config_name, model_name, extra = NEWER_ARCHITECTURES[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=VOCAB, **{**DECODER, **extra}, **SPECIAL)
    return getattr(transformers, model_name)(config).eval()


def _case(seed: int) -> Case:
    rng = random.Random(seed)
    arch = rng.choice(sorted(ARCHITECTURES) + sorted(NEWER_ARCHITECTURES))
    target = _model(arch)
    calls = [_call(rng, seed * CALLS + i, arch, target) for i in range(CALLS)]
    name, config = _config(rng, target)
    for call in calls:
        call.name = f"{arch}, {name}, {call.name}"
    return Case(arch, calls, config)


def _call(rng: random.Random, seed: int, arch: str, target: torch.nn.Module) -> Call:
    sample = rng.random() < 0.3
    side = "left" if sample and arch in SLIDING else rng.choice(["left", "left", "right"])
    lengths = [rng.randint(1, 12) for _ in range(rng.choice([1, 2, 3, 4]))]
    ids, mask = padded_batch(lengths, seed=seed, repeat_period=rng.choice([None, 3, 5]), side=side)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[:, ids.shape[1] :]

    def token() -> int:  # one the rows' own continuations contain: options that name it change the output
        return int(free[rng.randrange(free.shape[0]), rng.randrange(free.shape[1])])

    def stop_string() -> str:  # the text of one or two tokens of a row's own continuation
        row, start = free[rng.randrange(free.shape[0])], rng.randrange(free.shape[1])
        text = _tokenizer().decode(row[start : start + rng.randint(1, 2)])
        return text if text.strip() and text.isprintable() else "X"

    kwargs = dict(attention_mask=mask, pad_token_id=0, return_dict_in_generate=True,
                  eos_token_id=rng.choice([None, token(), [token(), token()]]))
    if rng.random() < 0.8:
        kwargs["max_new_tokens"] = rng.randint(1, LONGEST)
    else:
        kwargs["max_length"] = ids.shape[1] + rng.randint(1, LONGEST)
    options = {
        "repetition_penalty": lambda: rng.choice([0.8, 1.3]),
        "no_repeat_ngram_size": lambda: rng.randint(1, 3),
        "min_new_tokens": lambda: rng.randint(1, 10),
        "min_length": lambda: ids.shape[1] + rng.randint(1, 8),
        "bad_words_ids": lambda: [[token()], [token(), token()]],
        "suppress_tokens": lambda: [token() for _ in range(rng.randint(1, 4))],
        "begin_suppress_tokens": lambda: [token()],
        "sequence_bias": lambda: {(token(),): -3.0, (token(), token()): 2.0},
        "exponential_decay_length_penalty": lambda: (rng.randint(1, 5), 1.5),
        "stop_strings": lambda: [stop_string()],
        "renormalize_logits": lambda: True,
        "output_scores": lambda: True,
        "output_logits": lambda: True,
        "output_hidden_states": lambda: True,
        "use_cache": lambda: False,
        "cache_implementation": lambda: "static",
        # the prompt's embeddings, not those of its ids (which drafters that read ids read)
        "streamer": lambda: True,  # a recorder each for plain and hf_specdec (`_streamed`)
        "inputs_embeds": lambda: (target.get_input_embeddings()(ids)
                                  + 0.5 * torch.randn(*ids.shape, target.config.get_text_config().hidden_size,
                                                      generator=torch.Generator().manual_seed(seed))).detach(),
    }
    for name in rng.sample(sorted(options), rng.randint(0, 4)):
        kwargs[name] = options[name]()
    constraining = random.Random(-CONSTRAINING - seed)
    if constraining.random() < 0.15:
        kwargs["prefix_allowed_tokens_fn"] = allowed_by_prompt(constraining.randint(2, 4))
    if "stop_strings" in kwargs:
        kwargs["tokenizer"] = _tokenizer()
    if kwargs["eos_token_id"] is None:
        kwargs.pop("exponential_decay_length_penalty", None)  # a penalty on the EOS: plain generate needs one
    if kwargs.get("use_cache") is False:
        kwargs.pop("output_hidden_states", None)  # plain recomputes the pads' states too: compared elsewhere
    if sample:
        if kwargs.get("no_repeat_ngram_size") == 1 and kwargs.get("prefix_allowed_tokens_fn") and LONGEST > 60:
            # the constraint's fallback once every token it allows is banned: scores of 0 alike, which top-k 1
            # keeps all of, so sampling is no longer deterministic
            kwargs["no_repeat_ngram_size"] = 2
        kwargs.update(do_sample=True, top_k=1, temperature=rng.choice([0.3, 1.0, 1.7]))
        for name, value in {"top_p": 0.9, "min_p": 0.05, "typical_p": 0.9, "epsilon_cutoff": 3e-4}.items():
            if rng.random() < 0.3:
                kwargs[name] = value
        if rng.random() < 0.2:
            kwargs["num_return_sequences"] = rng.randint(2, 3)
    else:
        kwargs["do_sample"] = False
    return Call(ids, kwargs, f"batch {len(lengths)} {side}, {sorted(kwargs)}")


@functools.cache
def _tokenizer():
    """The committed test bed's tokenizer: byte-level, so the random models' ids decode to text (stop strings)."""
    return AutoTokenizer.from_pretrained(testbed_dir() / "tokenizer")


def _ended_before(
    # [B, P + T] the output sequences
    sequences: torch.Tensor,
    prompt_length: int,
    kwargs: dict,
) -> torch.Tensor:
    """[B, T] bool: whether the row had ended before step t: it emitted an EOS, or, where an EOS criterion pads
    finished rows, its text ended with a stop string."""
    eos = kwargs["eos_token_id"]
    generated = sequences[:, prompt_length:]
    eos = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else eos, dtype=torch.long)
    hit = torch.isin(generated, eos).long()
    if kwargs.get("stop_strings") and kwargs["eos_token_id"] is not None:
        criterion = StopStringCriteria(kwargs["tokenizer"], kwargs["stop_strings"])
        hit |= torch.stack([criterion(sequences[:, : prompt_length + t + 1], None).long()
                            for t in range(generated.shape[1])], dim=1)
    hit = hit.cumsum(dim=1)
    return torch.cat([torch.zeros_like(hit[:, :1]), hit[:, :-1]], dim=1) > 0


@pytest.mark.parametrize("seed", range(START, START + CASES))
def test_random_combination_matches_plain_generate(seed):
    case = _case(seed)
    target, plain = _model(case.arch), _model(case.arch)
    continues = random.Random(-1 - seed)  # whether and how a call's output is continued from its cache
    # about a quarter of the cases run eager attention and ask for the attention weights as well
    attends = random.Random(-ATTENDING - seed).random() < 0.25
    if attends:
        for model in (target, plain):
            model.set_attn_implementation("eager")
    for call in case.calls:
        if attends:
            call = Call(call.ids, {**call.kwargs, "output_attentions": True}, f"{call.name}, output_attentions")
        streamed = {}
        try:
            expected = plain.generate(call.ids, **_streamed(call.kwargs, streamed, "plain"))
        except ValueError:  # an option plain generate refuses in this combination
            continue
        except RuntimeError as error:  # sampling with every token banned (a long call, no_repeat_ngram_size=1)
            assert "probability tensor contains" in str(error), (call.name, error)
            with pytest.raises(RuntimeError, match="no token with a finite score"):
                hf_specdec.generate(target, call.ids, speculative=case.config,
                                    **_streamed(call.kwargs, streamed, "ours"))
            continue
        try:
            out = hf_specdec.generate(target, call.ids, speculative=case.config,
                                      **_streamed(call.kwargs, streamed, "ours"))
        except ValueError as error:  # refusals name the option and what to do: combinations that cannot run
            assert "static" in str(error) and call.kwargs.get("cache_implementation") == "static", (call.name, error)
            continue
        _check(call, out, expected)
        if streamed:  # the prompt, then one column of the batch at a time, then the end
            assert streamed["ours"].chunks == streamed["plain"].chunks, f"{call.name}: streamed"
        if isinstance(getattr(out, CACHE_KWARG), DynamicCache) and continues.random() < 0.5:
            _check_continuation(continues, target, plain, case.config, call, out)


class Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list = []

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.tolist())

    def end(self) -> None:
        self.chunks.append("end")


def _streamed(kwargs: dict, recorders: dict, name: str) -> dict:
    """generate's kwargs with a recorder of its own as the streamer, when the call streams."""
    if not kwargs.get("streamer"):
        return kwargs
    recorders[name] = Recorder()
    return {**kwargs, "streamer": recorders[name]}


def _check_continuation(rng: random.Random, target, plain, config: SpeculativeConfig, call: Call, out) -> None:
    """A next turn from the cache the call returned (with what its proposer carried): a few new tokens after its
    output, then greedy decoding from that cache, by plain generate and by hf_specdec."""
    batch = out.sequences.shape[0]
    generator = torch.Generator().manual_seed(rng.randint(0, 999))
    new = torch.randint(3, VOCAB, (batch, rng.randint(1, 4)), generator=generator)  # no special token
    prompt = torch.cat([out.sequences, new], dim=1)
    mask = _prompt_mask(call)
    mask = torch.cat([mask, mask.new_ones(batch, prompt.shape[1] - mask.shape[1])], dim=1)
    kwargs = dict(attention_mask=mask, pad_token_id=0, return_dict_in_generate=True, eos_token_id=None,
                  do_sample=False, max_new_tokens=rng.randint(1, 12),
                  output_attentions=bool(call.kwargs.get("output_attentions")))
    cache = getattr(out, CACHE_KWARG)
    expected = plain.generate(prompt, **{CACHE_KWARG: copy.deepcopy(cache)}, **kwargs)
    ours = hf_specdec.generate(target, prompt, speculative=config, **{CACHE_KWARG: copy.deepcopy(cache)}, **kwargs)
    continued = Call(prompt, kwargs, f"{call.name}, continued")
    # the first forward's queries: the positions the cache does not hold (the output's last token and the new ones)
    uncached = torch.ones(batch, prompt.shape[1] - cache.get_seq_length(), dtype=torch.bool)
    _check(continued, ours, expected, first_queries=uncached)


def _prompt_mask(call: Call) -> torch.Tensor:
    """[B * n, P]: the prompt's mask for every output row (`num_return_sequences` = n repeats each row n times)."""
    return call.kwargs["attention_mask"].repeat_interleave(call.kwargs.get("num_return_sequences", 1), dim=0)


def _check(
    call: Call,
    out,
    expected,
    # [B, Q]: which of the first forward's queries to compare (default: the prompt's real positions; a left pad's
    # query attends to nothing, uniformly over whatever keys the cache holds)
    first_queries: torch.Tensor | None = None,
) -> None:
    assert torch.equal(out.sequences, expected.sequences), call.name
    ended = _ended_before(expected.sequences, call.ids.shape[1], call.kwargs)
    for field in ("scores", "logits"):
        if call.kwargs.get(f"output_{field}"):
            ours, theirs = getattr(out, field), getattr(expected, field)
            assert len(ours) == len(theirs), call.name
            for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                live = ~ended[:, step]
                torch.testing.assert_close(a[live], b[live], rtol=1e-4, atol=1e-4, msg=f"{call.name}: {field}")
    if call.kwargs.get("output_hidden_states"):
        real = _prompt_mask(call).bool()[:, :, None]  # [B, P, 1]
        assert len(out.hidden_states) == len(expected.hidden_states), call.name
        for step, (ours, theirs) in enumerate(zip(out.hidden_states, expected.hidden_states, strict=True)):
            live = ~ended[:, step]
            # per layer: [B, P, H] at the prefill (compared at real positions), then [B, 1, H]
            for a, b in zip(ours, theirs, strict=True):
                seen = real if step == 0 else torch.ones_like(a[..., :1], dtype=torch.bool)
                torch.testing.assert_close((a * seen)[live], (b * seen)[live], rtol=1e-4, atol=1e-4, msg=call.name)
    if call.kwargs.get("output_attentions") and call.kwargs.get("use_cache") is not False:
        queries = _prompt_mask(call).bool() if first_queries is None else first_queries
        assert len(out.attentions) == len(expected.attentions), call.name
        for step, (ours, theirs) in enumerate(zip(out.attentions, expected.attentions, strict=True)):
            live = ~ended[:, step]
            # per layer: [B, heads, Q, keys], as plain lays them out over its cache
            for a, b in zip(ours, theirs, strict=True):
                assert a.shape == b.shape, f"{call.name}: attentions at step {step}"
                seen = queries[:, None, :, None] if step == 0 else torch.ones_like(a, dtype=torch.bool)
                torch.testing.assert_close((a * seen)[live], (b * seen)[live], rtol=1e-4, atol=1e-5,
                                           msg=f"{call.name}: attentions")


def test_a_long_call_keeps_a_tree_path_within_the_reserved_room():
    """Case 108's first call run to 133 new tokens (n-gram's dynamic tree of 3 nodes under a depth of 5, batch 4,
    Mistral): a path is as long as the depth, and its padding entries past the tree's slots were written past the
    cache's room once that room was tight (an IndexError at the 60-odd-th slot); long calls are beyond the cases'
    30 tokens."""
    if LONGEST != 30:
        pytest.skip("case 108 as drawn with the default HF_SPECDEC_RANDOM_LONGEST")
    case = _case(108)
    assert (case.arch, case.config.method, case.config.tree_total_tokens, case.config.num_speculative_tokens) == (
        "mistral", "ngram", 3, 5)
    call = case.calls[0]
    kwargs = {name: value for name, value in call.kwargs.items() if name not in ("streamer", "max_length")}
    kwargs["max_new_tokens"] = 133
    expected = _model(case.arch).generate(call.ids, **kwargs)
    out = hf_specdec.generate(_model(case.arch), call.ids, speculative=case.config, **kwargs)
    assert out.spec_stats.num_draft_tokens > 0
    _check(Call(call.ids, kwargs, call.name), out, expected)
