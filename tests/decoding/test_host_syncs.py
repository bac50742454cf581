"""Host syncs per verify step: at most 2 for every method, greedy and sampling (measured: 1; 2 for the dynamic
trees of the draft model and of early exit, whose frontier the host cannot know).

What counts as a host sync (each is a point where the host waits for the device): at the aten level,
`_local_scalar_dense` (`.item()`, `int(t)`, `float(t)`, `bool(t)`, `if t:`), `nonzero`, `masked_select`, `unique`
(`_unique2`, `unique_dim`, `unique_consecutive`), `repeat_interleave` (its output size is read back), `equal` and
`is_nonzero` (Python bools from tensors), `multinomial` (it checks its input on the host: two syncs per call on
CUDA) and indexing with a boolean mask (`index`, `index_put_`: a `nonzero` inside); at the Python level,
`Tensor.tolist`, `Tensor.numpy` and `Tensor.cpu` (copies to the host; on this CPU machine they are the reads a GPU
would wait on). The count covers one `SpeculativeDecoder.step` (propose, the verify forward, accept, emit,
commit, and the drafter's forwards) and the loop's own test of whether to go on; the model forwards are counted
too. Logits processors that depend on earlier tokens (repetition penalty, ...) and stopping criteria other than
EOS and the length limit are called per distinct prefix length, which is per-row host work by design: their syncs
are counted separately.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.decoding import loop
from hf_specdec.decoding.scores import PositionScorer
from hf_specdec.decoding.stopping import TokenStopper
from hf_specdec.suffix import SuffixCache
from hf_specdec.testbed import load_testbed
from hf_specdec.testbed.other_tokenizer import permuted
from hf_specdec.tree import dynamic
from tests.conftest import make_draft, make_model, padded_batch
from tests.heads.medusa.test_model import heads_for
from tests.proposers.test_eagle import eagle_head
from tests.proposers.test_mlp_speculator import random_speculator
from tests.proposers.test_mtp import mtp_layers, mtp_target

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
            "repeat_interleave", "equal", "is_nonzero", "multinomial"}
HOST_COPIES = {"tolist", "numpy", "cpu"}
MAX_SYNCS_PER_STEP = 2


class SyncCounter:
    """Counts host syncs per decode step, and apart from them those inside the user's processors and criteria."""

    def __init__(self) -> None:
        self.steps: list[collections.Counter] = []
        self.user_code: collections.Counter = collections.Counter()
        self.counting = False
        self.in_user_code = 0

    def hit(self, name: str) -> None:
        if not self.counting:
            return
        (self.user_code if self.in_user_code else self.steps[-1])[name] += 1


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in SYNC_OPS:
            self.counter.hit(name)
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            self.counter.hit(f"{name}[bool]")
        return func(*args, **(kwargs or {}))


