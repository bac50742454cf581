"""Published EAGLE checkpoints converted to our parameter names and config on load, and export to the
vllm-project/speculators format (what vLLM and SGLang serve). Facts from the SafeAILab/EAGLE and
vllm-project/speculators repositories:

- SafeAILab EAGLE-1: `config.json` (a Llama config, `num_hidden_layers` 1, optional `bias` for fc, default True)
  and `model.safetensors` or `pytorch_model.bin` (loaded with `torch.load(weights_only=True)`); keys `fc.*`,
  `layers.0.*`;
- SafeAILab EAGLE-3: the same files, config with `draft_vocab_size` (and optional `target_hidden_size`); keys
  `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (identity maps when both are absent and
  the draft vocabulary is the target's);
- speculators: `config.json` with `speculators_model_type` "eagle3" (keys `layers.0.*` for our `midlayer.*`) or
  "eagle" (older EAGLE-1 checkpoints: `fusion_fc.*` for `fc.*`, `transformer.*` for `layers.0.*`), the decoder
  layer's Llama config nested in `transformer_layer_config`.
`embed_tokens.weight` (and a speculators EAGLE-1 `lm_head.weight`) are the target's and are dropped; every other key
must be one of the head's (the head is built by `AdapterMixin.from_files`, which names what is missing or not
recognised).

The target layers EAGLE-3 fuses are recorded by speculators' `eagle_aux_hidden_state_layer_ids` (and by our
folders); SafeAILab's files do not record them (their code uses 2, L // 2 and L - 3 of the target): such a config
keeps `feature_layers=None` (see `EagleHead.from_pretrained`). The conversions are pure functions of the config dict
and the tensors; `read_published` reads the files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig

from hf_specdec.heads.adapter import CONFIG_NAME, HeadFiles, read_json, read_weights
from hf_specdec.heads.eagle.config import EagleConfig, EagleVersion

# the speculators release whose formats are written: the last one with both the "eagle" and "eagle3" models
SPECULATORS_VERSION = "0.4.0"
SPECULATORS_WEIGHTS_NAME = "model.safetensors"
# speculators' parameter prefixes -> ours
_SPECULATORS_PREFIXES: dict[str, dict[str, str]] = {
    "eagle": {"fusion_fc.": "fc.", "transformer.": "layers.0."},
    "eagle3": {"layers.0.": "midlayer."},
}
_SPECULATORS_ARCHITECTURES = {"eagle": ["EagleSpeculator", "LlamaDecoderLayer"], "eagle3": ["Eagle3Speculator"]}
# speculators options our head does not implement: a checkpoint that turns one on is refused
_SPECULATORS_UNSUPPORTED = {"eagle": ("layernorms",), "eagle3": ("norm_before_fc", "fc_norm", "norm_output")}
# decoder-layer fields written to transformer_layer_config
_LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps")


def read_published(folder: Path) -> HeadFiles:
    """A SafeAILab or speculators EAGLE folder, converted."""
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{folder}: not an EAGLE head folder (expected {CONFIG_NAME}, a config.json with speculators_model_type "
            "(speculators), or a SafeAILab config.json with model.safetensors / pytorch_model.bin)"
        )
    config = read_json(folder / "config.json")
    weights = read_weights(folder, "model", pickle_name="pytorch_model.bin")
    if "speculators_model_type" in config:
        layout = f"speculators {config['speculators_model_type']!r}"
        return HeadFiles(folder, layout, "config.json", *from_speculators(folder, config, weights))
    eagle_config, tensors = from_safeailab(folder, config, weights)
    layout = "SafeAILab EAGLE-3" if eagle_config.version == "eagle3" else "SafeAILab EAGLE-1"
    return HeadFiles(folder, layout, "config.json", eagle_config, tensors)


def from_safeailab(
    folder: Path, config: dict, weights: dict[str, torch.Tensor]
) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """SafeAILab's config.json (the draft layer's Llama config) and weights: EAGLE-3 if they hold `midlayer.*`,
    EAGLE-1 if `layers.0.*`."""
    weights = _without(weights, ("embed_tokens.weight",))
    base = config.get("base_model_name_or_path")
    if any(key.startswith("midlayer.") for key in weights):
        eagle_config = _config_from_layer(config, "eagle3", draft_vocab_size=config.get("draft_vocab_size"),
                                          target_hidden_size=config.get("target_hidden_size"),
                                          base_model_name_or_path=base)
        return eagle_config, _with_identity_maps(eagle_config, weights)
    if any(key.startswith("layers.0.") for key in weights):
        return _config_from_layer(config, "eagle", fc_bias=bool(config.get("bias", True)),
                                  base_model_name_or_path=base), weights
    raise ValueError(
        f"{folder}: unrecognised EAGLE weights: expected 'layers.0.*' (SafeAILab EAGLE-1) or 'midlayer.*' (EAGLE-3) "
        f"keys, or speculators_model_type in config.json; found {sorted(weights)[:6]}"
    )


def from_speculators(
    folder: Path, config: dict, weights: dict[str, torch.Tensor]
) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """A speculators config.json ("eagle" or "eagle3" speculator) and its weights."""
    kind = config["speculators_model_type"]
    if kind not in _SPECULATORS_PREFIXES:
        raise ValueError(
            f"{folder}: speculators_model_type {kind!r} is not supported (expected one of "
            f"{sorted(_SPECULATORS_PREFIXES)})"
        )
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{folder}: transformer_layer_config: expected a dict (a Llama config), got {layer!r}")
    if layer.get("model_type", "llama") != "llama" or layer.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{folder}: transformer_layer_config: expected one Llama decoder layer, got model_type "
            f"{layer.get('model_type')!r} with {layer.get('num_hidden_layers')} layers"
        )
    enabled = [flag for flag in _SPECULATORS_UNSUPPORTED[kind] if config.get(flag)]
    if enabled:
        raise ValueError(f"{folder}: speculators options {enabled} are not supported by EagleHead")
    base = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    weights = _rename(weights, _SPECULATORS_PREFIXES[kind])
    if kind == "eagle":
        eagle_config = _config_from_layer(layer, "eagle", fc_bias=bool(config.get("fusion_bias", False)),
                                          base_model_name_or_path=base)
        return eagle_config, _without(weights, ("embed_tokens.weight", "lm_head.weight"))
    eagle_config = _config_from_layer(
        layer, "eagle3",
        draft_vocab_size=config.get("draft_vocab_size"),
        target_hidden_size=config.get("target_hidden_size"),
        # speculators' own default when the flag is absent (its configs always write it)
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        feature_layers=config.get("eagle_aux_hidden_state_layer_ids"),
        base_model_name_or_path=base,
    )
    return eagle_config, _with_identity_maps(eagle_config, _without(weights, ("embed_tokens.weight",)))


def to_speculators(
    config: EagleConfig,
    tensors: dict[str, torch.Tensor],
    verifier_name_or_path: str,
    speculative_tokens: int,
    verifier_architectures: Sequence[str],
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The speculators `config.json` and weights of a head with `config` and state dict `tensors`: an "eagle3"
    speculator for EAGLE-3 (its `feature_layers` must be known), speculators 0.4's "eagle" model for EAGLE-1/2."""
    kind = config.version
    values = {
        "architectures": _SPECULATORS_ARCHITECTURES[kind],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": _layer_config(config),
    }
    if kind == "eagle":
        values |= {"transformer_layer_architecture": "LlamaDecoderLayer", "layernorms": False,
                   "fusion_bias": config.fc_bias}
    else:
        values |= {flag: False for flag in _SPECULATORS_UNSUPPORTED["eagle3"]} | {
            "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "norm_before_residual": config.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        }
    ours_to_theirs = {new: old for old, new in _SPECULATORS_PREFIXES[kind].items()}
    return values, _rename(tensors, ours_to_theirs)


def _config_from_layer(layer: dict, version: EagleVersion, **overrides) -> EagleConfig:
    """An EagleConfig from a Llama config dict. transformers reads it (legacy `rope_theta` / `rope_scaling` become
    `rope_parameters`); `EagleConfig.for_target` maps it, given as a target's `.config`. head_dim stays None unless
    the dict gives it; a draft vocabulary as large as the target's is recorded as None."""
    llama = LlamaConfig.from_dict(layer)
    if overrides.get("draft_vocab_size") == llama.vocab_size:
        overrides["draft_vocab_size"] = None
    if version == "eagle3":  # recorded by the checkpoint, or None (see the module docstring)
        overrides.setdefault("feature_layers", None)
    return EagleConfig.for_target(SimpleNamespace(config=llama), version, head_dim=layer.get("head_dim"),
                                  hidden_act=llama.hidden_act, **overrides)


def _with_identity_maps(config: EagleConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Without a draft vocabulary of its own, an EAGLE-3 head's maps are the identity, which checkpoints may omit."""
    if config.draft_vocab_size is not None:
        return weights
    identity = {"d2t": torch.zeros(config.vocab_size, dtype=torch.long),
                "t2d": torch.ones(config.vocab_size, dtype=torch.bool)}
    return identity | weights


def _layer_config(config: EagleConfig) -> dict:
    """speculators' `transformer_layer_config`: the head's decoder layer as a Llama config dict; the RoPE settings
    also as legacy `rope_theta` / `rope_scaling` for readers on transformers 4."""
    llama = config.llama_config()
    rope = dict(config.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    values = {key: getattr(llama, key) for key in _LAYER_KEYS} | {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "rope_parameters": rope,
        "rope_scaling": None if rope["rope_type"] == "default" else scaling,
    }
    if "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    if config.head_dim is not None:
        values["head_dim"] = config.head_dim
    return values


def _without(weights: dict[str, torch.Tensor], dropped: Sequence[str]) -> dict[str, torch.Tensor]:
    return {key: tensor for key, tensor in weights.items() if key not in dropped}


def _rename(weights: dict[str, torch.Tensor], prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    def renamed(key: str) -> str:
        for old, new in prefixes.items():
            if key.startswith(old):
                return new + key[len(old):]
        return key

    return {renamed(key): tensor for key, tensor in weights.items()}
