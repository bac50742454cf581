"""IBM fms-extras' published MLP speculator layout, built in temp folders with its exact file and key names: loaded
(prefixed or not, tied or not, safetensors or pickle), exported back and re-imported with identical tensors, and
clear errors for malformed or mismatched files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_specdec.heads import MlpSpeculator
from hf_specdec.heads.mlp_speculator import export_fms_extras
from tests.conftest import make_model
from tests.heads.mlp_speculator.test_model import H, V, random_speculator

N = 3


def published_config(head: MlpSpeculator, **overrides) -> dict:
    """config.json of `head` as fms-extras' MLPSpeculatorConfig writes it."""
    c = head.config
    return {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
            "vocab_size": c.vocab_size, "emb_dim": c.emb_dim, "inner_dim": c.inner_dim, "n_predict": c.n_predict,
            "top_k_tokens_per_head": c.top_k_tokens_per_head, "n_candidates": c.n_candidates,
            "tie_weights": c.tie_weights, "scale_input": c.scale_input, "torch_dtype": "float32",
            "transformers_version": "4.40.0"} | overrides


def published_weights(head: MlpSpeculator, prefix: str = "speculator.", every_stage: bool = False) -> dict:
    """The exact keys of a published file: every stage's tensors, or for a tied head the shared ones once (or, with
    `every_stage`, once per stage)."""
    tied = head.config.tie_weights
    stages = range(N) if (not tied or every_stage) else [0]
    out = {}
    for i in stages:
        e = 0 if tied else i
        out[f"{prefix}emb.{i}.weight"] = head.emb[e].weight.detach().clone()
        out[f"{prefix}head.{i}.weight"] = head.head[e].weight.detach().clone()
        out[f"{prefix}ln.{i}.weight"] = head.ln[e].weight.detach().clone()
        out[f"{prefix}ln.{i}.bias"] = head.ln[e].bias.detach().clone()
    for i in range(N) if (not tied or every_stage) else [0, 1]:
        out[f"{prefix}proj.{i}.weight"] = head.proj[0 if i == 0 else (1 if tied else i)].weight.detach().clone()
    return out


def write(folder: Path, config: dict, weights: dict, pickled: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if pickled:
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        save_file(weights, str(folder / "model.safetensors"))
    return folder


def assert_same(a: MlpSpeculator, b: MlpSpeculator) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    hidden, tokens = torch.randn(2, H), torch.randint(0, V, (2, N))
    assert torch.equal(a(hidden, tokens), b(hidden, tokens))


@pytest.mark.parametrize("prefix", ["speculator.", ""])
@pytest.mark.parametrize("pickled", [False, True])
def test_published_layout_loads(tmp_path, prefix, pickled):
    head = random_speculator(scale_input=True, top_k_tokens_per_head=[4, 3, 2])
    write(tmp_path, published_config(head), published_weights(head, prefix), pickled)
    loaded = MlpSpeculator.from_pretrained(tmp_path)
    assert loaded.config.top_k_tokens_per_head == [4, 3, 2] and loaded.config.scale_input
    assert loaded.config.base_model_name_or_path is None
    assert_same(head, loaded)


@pytest.mark.parametrize("every_stage", [False, True])
def test_tied_layout_loads_with_shared_tensors_once_or_per_stage(tmp_path, every_stage):
    head = random_speculator(tie_weights=True)
    write(tmp_path, published_config(head), published_weights(head, every_stage=every_stage))
    assert_same(head, MlpSpeculator.from_pretrained(tmp_path))


def test_defaults_of_absent_keys_are_fms_extras(tmp_path):
    head = random_speculator(inner_dim=0, top_k_tokens_per_head=[5, 4, 3])
    config = {"model_type": "mlp_speculator", "vocab_size": V, "emb_dim": H, "n_predict": N}
    loaded = MlpSpeculator.from_pretrained(write(tmp_path, config, published_weights(head)))
    assert loaded.config.inner_dim == 0 and loaded.config.top_k_tokens_per_head == [5, 4, 3]
    assert loaded.config.n_candidates == 5 and not loaded.config.tie_weights and not loaded.config.scale_input
    assert_same(head, loaded)


@pytest.mark.parametrize("tie_weights", [False, True])
def test_export_writes_the_published_layout_and_reimports_identical_tensors(tmp_path, tie_weights):
    head = random_speculator(tie_weights=tie_weights, scale_input=True, top_k_tokens_per_head=[4, 3, 2])
    export_fms_extras(head, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
                      "vocab_size": V, "emb_dim": H, "inner_dim": 8, "n_predict": N, "top_k_tokens_per_head": [4, 3, 2],
                      "n_candidates": 5, "tie_weights": tie_weights, "scale_input": True,
                      "base_model_name_or_path": "local/target"}
    assert list(config) == sorted(config)
    written = load_file(tmp_path / "out" / "model.safetensors")
    expected = published_weights(head)
    assert written.keys() == expected.keys()
    for key in expected:
        assert torch.equal(written[key], expected[key]), key
    loaded = MlpSpeculator.from_pretrained(tmp_path / "out")
    assert loaded.config == head.config
    assert_same(head, loaded)
    # and once more: what a re-import exports is the same file
    export_fms_extras(loaded, tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)


def test_export_keeps_the_heads_dtype(tmp_path):
    head = random_speculator().to(torch.bfloat16)
    export_fms_extras(head, tmp_path)
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}
    assert_same(head, MlpSpeculator.from_pretrained(tmp_path).to(torch.bfloat16))


