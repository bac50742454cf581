"""Published EAGLE layouts: SafeAILab and speculators folders built with their exact key names, and export to
speculators then re-import."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hf_specdec.heads import EagleConfig, EagleHead
from hf_specdec.heads.eagle import export_speculators

H, V, DRAFT_V, TARGET_LAYERS = 32, 64, 48, 8


def random_head(version: str = "eagle3", **overrides) -> EagleHead:
    """A tiny head with random weights; an EAGLE-3 one maps its draft vocabulary onto random target ids."""
    torch.manual_seed(0)
    values = dict(version=version, hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=V, base_model_name_or_path="local/target")
    if version == "eagle3":
        values |= dict(fc_bias=False, feature_layers=(2, 4, 5), draft_vocab_size=DRAFT_V)
    head = EagleHead(EagleConfig(**values | overrides))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
        if version == "eagle3" and head.config.draft_vocab_size:
            target_ids = torch.randperm(V)[:DRAFT_V].sort().values
            head.d2t.copy_(target_ids - torch.arange(DRAFT_V))
            head.t2d.zero_()
            head.t2d[target_ids] = True
    return head.eval()


def assert_same(a: EagleHead, b: EagleHead) -> None:
    assert a.config == b.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    torch.manual_seed(1)
    embeds, features = torch.randn(2, 3, H), torch.randn(2, 3, a.config.feature_size)
    positions = torch.arange(3).expand(2, 3)
    mask = torch.triu(torch.full((3, 3), float("-inf")), 1).expand(2, 1, 3, 3)
    lm_head = nn.Linear(H, V, bias=False)
    out_a, out_b = a(embeds, features, positions, mask), b(embeds, features, positions, mask)
    assert torch.equal(out_a, out_b)
    assert torch.equal(a.logits(out_a, lm_head), b.logits(out_b, lm_head))


def llama_dict(**extra) -> dict:
    """A SafeAILab-style config.json: the draft layer's Llama config (legacy rope_theta, one layer)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": V,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096, "hidden_act": "silu",
            "torch_dtype": "float16"} | extra