class _Function(TorchFunctionMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_COPIES:
            self.counter.hit(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """Runs a call under the counters: each decode step (and the loop test after it) counts apart; the user's
    prefix-dependent processors and criteria count in `user_code`."""
    counter = SyncCounter()
    step = loop.SpeculativeDecoder.step
    # the GPU's path: an EAGLE-2 expansion reads whether it has settled only where reads cost nothing (a CPU)
    monkeypatch.setattr(dynamic, "SETTLING_DEVICES", frozenset())

    def counted_step(decoder):
        counter.steps.append(collections.Counter())
        counter.counting = True
        try:
            step(decoder)
            all(decoder.state.host.finished)  # the loop's test, as `run` makes it
        finally:
            counter.counting = False

    def user_code(method):
        def wrapper(self, *args, **kwargs):
            prefix_dependent = not getattr(self, "all_prefix_free", True) or len(getattr(self, "others", ())) > 0
            counter.in_user_code += prefix_dependent
            try:
                return method(self, *args, **kwargs)
            finally:
                counter.in_user_code -= prefix_dependent
        return wrapper

    monkeypatch.setattr(loop.SpeculativeDecoder, "step", counted_step)
    monkeypatch.setattr(PositionScorer, "__call__", user_code(PositionScorer.__call__))
    monkeypatch.setattr(TokenStopper, "check", user_code(TokenStopper.check))

    def run(call):
        counter.steps, counter.user_code = [], collections.Counter()
        with _Function(counter), _Dispatch(counter):
            result = call()
        return counter, result

    return run


def _configs(target) -> dict[str, SpeculativeConfig]:
    return {
        "draft": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=4),
        "draft_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3,
                                        tree_width=2),
        "draft_dynamic_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3,
                                                tree_width=2, tree_total_tokens=5),
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4),
        "ngram_trie": SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=2),
        "medusa": SpeculativeConfig(method="medusa", heads=heads_for(target), num_speculative_tokens=3),
        "medusa_tree": SpeculativeConfig(method="medusa", heads=heads_for(target),
                                         tree_paths=[(0,), (1,), (0, 0), (1, 0)]),
        "eagle": SpeculativeConfig(method="eagle", heads=eagle_head(target), num_speculative_tokens=3),
        "eagle_dynamic_tree": SpeculativeConfig(method="eagle", heads=eagle_head(target), top_k=2, depth=3,
                                                total_tokens=5),
        "eagle3": SpeculativeConfig(method="eagle", heads=eagle_head(target, "eagle3"), num_speculative_tokens=3),
        "mlp_speculator": SpeculativeConfig(method="mlp_speculator", heads=random_speculator(target),
                                            num_speculative_tokens=3),
        "mlp_speculator_branches": SpeculativeConfig(method="mlp_speculator", heads=random_speculator(target),
                                                     num_speculative_tokens=3, tree_width=2),
        "mlp_speculator_dynamic_tree": SpeculativeConfig(method="mlp_speculator", heads=random_speculator(target),
                                                         top_k=2, depth=3, total_tokens=5),
        "early_exit": SpeculativeConfig(method="early_exit", early_exit_layer=1, num_speculative_tokens=4),
        "early_exit_dynamic_tree": SpeculativeConfig(method="early_exit", early_exit_layer=1, top_k=2, depth=3,
                                                     total_tokens=5),
        "suffix": SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_cache=SuffixCache()),
        "recycling": SpeculativeConfig(method="recycling", num_speculative_tokens=3, tree_total_tokens=6),
        "suffix_hybrid_draft": SpeculativeConfig(
            method="suffix", num_speculative_tokens=4, suffix_cache=SuffixCache(), fallback_min_score=2.0,
            fallback=SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3)),
        "suffix_hybrid_eagle": SpeculativeConfig(
            method="suffix", num_speculative_tokens=4, suffix_cache=SuffixCache(), fallback_min_score=2.0,
            fallback=SpeculativeConfig(method="eagle", heads=eagle_head(target), num_speculative_tokens=3)),
    }


# hybrid drafting runs with dynamic shapes only
DYNAMIC_ONLY = {"suffix_hybrid_draft", "suffix_hybrid_eagle"}


# the dynamic tree of a draft model (early exit's too: it drafts the same way) reads which accepted nodes it had fed
# (its frontier) back from the device, unless shapes are static (its widths then need no exact lengths)
MEASURED = collections.defaultdict(lambda: 1, {"draft_dynamic_tree": 2, "early_exit_dynamic_tree": 2})
MEASURED_STATIC = collections.defaultdict(lambda: 1)


def _syncs_per_step(counted, target, config: SpeculativeConfig, **kwargs) -> list[collections.Counter]:
    """The host syncs of each verify step of one call, by kind (the call drafted, and ran no user code that
    syncs)."""
    counter, out = counted(lambda: hf_specdec.generate(
        target, speculative=config, max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True,
        use_cache=False, **kwargs))
    assert len(counter.steps) == out.spec_stats.target_forward_passes - 1 >= 3
    assert out.spec_stats.num_draft_tokens > 0
    assert not counter.user_code
    return counter.steps


