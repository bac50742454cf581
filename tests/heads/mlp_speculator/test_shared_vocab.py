"""MLP speculators on their target's vocabulary (`shared_vocab`): each stage embeds with the target's input embedding
and scores with its lm_head through learned maps (checked against the formulas written out here); a token map
restricts the scores; the files hold no vocabulary-sized tensor; `materialize` and `export_fms_extras` write the
published layout with the products, which re-imports as a speculator giving the same logits; clear errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from hf_specdec.heads import MlpSpeculator, MlpSpeculatorConfig
from hf_specdec.heads.mlp_speculator import export_fms_extras
from tests.conftest import make_model

H, V = 32, 128  # the llama test model's hidden size and vocabulary


@pytest.fixture(scope="module")
def target():
    return make_model("llama")


def shared_speculator(**overrides) -> MlpSpeculator:
    """Random maps, projections and norms, so every parameter matters."""
    torch.manual_seed(0)
    values = dict(emb_dim=H, vocab_size=V, n_predict=3, inner_dim=16, scale_input=True, shared_vocab=True,
                  base_model_name_or_path="local/target")
    head = MlpSpeculator(MlpSpeculatorConfig(**values | overrides))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_()
    return head.eval()


def reference_logits(head, target, hidden, tokens):
    """[B, T, V]: the published formulas with emb_i = E @ emb_map_i^T and head_i = W @ head_map_i."""
    config = head.config
    state_weight = 0.5 ** (0.5 / config.n_predict)
    emb_weight = math.sqrt((1 - state_weight**2) * config.inner_size / 2)
    embeddings, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight

    def norm(x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    state, out = norm(hidden) / math.sqrt(2), []
    for i in range(tokens.shape[-1]):
        e, p = (0, min(i, 1)) if config.tie_weights else (i, i)
        z = embeddings[tokens[:, i]] @ head.emb_map[e].weight.T
        state = state @ head.proj[p].weight.T * state_weight + emb_weight * z
        state = nn.functional.gelu(norm(state) * head.ln[e].weight + head.ln[e].bias)
        out.append(state @ (lm_head @ head.head_map[e].weight).T)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("tie_weights", [False, True])
def test_stages_follow_the_formulas_through_the_targets_matrices(target, tie_weights):
    head = shared_speculator(tie_weights=tie_weights)
    hidden, tokens = torch.randn(4, H) * 3, torch.randint(0, V, (4, 3))
    vocab = head.target_vocab(target)
    torch.testing.assert_close(head(hidden, tokens, vocab), reference_logits(head, target, hidden, tokens),
                               rtol=1e-4, atol=1e-4)
    assert not hasattr(head, "emb") and not hasattr(head, "head")
    assert all(p.numel() < V * 16 for p in head.parameters()), "no vocabulary-sized parameter"


def test_a_token_map_scores_its_ids_only(target):
    head = shared_speculator()
    hidden, tokens = torch.randn(4, H), torch.randint(0, V, (4, 3))
    full = head(hidden, tokens, head.target_vocab(target))
    token_map = torch.arange(3, V, 5)
    head.set_token_map(token_map)
    mapped = head(hidden, tokens, head.target_vocab(target))  # [4, 3, V]
    inside = torch.zeros(V, dtype=torch.bool).index_fill_(0, token_map, True)
    torch.testing.assert_close(mapped[..., inside], full[..., inside])
    assert bool(torch.isneginf(mapped[..., ~inside]).all())
    compact = head(hidden, tokens, head.target_vocab(target, compact=True))  # [4, 3, D]
    torch.testing.assert_close(compact, full[..., token_map])


def test_adapter_round_trip_is_small_and_keeps_the_map(tmp_path, target):
    head = shared_speculator(tie_weights=True)
    head.set_token_map(torch.tensor([1, 4, 9, 16, 25]))
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["shared_vocab"] is True and config["token_map_size"] == 5
    stored = load_file(tmp_path / "adapter_model.safetensors")
    assert max(t.numel() for t in stored.values()) == H * 16
    loaded = MlpSpeculator.from_pretrained(tmp_path)
    assert loaded.config == head.config and torch.equal(loaded.token_map, head.token_map)
    hidden, tokens = torch.randn(2, H), torch.randint(0, V, (2, 3))
    assert torch.equal(loaded(hidden, tokens, loaded.target_vocab(target)),
                       head(hidden, tokens, head.target_vocab(target)))


@pytest.mark.parametrize("tie_weights", [False, True])
def test_export_writes_the_products_and_reimports_the_same_speculator(tmp_path, target, tie_weights):
    head = shared_speculator(tie_weights=tie_weights)
    head.set_token_map(torch.arange(0, V, 2))  # the published layout has no map: the export scores every token
    export_fms_extras(head, tmp_path, target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "mlp_speculator" and config["inner_dim"] == 16
    assert "shared_vocab" not in config and "token_map_size" not in config
    written = load_file(tmp_path / "model.safetensors")
    assert written["speculator.emb.0.weight"].shape == (V, 16) and written["speculator.head.0.weight"].shape == (V, 16)
    loaded = MlpSpeculator.from_pretrained(tmp_path)
    assert not loaded.config.shared_vocab and loaded.config.token_map_size is None
    head.set_token_map(None)
    hidden, tokens = torch.randn(3, H) * 2, torch.randint(0, V, (3, 3))
    torch.testing.assert_close(loaded(hidden, tokens), head(hidden, tokens, head.target_vocab(target)),
                               rtol=1e-4, atol=1e-4)


def test_materialize_keeps_the_speculators_dtype_and_mode(target):
    head = shared_speculator().to(torch.bfloat16)
    own = head.materialize(target)
    assert own.dtype == torch.bfloat16 and not own.training and not own.config.shared_vocab
    assert own.emb[0].weight.shape == (V, 16)
    plain = MlpSpeculator(MlpSpeculatorConfig(emb_dim=H, vocab_size=V))
    assert plain.materialize(target) is plain


def test_bad_uses_are_clear_errors(tmp_path, target):
    head = shared_speculator()
    with pytest.raises(ValueError, match=r"MlpSpeculator.advance: vocab: this speculator embeds and scores with its "
                                         r"target's embedding and lm_head \(shared_vocab\); pass "
                                         r"target_vocab\(target\)"):
        head(torch.randn(1, H), torch.tensor([[1]]))
    with pytest.raises(ValueError, match="export_fms_extras: target: this speculator embeds and scores with its "
                                         "target's embedding and lm_head"):
        export_fms_extras(head, tmp_path)
    with pytest.raises(ValueError, match="MlpSpeculatorConfig.token_map_size: only for a speculator that scores with "
                                         r"the target's lm_head \(shared_vocab=True\)"):
        MlpSpeculatorConfig(emb_dim=H, vocab_size=V, token_map_size=8)
    with pytest.raises(ValueError, match="MlpSpeculatorConfig.token_map_size: expected at most vocab_size 128, "
                                         "got 200"):
        MlpSpeculatorConfig(emb_dim=H, vocab_size=V, shared_vocab=True, token_map_size=200)
    with pytest.raises(ValueError, match="MlpSpeculatorConfig.shared_vocab: expected a bool, got 1"):
        MlpSpeculatorConfig(emb_dim=H, vocab_size=V, shared_vocab=1)
    own = MlpSpeculator(MlpSpeculatorConfig(emb_dim=H, vocab_size=V))
    with pytest.raises(ValueError, match="MlpSpeculator.set_token_map: this speculator scores with its own lm_head"):
        own.set_token_map(torch.tensor([1, 2]))
    assert own.target_vocab(target) is None
    biased = make_model("llama")
    biased.get_output_embeddings().bias = nn.Parameter(torch.zeros(V))
    with pytest.raises(ValueError, match="MlpSpeculator.materialize: the target's lm_head has a bias"):
        head.materialize(biased)


def test_the_card_names_the_shared_vocabulary():
    head = shared_speculator(tie_weights=True)
    head.set_token_map(torch.arange(10))
    text = " ".join(head.model_card("user/mlp").text.split())
    assert ("State width 16; the target's own embedding and lm_head, through learned maps, drafting over 10 of its "
            "128 tokens (a token map); tied: one embedding, norm and lm_head for every stage") in text
