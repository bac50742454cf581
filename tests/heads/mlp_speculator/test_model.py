"""The MLP speculator's module: each stage computed as fms-extras and vLLM compute it (checked against the formulas
written out here), tied weights shared as fms-extras ties them, greedy chains, per-path logits, what the files cost,
and clear errors for bad configs and for a target of another shape."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_specdec.heads import MlpSpeculator, MlpSpeculatorConfig
from tests.conftest import make_model

H, V = 12, 23


def random_speculator(**overrides) -> MlpSpeculator:
    """Random weights everywhere (norm weights and biases too), so every parameter matters."""
    torch.manual_seed(0)
    values = dict(emb_dim=H, vocab_size=V, n_predict=3, inner_dim=8, base_model_name_or_path="local/target")
    head = MlpSpeculator(MlpSpeculatorConfig(**values | overrides))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_()
    return head.eval()


def reference_logits(head: MlpSpeculator, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T, V] from the published formulas, with stage i's modules picked as fms-extras ties them."""
    config = head.config
    state_weight = 0.5 ** (0.5 / config.n_predict)
    emb_weight = math.sqrt((1 - state_weight**2) * (config.inner_dim or config.emb_dim) / 2)
    tied = config.tie_weights

    def norm(x, weight=None, bias=None):  # fms-extras' "LayerNorm": no mean subtracted, eps 1e-6
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
        return x if weight is None else x * weight + bias

    state = norm(hidden) / math.sqrt(2) if config.scale_input else hidden
    out = []
    for i in range(tokens.shape[-1]):
        e, p = (0, min(i, 1)) if tied else (i, i)
        z = head.emb[e].weight[tokens[:, i]]
        state = state @ head.proj[p].weight.T * state_weight + emb_weight * z  # the weighted add
        state = nn.functional.gelu(norm(state, head.ln[e].weight, head.ln[e].bias))
        out.append(state @ head.head[e].weight.T)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("tie_weights, scale_input, inner_dim", [(False, False, 8), (True, True, 8), (False, True, 0)])
def test_stages_follow_the_published_formulas(tie_weights, scale_input, inner_dim):
    head = random_speculator(tie_weights=tie_weights, scale_input=scale_input, inner_dim=inner_dim)
    hidden, tokens = torch.randn(4, H) * 3, torch.randint(0, V, (4, 3))
    for length in (1, 3):
        torch.testing.assert_close(head(hidden, tokens[:, :length]), reference_logits(head, hidden, tokens[:, :length]),
                                   rtol=1e-4, atol=1e-4)


def test_tied_weights_are_held_once_and_stage_two_reuses_proj_one():
    tied = random_speculator(tie_weights=True, n_predict=4, top_k_tokens_per_head=[3, 2, 2, 1])
    assert sorted(tied.state_dict()) == ["emb.0.weight", "head.0.weight", "ln.0.bias", "ln.0.weight",
                                         "proj.0.weight", "proj.1.weight"]
    assert tied.proj[0].weight.shape == (8, H) and tied.proj[1].weight.shape == (8, 8)
    untied = random_speculator(n_predict=4, top_k_tokens_per_head=[3, 2, 2, 1])
    assert sorted(untied.state_dict()) == sorted(
        f"{name}.{i}.{part}" for i in range(4) for name, parts in
        (("emb", ["weight"]), ("proj", ["weight"]), ("ln", ["weight", "bias"]), ("head", ["weight"]))
        for part in parts)
    hidden, tokens = torch.randn(2, H), torch.randint(0, V, (2, 4))
    before = tied(hidden, tokens)
    with torch.no_grad():
        tied.proj[1].weight.mul_(-1)
    after = tied(hidden, tokens)
    assert torch.equal(before[:, 0], after[:, 0]) and not torch.allclose(before[:, 2:], after[:, 2:])


def test_inner_dim_zero_means_the_hidden_size():
    head = random_speculator(inner_dim=0)
    assert head.config.inner_size == H and head.emb[0].weight.shape == (V, H) and head.proj[1].weight.shape == (H, H)


def test_greedy_chain_feeds_each_guess_to_the_next_stage():
    head = random_speculator()
    hidden, last = torch.randn(3, H), torch.randint(0, V, (3,))
    tokens, logits = head.greedy_chain(hidden, last, 3)
    assert tokens.shape == (3, 3) and logits.shape == (3, 3, V) and logits.dtype == torch.float32
    path = torch.cat([last[:, None], tokens[:, :-1]], dim=1)
    torch.testing.assert_close(logits, head(hidden, path))
    assert torch.equal(tokens, head(hidden, path).argmax(-1))
    shorter, _ = head.greedy_chain(hidden, last, 2)
    assert torch.equal(shorter, tokens[:, :2])
    # the stages read the chain's tokens: another last token changes every guess's logits
    assert not torch.allclose(head.greedy_chain(hidden, (last + 1) % V, 1)[1], logits[:, :1])