def _most(steps: list[collections.Counter]) -> int:
    return max(sum(step.values()) for step in steps)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_at_most_two_host_syncs_per_verify_step(counted, sampling, static):
    """Dynamic shapes, and the static shapes compiled forwards run with (here not compiled: the counting modes see
    every op the engine issues, which a compiled graph would hide)."""
    target = make_model("llama")
    ids, mask = padded_batch([10, 6, 8], seed=3, repeat_period=4)
    options = dict(do_sample=True, temperature=0.8) if sampling else dict(do_sample=False)
    if static:
        options["cache_implementation"] = "static"
    for name, config in _configs(target).items():
        if static and name in DYNAMIC_ONLY:
            continue
        config.seed = 0
        steps = _syncs_per_step(counted, target, config, input_ids=ids, attention_mask=mask, **options)
        assert _most(steps) <= MAX_SYNCS_PER_STEP, (name, [dict(step) for step in steps])
        measured = (MEASURED_STATIC if static else MEASURED)[name]
        assert _most(steps) == measured, (name, [dict(step) for step in steps])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_mtp_one_host_sync_per_verify_step(counted, sampling, static):
    """method='mtp' on a model that declares MTP layers (DeepSeek-V3, two layers: drafts switch layers by depth)."""
    target = mtp_target("deepseek_v3", num_layers=2)
    ids, mask = padded_batch([10, 6, 8], seed=3, repeat_period=4)
    options = dict(do_sample=True, temperature=0.8) if sampling else dict(do_sample=False)
    if static:
        options["cache_implementation"] = "static"
    mtp = mtp_layers(target)
    configs = {"chain": SpeculativeConfig(method="mtp", heads=mtp, num_speculative_tokens=3, seed=0),
               "dynamic_tree": SpeculativeConfig(method="mtp", heads=mtp, top_k=2, depth=3, total_tokens=5, seed=0)}
    for name, config in configs.items():
        assert _most(_syncs_per_step(counted, target, config, input_ids=ids, attention_mask=mask, **options)) == 1, name


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_other_tokenizer_host_syncs_per_verify_step(counted, sampling):
    """A draft with another tokenizer: sampling (drafts on the shared vocabulary) 1; greedy 2, since re-tokenising
    the drafted text reads the draft's tokens on the host."""
    tokenizer, target, draft = load_testbed()
    tokenizer.padding_side = "left"
    draft_tokenizer, other = permuted(tokenizer, draft)
    batch = tokenizer(["def parse_args(argv):\n", "import os\n"], return_tensors="pt", padding=True)
    options = dict(do_sample=True, temperature=0.8) if sampling else dict(do_sample=False)
    config = SpeculativeConfig(method="draft", draft_model=other, draft_tokenizer=draft_tokenizer, tokenizer=tokenizer,
                               num_speculative_tokens=3, seed=0)
    assert _most(_syncs_per_step(counted, target, config, **batch, **options)) == (1 if sampling else 2)


class StopAtToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_prefix_dependent_processors_and_criteria_count_apart(counted):
    """With a repetition penalty (prefix-dependent: called per distinct prefix length) and a custom stopping
    criterion, the engine's own syncs stay within the budget; the per-row work those need is counted apart."""
    target = make_model("llama")
    ids, mask = padded_batch([10, 6, 8], seed=3, repeat_period=4)
    config = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3)
    counter, out = counted(lambda: hf_specdec.generate(
        target, ids, attention_mask=mask, speculative=config, max_new_tokens=12, eos_token_id=None,
        repetition_penalty=1.2, stopping_criteria=StoppingCriteriaList([StopAtToken(127)])))
    assert max(sum(step.values()) for step in counter.steps) <= MAX_SYNCS_PER_STEP
    assert sum(counter.user_code.values()) > 0, "the criterion's per-length grouping reads the device"
