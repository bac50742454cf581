"""EAGLE head folders: our PEFT-style adapter folder, the published layouts converted on load, and export to the
vllm-project/speculators format (what vLLM and SGLang serve).

Ours: `adapter_config.json` (sorted keys: method "eagle" or "eagle3", the EagleConfig fields, task type, library
version) and `adapter_model.safetensors`, written and read by the helpers every head shares (`heads/files.py`).

Published layouts read (facts from the SafeAILab/EAGLE and vllm-project/speculators repositories):
- SafeAILab EAGLE-1: `config.json` (a Llama config, `num_hidden_layers` 1, optional `bias` for fc, default True)
  and `model.safetensors` or `pytorch_model.bin` (loaded with `torch.load(weights_only=True)`); keys `fc.*`,
  `layers.0.*`;
- SafeAILab EAGLE-3: the same files, config with `draft_vocab_size` (and optional `target_hidden_size`); keys
  `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (identity maps when both are absent and
  the draft vocabulary is the target's);
- speculators: `config.json` with `speculators_model_type` "eagle3" (keys `layers.0.*` for our `midlayer.*`) or
  "eagle" (older EAGLE-1 checkpoints: `fusion_fc.*` for `fc.*`, `transformer.*` for `layers.0.*`), the decoder
  layer's Llama config nested in `transformer_layer_config`.
`embed_tokens.weight` (and a speculators EAGLE-1 `lm_head.weight`) are the target's and are dropped. Anything else
is refused with the keys that were missing or not recognised.

The target layers EAGLE-3 fuses are recorded by our folders and by speculators' `eagle_aux_hidden_state_layer_ids`;
SafeAILab's files do not record them (their code uses 2, L // 2 and L - 3 of the target): such a head keeps
`feature_layers=None` and fuses those layers of whatever target it meets, unless `num_target_layers=` (the target's
`num_hidden_layers`) or explicit `feature_layers=` fix them on load. Heads load in float32.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from hf_specdec.heads.eagle import EagleConfig, EagleHead, EagleVersion, default_feature_layers
from hf_specdec.heads.files import CONFIG_NAME, _read_weights, read_adapter, read_json, write_adapter

# the speculators release whose formats are written: the last one with both the "eagle" and "eagle3" models
SPECULATORS_VERSION = "0.4.0"
SPECULATORS_WEIGHTS_NAME = "model.safetensors"
_CONFIG_FIELDS = tuple(f.name for f in fields(EagleConfig) if f.name != "version")
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


def save_eagle(head: EagleHead, folder: str | Path) -> None:
    values = head.config.to_dict()
    write_adapter(folder, values.pop("version"), values, head.state_dict())


def load_eagle(
    folder: str | Path,
    num_target_layers: int | None = None,
    feature_layers: Sequence[int] | None = None,
) -> EagleHead:
    """Our adapter folder or a published EAGLE checkpoint (converted). `num_target_layers` / `feature_layers`
    (EAGLE-3 only) name the fused target layers where the checkpoint does not; where it does, they must agree."""
    folder = Path(folder)
    if num_target_layers is not None and (isinstance(num_target_layers, bool)
                                          or not isinstance(num_target_layers, int) or num_target_layers < 1):
        raise ValueError(f"load_eagle: num_target_layers: expected an int >= 1, got {num_target_layers!r}")
    layers = (num_target_layers, feature_layers)
    if (folder / CONFIG_NAME).is_file():
        return _load_ours(folder, layers)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{folder}: not an EAGLE head folder (expected {CONFIG_NAME}, a config.json with speculators_model_type "
            "(speculators), or a SafeAILab config.json with model.safetensors / pytorch_model.bin)"
        )
    config = read_json(folder / "config.json")
    weights = _read_weights(folder, "model", pickle_name="pytorch_model.bin")
    if "speculators_model_type" in config:
        return _load_speculators(folder, config, weights, layers)
    return _load_safeailab(folder, config, weights, layers)


def export_speculators(
    head: EagleHead,
    folder: str | Path,
    verifier_name_or_path: str | None = None,
    speculative_tokens: int = 3,
    verifier_architectures: Sequence[str] = (),
) -> None:
    """Write `config.json` and `model.safetensors` in the speculators format. EAGLE-3 heads become an "eagle3"
    speculator, which vLLM serves with its verifier; EAGLE-1/2 heads become speculators' older "eagle" model
    (speculators 0.4), which vLLM's speculators loader does not take. The verifier defaults to the head's base model;
    `speculative_tokens` is the greedy proposal's draft length. Our `revision` has no place in the format."""
    config = head.config
    verifier = verifier_name_or_path or config.base_model_name_or_path
    if not verifier:
        raise ValueError(
            "export_speculators: verifier_name_or_path: expected the target's Hub id or path (vLLM loads it), got "
            "None, and the head records no base_model_name_or_path"
        )
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ValueError(f"export_speculators: speculative_tokens: expected an int >= 1, got {speculative_tokens!r}")
    kind = config.version
    if kind == "eagle3" and config.feature_layers is None:
        raise ValueError(
            "export_speculators: the head does not record which target layers it fuses (the target's default); load "
            "it with num_target_layers=<the target's num_hidden_layers> or feature_layers=(...) before exporting"
        )
    values = {
        "architectures": _SPECULATORS_ARCHITECTURES[kind],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
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
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    ours_to_theirs = {new: old for old, new in _SPECULATORS_PREFIXES[kind].items()}
    tensors = _rename(head.state_dict(), ours_to_theirs)
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()},
              str(folder / SPECULATORS_WEIGHTS_NAME))