def test_stage_by_stage_api_matches_the_path_logits():
    head = random_speculator(scale_input=True)
    hidden, tokens = torch.randn(2, 5, H), torch.randint(0, V, (2, 5, 3))
    state = head.input_state(hidden)
    for stage in range(3):
        state = head.advance(stage, state, tokens[..., stage])
        torch.testing.assert_close(head.stage_logits(stage, state), head(hidden, tokens)[..., stage, :])


def test_bad_requests_are_clear_errors():
    head = random_speculator()
    with pytest.raises(ValueError, match=r"greedy_chain: num_tokens: expected an int from 1 to n_predict 3 .*got 4"):
        head.greedy_chain(torch.randn(1, H), torch.tensor([1]), 4)
    with pytest.raises(ValueError, match="MlpSpeculator.forward: tokens: expected 1 to n_predict 3 tokens per path, "
                                         "got 4"):
        head(torch.randn(1, H), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="stage 3 does not exist"):
        head.advance(3, torch.randn(1, 8), torch.tensor([1]))


@pytest.mark.parametrize("overrides, message", [
    (dict(n_predict=0), "MlpSpeculatorConfig.n_predict: expected an int >= 1, got 0"),
    (dict(inner_dim=-1), "MlpSpeculatorConfig.inner_dim: expected an int >= 0, got -1"),
    (dict(emb_dim=2.5), "MlpSpeculatorConfig.emb_dim: expected an int >= 1, got 2.5"),
    (dict(tie_weights="yes"), "MlpSpeculatorConfig.tie_weights: expected a bool, got 'yes'"),
    (dict(n_predict=1, tie_weights=True), "MlpSpeculatorConfig.tie_weights: ties the weights of several stages"),
    (dict(top_k_tokens_per_head=[5, 4]), r"top_k_tokens_per_head: expected 3 ints >= 1 .*got \[5, 4\]"),
    (dict(top_k_tokens_per_head=[5, 0, 1]), r"top_k_tokens_per_head: expected 3 ints >= 1"),
    (dict(top_k_tokens_per_head=[2, 1, 1], n_candidates=3), "n_candidates: expected at most the tree's 2 paths"),
])
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        MlpSpeculatorConfig(**dict(emb_dim=H, vocab_size=V) | overrides)


def test_default_candidates_per_stage():
    assert MlpSpeculatorConfig(emb_dim=H, vocab_size=V).top_k_tokens_per_head == [5, 4, 3]
    assert MlpSpeculatorConfig(emb_dim=H, vocab_size=V, n_predict=6).top_k_tokens_per_head == [5, 4, 3, 2, 1, 1]


def test_a_target_of_another_shape_is_refused():
    target = make_model("llama")  # hidden 32, vocabulary 128
    random_speculator(emb_dim=32, vocab_size=128).check_target(target)
    with pytest.raises(ValueError, match="SpeculativeConfig.heads: the MLP speculator's emb_dim 12 does not match the "
                                         "target's hidden_size 32; it was trained for another model"):
        random_speculator(vocab_size=128).check_target(target)
    with pytest.raises(ValueError, match="vocab_size 23 does not match the target's vocab_size 128"):
        random_speculator(emb_dim=32).check_target(target)


@pytest.mark.parametrize("tie_weights, inner_dim, shared_vocab, millions", [
    (True, 576, False, 57.3), (True, 256, False, 25.4), (False, 576, False, 170.9), (False, 256, False, 75.8),
    (True, 576, True, 1.3), (False, 1024, True, 6.2), (False, 1024, False, 304.7)])
def test_what_a_speculator_for_smollm2_costs(tie_weights, inner_dim, shared_vocab, millions):
    """The sizes the module docstring quotes (SmolLM2-135M: vocabulary 49152, hidden size 576; 3 stages)."""
    with torch.device("meta"):
        head = MlpSpeculator(MlpSpeculatorConfig(emb_dim=576, vocab_size=49152, inner_dim=inner_dim,
                                                 tie_weights=tie_weights, shared_vocab=shared_vocab))
    assert round(head.num_parameters() / 1e6, 1) == millions
