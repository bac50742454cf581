"""Tiny random models of every supported architecture, built from configs (no downloads)."""

from __future__ import annotations

import copy
import functools
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_specdec import SpeculativeConfig
from hf_specdec.decoding import loop
from hf_specdec.schedule import controller, tree_size
from hf_specdec.schedule.estimates import CostTable

# under pytest-xdist each worker gets one torch thread: the workers share the cores, and the tiny models gain
# nothing from a second thread
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128
PAD, EOS, BOS = 0, 1, 2
SPECIAL = {"pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": BOS}
DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256}

ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **DECODER, **SPECIAL)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, **SPECIAL)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, **DECODER, **SPECIAL)),
    "gpt_neox": lambda: GPTNeoXForCausalLM(
        GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=256, **SPECIAL)
    ),
    "opt": lambda: OPTForCausalLM(
        OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                  word_embed_proj_dim=32, max_position_embeddings=256, **SPECIAL)
    ),
    # sliding window (4) shorter than the prompt, applied to every layer (Mistral style)
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(vocab_size=VOCAB, **DECODER, sliding_window=4, **SPECIAL)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(vocab_size=VOCAB, **DECODER, sliding_window=5, **SPECIAL)),
    # alternating sliding (window 6, shorter than the prompt) and full layers (Gemma-2 style)
    "gemma2": lambda: Gemma2ForCausalLM(
        Gemma2Config(vocab_size=VOCAB, **{**DECODER, "num_hidden_layers": 4}, head_dim=8, sliding_window=6, **SPECIAL)
    ),
}