def _load_ours(folder: Path, layers: tuple) -> EagleHead:
    version, values, weights = read_adapter(folder, ("eagle", "eagle3"), _CONFIG_FIELDS)
    if version == "eagle3":
        values["feature_layers"] = _feature_layers(folder, values.get("feature_layers"), *layers)
    head = EagleHead(EagleConfig(version=version, **values))
    head.load_state_dict(weights)
    return head.eval()


def _load_safeailab(folder: Path, config: dict, weights: dict[str, torch.Tensor], layers: tuple) -> EagleHead:
    if any(key.startswith("midlayer.") for key in weights):
        eagle_config = _config_from_layer(
            config, "eagle3",
            draft_vocab_size=config.get("draft_vocab_size"),
            target_hidden_size=config.get("target_hidden_size"),
            feature_layers=_feature_layers(folder, None, *layers),
            base_model_name_or_path=config.get("base_model_name_or_path"),
        )
        return _build(folder, "SafeAILab EAGLE-3", eagle_config, weights, dropped=("embed_tokens.weight",))
    if any(key.startswith("layers.0.") for key in weights):
        eagle_config = _config_from_layer(config, "eagle", fc_bias=bool(config.get("bias", True)),
                                          base_model_name_or_path=config.get("base_model_name_or_path"))
        return _build(folder, "SafeAILab EAGLE-1", eagle_config, weights, dropped=("embed_tokens.weight",))
    raise ValueError(
        f"{folder}: unrecognised EAGLE weights: expected 'layers.0.*' (SafeAILab EAGLE-1) or 'midlayer.*' (EAGLE-3) "
        f"keys, or speculators_model_type in config.json; found {sorted(weights)[:6]}"
    )


def _load_speculators(folder: Path, config: dict, weights: dict[str, torch.Tensor], layers: tuple) -> EagleHead:
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
    if kind == "eagle":
        eagle_config = _config_from_layer(layer, "eagle", fc_bias=bool(config.get("fusion_bias", False)),
                                          base_model_name_or_path=base)
    else:
        # speculators' own default when the flag is absent (its configs always write it)
        eagle_config = _config_from_layer(
            layer, "eagle3",
            draft_vocab_size=config.get("draft_vocab_size"),
            target_hidden_size=config.get("target_hidden_size"),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            feature_layers=_feature_layers(folder, config.get("eagle_aux_hidden_state_layer_ids"), *layers),
            base_model_name_or_path=base,
        )
    return _build(folder, f"speculators {kind!r}", eagle_config, _rename(weights, _SPECULATORS_PREFIXES[kind]),
                  dropped=("embed_tokens.weight", "lm_head.weight") if kind == "eagle" else ("embed_tokens.weight",))


def _config_from_layer(layer: dict, version: EagleVersion, **overrides) -> EagleConfig:
    """An EagleConfig from a Llama config dict. transformers reads it (legacy `rope_theta` / `rope_scaling` become
    `rope_parameters`); `EagleConfig.for_target` maps it, given as a target's `.config`. head_dim stays None unless
    the dict gives it; a draft vocabulary as large as the target's is recorded as None."""
    llama = LlamaConfig.from_dict(layer)
    if overrides.get("draft_vocab_size") == llama.vocab_size:
        overrides["draft_vocab_size"] = None
    return EagleConfig.for_target(SimpleNamespace(config=llama), version, head_dim=layer.get("head_dim"),
                                  hidden_act=llama.hidden_act, **overrides)


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


def _feature_layers(
    folder: Path,
    recorded: Sequence[int] | None,
    num_target_layers: int | None,
    feature_layers: Sequence[int] | None,
) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head fuses: as recorded, else as the caller says (both must agree), else None
    (the target's default layers)."""
    given = tuple(feature_layers) if feature_layers is not None else (
        default_feature_layers(num_target_layers) if num_target_layers is not None else None)
    if recorded is None:
        return given  # None: the target's default layers, resolved when the head meets it
    recorded = tuple(recorded)
    if given is not None and given != recorded:
        raise ValueError(f"{folder}: feature_layers: the checkpoint fuses target layers {recorded}, not {given}")
    return recorded


def _rename(weights: dict[str, torch.Tensor], prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    def renamed(key: str) -> str:
        for old, new in prefixes.items():
            if key.startswith(old):
                return new + key[len(old):]
        return key

    return {renamed(key): tensor for key, tensor in weights.items()}


def _build(
    folder: Path, layout: str, config: EagleConfig, weights: dict[str, torch.Tensor], dropped: Sequence[str]
) -> EagleHead:
    """The head for `config` with `weights` (our names), every parameter present and nothing unrecognised."""
    head = EagleHead(config)
    expected = set(head.state_dict())
    weights = {key: tensor for key, tensor in weights.items() if key not in dropped}
    # without a draft vocabulary the maps are the identity the head starts with
    optional = {"d2t", "t2d"} if config.draft_vocab_size is None else set()
    missing, unrecognised = sorted(expected - set(weights) - optional), sorted(set(weights) - expected)
    if missing or unrecognised:
        raise ValueError(f"{folder}: {layout} weights: missing {missing}, not recognised {unrecognised}")
    try:
        head.load_state_dict(weights, strict=False)
    except RuntimeError as error:
        raise ValueError(f"{folder}: {layout} weights do not match its config.json: {error}") from error
    return head.eval()