def write(folder, config: dict, weights: dict[str, torch.Tensor], name: str = "model.safetensors") -> None:
    (folder / "config.json").write_text(json.dumps(config))
    weights = {k: v.detach().clone() for k, v in weights.items()}
    if name.endswith(".safetensors"):
        save_file(weights, str(folder / name))
    else:
        torch.save(weights, folder / name)


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize("bias", [True, False, None])
def test_safeailab_eagle1_layout(tmp_path, name, bias):
    head = random_head("eagle", fc_bias=bias is not False)
    weights = head.state_dict() | {"embed_tokens.weight": torch.randn(V, H)}
    assert sorted(weights) == sorted(
        ["fc.weight", "embed_tokens.weight", "layers.0.post_attention_layernorm.weight"]
        + (["fc.bias"] if bias is not False else [])
        + [f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
        + [f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    )
    # "bias" absent means True (SafeAILab's default)
    write(tmp_path, llama_dict(base_model_name_or_path="local/target", **({} if bias is None else {"bias": bias})),
          weights, name)
    assert_same(head, EagleHead.from_pretrained(tmp_path))


def test_half_precision_checkpoints_load_in_float32(tmp_path):
    head = random_head("eagle")
    write(tmp_path, llama_dict(), {k: v.half() for k, v in head.state_dict().items()})
    loaded = EagleHead.from_pretrained(tmp_path)
    assert loaded.dtype == torch.float32
    for key, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor.half().float()), key


def eagle3_safeailab_weights(head: EagleHead) -> dict[str, torch.Tensor]:
    weights = head.state_dict() | {"embed_tokens.weight": torch.randn(V, H)}
    assert sorted(weights) == sorted(
        ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"]
        + [f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"]
        + [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        + [f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")]
    )
    return weights


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_safeailab_eagle3_layout(tmp_path, name):
    # feature layers (2, L // 2, L - 3) of an 8-layer target: (2, 4, 5)
    head = random_head("eagle3", base_model_name_or_path=None)
    write(tmp_path, llama_dict(draft_vocab_size=DRAFT_V), eagle3_safeailab_weights(head), name)
    assert_same(head, EagleHead.from_pretrained(tmp_path, num_target_layers=TARGET_LAYERS))
    assert_same(head, EagleHead.from_pretrained(tmp_path, feature_layers=(2, 4, 5)))
    # without either, the head records none and fuses the default layers of the target it meets at generate
    unresolved = EagleHead.from_pretrained(tmp_path)
    assert_same(random_head("eagle3", base_model_name_or_path=None, feature_layers=None), unresolved)
    assert unresolved.config.target_feature_layers(TARGET_LAYERS) == (2, 4, 5)
    with pytest.raises(ValueError, match="export_speculators: the head does not record which target layers"):
        export_speculators(unresolved, tmp_path / "exported", verifier_name_or_path="local/target")


def test_safeailab_eagle3_without_maps_is_the_identity(tmp_path):
    head = random_head("eagle3", draft_vocab_size=None, target_hidden_size=H, base_model_name_or_path=None)
    weights = {k: v for k, v in eagle3_safeailab_weights(head).items() if k not in ("d2t", "t2d")}
    write(tmp_path, llama_dict(draft_vocab_size=V, target_hidden_size=H), weights)
    loaded = EagleHead.from_pretrained(tmp_path, num_target_layers=TARGET_LAYERS)
    assert loaded.config.draft_vocab_size is None
    assert not loaded.d2t.any() and loaded.t2d.all()
    assert_same(head, loaded)


def test_missing_and_unrecognised_keys_are_named(tmp_path):
    weights = random_head("eagle").state_dict()
    weights.pop("layers.0.mlp.up_proj.weight")
    write(tmp_path, llama_dict(), weights)
    with pytest.raises(ValueError, match=r"SafeAILab EAGLE-1 weights: missing \['layers.0.mlp.up_proj.weight'\]"):
        EagleHead.from_pretrained(tmp_path)
    # HASS-style extra norms are not part of this head
    extra_norm = {"layers.0.input_layernorm.weight": torch.ones(H)}
    write(tmp_path, llama_dict(), random_head("eagle").state_dict() | extra_norm)
    with pytest.raises(ValueError, match=r"not recognised \['layers.0.input_layernorm.weight'\]"):
        EagleHead.from_pretrained(tmp_path)
    # a draft vocabulary needs its maps
    weights = {k: v for k, v in random_head("eagle3").state_dict().items() if k != "d2t"}
    write(tmp_path, llama_dict(draft_vocab_size=DRAFT_V), weights)
    with pytest.raises(ValueError, match=r"missing \['d2t'\]"):
        EagleHead.from_pretrained(tmp_path, num_target_layers=TARGET_LAYERS)


def test_weights_that_contradict_the_config_are_a_clear_error(tmp_path):
    write(tmp_path, llama_dict(intermediate_size=128), random_head("eagle").state_dict())
    with pytest.raises(ValueError, match="weights do not match its config.json"):
        EagleHead.from_pretrained(tmp_path)


def test_unrecognised_folders(tmp_path):
    with pytest.raises(ValueError, match="not an EAGLE head folder"):
        EagleHead.from_pretrained(tmp_path)
    write(tmp_path, llama_dict(), {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="unrecognised EAGLE weights: expected 'layers.0.\\*'"):
        EagleHead.from_pretrained(tmp_path)


def speculators_config(kind: str, **extra) -> dict:
    """config.json as speculators writes it (fields from its EagleSpeculatorConfig / Eagle3SpeculatorConfig)."""
    return {
        "architectures": ["Eagle3Speculator"] if kind == "eagle3" else ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": kind,
        "speculators_version": "0.4.0",
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": "local/target", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": llama_dict(),
    } | extra


def test_speculators_eagle3_layout(tmp_path):
    head = random_head("eagle3")
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in head.state_dict().items()}
    weights["embed_tokens.weight"] = torch.randn(V, H)
    write(tmp_path, speculators_config("eagle3", draft_vocab_size=DRAFT_V, target_hidden_size=None,
                                       norm_before_residual=False, norm_before_fc=False, fc_norm=False,
                                       norm_output=False, eagle_aux_hidden_state_layer_ids=[2, 4, 5]), weights)
    assert_same(head, EagleHead.from_pretrained(tmp_path))


def test_speculators_eagle1_layout(tmp_path):
    head = random_head("eagle", fc_bias=True)
    weights = {k.replace("fc.", "fusion_fc.").replace("layers.0.", "transformer."): v
               for k, v in head.state_dict().items()}
    assert {"fusion_fc.weight", "fusion_fc.bias", "transformer.self_attn.q_proj.weight"} <= set(weights)
    write(tmp_path, speculators_config("eagle", transformer_layer_architecture="LlamaDecoderLayer", layernorms=False,
                                       fusion_bias=True), weights)
    assert_same(head, EagleHead.from_pretrained(tmp_path))


@pytest.mark.parametrize(("config", "message"), [
    (speculators_config("dflash"), "speculators_model_type 'dflash' is not supported"),
    (speculators_config("eagle3", norm_before_fc=True), r"speculators options \['norm_before_fc'\] are not supported"),
    (speculators_config("eagle", layernorms=True), r"speculators options \['layernorms'\] are not supported"),
    (speculators_config("eagle3", transformer_layer_config=llama_dict(model_type="qwen3")),
     "transformer_layer_config: expected one Llama decoder layer, got model_type 'qwen3'"),
])
def test_unsupported_speculators_checkpoints(tmp_path, config, message):
    write(tmp_path, config, {"fc.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=message):
        EagleHead.from_pretrained(tmp_path)


@pytest.mark.parametrize("overrides", [
    dict(version="eagle", fc_bias=False),
    dict(version="eagle", fc_bias=True, head_dim=16),
    dict(version="eagle3"),
    dict(version="eagle3", draft_vocab_size=None, norm_before_residual=True, target_hidden_size=H,
         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}),
])
def test_speculators_export_then_import_is_identical(tmp_path, overrides):
    head = random_head(**overrides)
    export_speculators(head, tmp_path, speculative_tokens=4, verifier_architectures=["LlamaForCausalLM"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert list(config) == sorted(config)
    # what vLLM's speculators loader requires
    kind = head.config.version
    assert config["speculators_model_type"] == kind and config["speculators_config"]["algorithm"] == kind
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"] == {"name_or_path": "local/target",
                                                         "architectures": ["LlamaForCausalLM"]}
    assert config["transformer_layer_config"]["model_type"] == "llama"
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    if kind == "eagle3":
        assert config["architectures"] == ["Eagle3Speculator"]
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
        assert "layers.0.hidden_norm.weight" in keys and not any(k.startswith("midlayer.") for k in keys)
    else:
        assert config["fusion_bias"] == head.config.fc_bias and not config["layernorms"]
        assert "fusion_fc.weight" in keys and "transformer.mlp.up_proj.weight" in keys
    assert_same(head, EagleHead.from_pretrained(tmp_path))


def test_speculators_export_needs_a_verifier(tmp_path):
    head = random_head(base_model_name_or_path=None)
    with pytest.raises(ValueError, match="export_speculators: verifier_name_or_path: expected the target's Hub id"):
        export_speculators(head, tmp_path)
    with pytest.raises(ValueError, match="speculative_tokens: expected an int >= 1, got 0"):
        export_speculators(head, tmp_path, verifier_name_or_path="x/y", speculative_tokens=0)
    export_speculators(head, tmp_path, verifier_name_or_path="x/y")
    assert EagleHead.from_pretrained(tmp_path).config.base_model_name_or_path == "x/y"