def test_malformed_files_are_named(tmp_path):
    head = random_speculator()
    weights = published_weights(head)
    with pytest.raises(ValueError, match="not an MLP speculator folder"):
        MlpSpeculator.from_pretrained(tmp_path)
    write(tmp_path / "type", published_config(head, model_type="llama"), weights)
    with pytest.raises(ValueError, match=r"type/config.json: model_type 'llama' is not 'mlp_speculator'"):
        MlpSpeculator.from_pretrained(tmp_path / "type")
    config = published_config(head)
    del config["emb_dim"]
    write(tmp_path / "missing", config, weights)
    with pytest.raises(ValueError, match=r"missing/config.json: missing \['emb_dim'\]"):
        MlpSpeculator.from_pretrained(tmp_path / "missing")
    write(tmp_path / "topk", published_config(head, top_k_tokens_per_head=[5, 4]), weights)
    with pytest.raises(ValueError, match=r"topk/config.json: MlpSpeculatorConfig.top_k_tokens_per_head: expected 3"):
        MlpSpeculator.from_pretrained(tmp_path / "topk")
    write(tmp_path / "absent", published_config(head), {k: v for k, v in weights.items() if "ln.2.bias" not in k})
    with pytest.raises(ValueError, match=r"fms-extras MLP speculator weights: missing \['ln.2.bias'\], not recognised "
                                         r"\[\]"):
        MlpSpeculator.from_pretrained(tmp_path / "absent")
    write(tmp_path / "extra", published_config(head), weights | {"speculator.ln0.weight": torch.ones(H)})
    with pytest.raises(ValueError, match=r"missing \[\], not recognised \['ln0.weight'\]"):
        MlpSpeculator.from_pretrained(tmp_path / "extra")
    write(tmp_path / "shape", published_config(head, inner_dim=6), weights)
    with pytest.raises(ValueError, match=r"(?s)weights do not match its config.json: .*size mismatch for emb.0.weight"):
        MlpSpeculator.from_pretrained(tmp_path / "shape")
    (tmp_path / "shape" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model.safetensors: cannot be read as safetensors"):
        MlpSpeculator.from_pretrained(tmp_path / "shape")


def test_tied_copies_that_differ_are_refused(tmp_path):
    head = random_speculator(tie_weights=True)
    weights = published_weights(head, every_stage=True)
    weights["speculator.head.2.weight"] = weights["speculator.head.2.weight"] + 1
    write(tmp_path, published_config(head), weights)
    with pytest.raises(ValueError, match="tie_weights is true, but head.2.weight differs from head.0.weight"):
        MlpSpeculator.from_pretrained(tmp_path)


def test_a_speculator_for_another_model_is_refused_by_the_target(tmp_path):
    head = random_speculator()
    write(tmp_path, published_config(head), published_weights(head))
    with pytest.raises(ValueError, match="emb_dim 12 does not match the target's hidden_size 32"):
        MlpSpeculator.from_pretrained(tmp_path).check_target(make_model("llama"))