def run_under_accelerate(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`accelerate launch` of 2 CPU processes (gloo over a torchrun launcher) running `python -m hf_specdec.cli
    *args` in `cwd`, on a free port: launches from tests running at the same time do not meet."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
               "--dynamo_backend", "no", "-m", "hf_specdec.cli", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def make_model(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]().eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    model.generation_config.bos_token_id = BOS
    return model


def record_proposed_tokens(monkeypatch, proposer_class: type) -> list[torch.Tensor]:
    """Patch `proposer_class.propose` to keep each proposal's drafted tokens (its tree's valid nodes after the root);
    the returned list fills as generate runs."""
    proposals: list[torch.Tensor] = []
    propose = proposer_class.propose

    def recording(self, state):
        proposal = propose(self, state)
        proposals.append(proposal.tree.token_ids[:, 1:][proposal.tree.valid[:, 1:]])
        return proposal

    monkeypatch.setattr(proposer_class, "propose", recording)
    return proposals


def record_eagle_guesses(monkeypatch) -> list[torch.Tensor]:
    """Patch `EagleDrafter.forward` to keep the argmax of every logits row it returns (its top guesses)."""
    from hf_specdec.proposers.eagle import EagleDrafter

    guesses: list[torch.Tensor] = []
    original = EagleDrafter.forward

    @functools.wraps(original)  # the cache keyword is read from the forward's signature
    def recording(self, input_ids, *args, **kwargs):
        out = original(self, input_ids, *args, **kwargs)
        guesses.append(out.logits.argmax(dim=-1).flatten())
        return out

    monkeypatch.setattr(EagleDrafter, "forward", recording)
    return guesses


def make_draft(seed: int = 1, vocab: int = VOCAB) -> torch.nn.Module:
    """A random one-layer Llama with the shared vocabulary: drafts that are rarely accepted."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, **{**DECODER, "hidden_size": 16, "num_hidden_layers": 1,
                                             "intermediate_size": 32}, **SPECIAL)
    return LlamaForCausalLM(config).eval()


def noisy_copy(target: torch.nn.Module, scale: float = 0.5, seed: int = 3) -> torch.nn.Module:
    """The target with noise on its lm_head: drafts often accepted, sometimes rejected."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        lm_head = draft.get_output_embeddings()
        noise = torch.randn(lm_head.weight.shape, generator=torch.Generator().manual_seed(seed))
        lm_head.weight = torch.nn.Parameter(lm_head.weight + scale * float(lm_head.weight.std()) * noise)
    return draft


def padded_batch(
    lengths: list[int], seed: int = 0, repeat_period: int | None = None, side: str = "left"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, padded on `side`; with repeat_period the text repeats (n-gram matches)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        if repeat_period:
            phrase = torch.randint(3, VOCAB, (repeat_period,), generator=generator)
            tokens = phrase.repeat(length // repeat_period + 1)[:length]
        else:
            tokens = torch.randint(3, VOCAB, (length,), generator=generator)
        start = width - length if side == "left" else 0
        ids[row, start : start + length] = tokens
        mask[row, start : start + length] = 1
    return ids, mask


def run_racing_threads(work, count: int) -> None:
    """work(i) for i < count, each in its own thread, with the interpreter switching threads as often as it can (so
    races show); returns once every thread has ended."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)


def draft_shapes(method: str, chain_k: int, **drafter) -> dict[str, SpeculativeConfig]:
    """`method`'s configs in the three draft shapes a drafter with its own forwards is checked under: a chain of
    `chain_k` tokens, branches (3 deep, 2 wide) and an EAGLE-2 dynamic tree (top 2, depth 3, 5 nodes)."""
    return {
        "chain": SpeculativeConfig(method=method, num_speculative_tokens=chain_k, **drafter),
        "branches": SpeculativeConfig(method=method, num_speculative_tokens=3, tree_width=2, **drafter),
        "dynamic_tree": SpeculativeConfig(method=method, top_k=2, depth=3, total_tokens=5, **drafter),
    }


@pytest.fixture
def forward_counter():
    """Counts forward calls of a module: `count = forward_counter(model)` then `count()`."""
    handles = []

    def attach(model: torch.nn.Module):
        calls = []
        handles.append(model.register_forward_hook(lambda *_: calls.append(1)))
        return lambda: len(calls)

    yield attach
    for handle in handles:
        handle.remove()


# The adaptive schedule decides from measured step times, which differ from run to run. Every test runs it on a
# fixed cost curve instead (a step drafting w tokens costs 1 + INJECTED_SLOPE * w plain steps), so its decisions
# depend on accepted counts alone and every run is deterministic; tests/schedule cover the measured path apart.
INJECTED_SLOPE = 0.05


class InjectedCosts(CostTable):
    """A step-time table that ignores measurements: predicts `1 + slope * width` at every batch size (and never
    finds that drafting did not pay)."""

    def __init__(self, slope: float = INJECTED_SLOPE) -> None:
        super().__init__()
        self.slope = slope

    def observe(self, batch_size: int, width: int, seconds: float) -> None:
        pass

    def observe_realized(self, batch_size: int, width: int, tokens: float, seconds: float, rows: int) -> None:
        pass

    def plain_due(self, batch_size: int) -> bool:
        return False

    def predict(self, batch_size: int, max_k: int) -> np.ndarray:
        return 1.0 + self.slope * np.arange(max_k + 1, dtype=float)


@pytest.fixture(autouse=True)
def injected_step_costs(monkeypatch):
    """The schedule's step-time tables are `InjectedCosts` in every test (see above)."""
    monkeypatch.setattr(controller, "cost_table", lambda model, key: InjectedCosts())


# Likewise `tree_total_tokens="auto"` sizes a tree from timed verify forwards: on a busy machine a width can read
# costly and shrink the tree to its chain's length (a dynamic tree of 2 nodes over a chain of 2 is two siblings, and
# nothing at depth 2 is ever drafted). Inside generate every test times widths on a fixed curve instead, a forward of
# w tokens per row costing 1 + INJECTED_TREE_SLOPE * w; tests/schedule/test_tree_size.py covers the measurement.
INJECTED_TREE_SLOPE = 0.02


def injected_verify_costs(model, batch_size: int, widths: list[int], stop_above: float) -> dict[int, float]:
    """`tree_size.measure_verify_costs`' answer on the fixed curve above (no forward runs)."""
    return {width: 1.0 + INJECTED_TREE_SLOPE * width for width in widths}


@pytest.fixture(autouse=True)
def injected_tree_costs(monkeypatch):
    """generate's automatic tree sizes come from `injected_verify_costs` in every test (see above)."""
    monkeypatch.setattr(loop, "auto_tree_size", functools.partial(tree_size.auto_tree_size,
                                                                  measure=injected_verify_costs))
