"""Published Medusa checkpoints, converted to our parameter names and config on load (facts from the Medusa, TGI
and vLLM repositories):

- FasterDecoding Medusa v0.1/1.0: `config.json` with `medusa_num_heads` / `medusa_num_layers`, weights
  `medusa_lm_head.safetensors` (or `.pt`, loaded with `torch.load(weights_only=True)`), keys
  `{h}.{l}.linear.weight|bias` and `{h}.{num_layers}.weight`;
- the "version 2" layout (legacy Medusa PR #97, TGI's MedusaHeadV2): the same files, keys `{h}.0.linear.weight|bias`
  only, one block per head; the target's lm_head projects every head (`shared_lm_head=True`);
- vLLM's converted layout: `config.json` with `model_type: "medusa"`, weights `blocks.{h}.layers.{l}.weight|bias`
  and `lm_heads.{h}.weight` (the `medusa_heads.` prefix stripped; a missing bias is zero).
Anything else is refused with the keys that were expected. The conversions are pure functions of the config dict and
the tensors; `read_published` reads the files.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from hf_specdec.heads.adapter import CONFIG_NAME, HeadFiles, read_json, read_weights
from hf_specdec.heads.medusa.config import MedusaConfig


def read_published(folder: Path) -> HeadFiles:
    """A FasterDecoding or vLLM Medusa folder, converted."""
    if (folder / "config.json").is_file():
        config = read_json(folder / "config.json")
        if "medusa_num_heads" in config:
            converted = from_faster_decoding(folder, config, read_weights(folder, "medusa_lm_head"))
            return HeadFiles(folder, "FasterDecoding Medusa", "config.json", *converted)
        if config.get("model_type") == "medusa":
            converted = from_vllm(folder, config, read_weights(folder, "model"))
            return HeadFiles(folder, "vLLM Medusa", "config.json", *converted)
    raise ValueError(
        f"{folder}: not a Medusa head folder (expected {CONFIG_NAME}, or a config.json with medusa_num_heads "
        "(FasterDecoding) or model_type 'medusa' (vLLM))"
    )


def from_faster_decoding(
    folder: Path, config: dict, weights: dict[str, torch.Tensor]
) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """FasterDecoding's config.json and medusa_lm_head weights (v0.1/1.0, or 'version 2' with a shared lm_head)."""
    num_layers = int(config.get("medusa_num_layers", 1))
    # the original loader loads fewer heads than configured when the file holds fewer
    num_heads = min(int(config["medusa_num_heads"]), len({k.split(".")[0] for k in weights}))
    blocks = {f"{h}.{layer}.linear.{part}" for h in range(num_heads) for layer in range(num_layers)
              for part in ("weight", "bias")}
    projections = {f"{h}.{num_layers}.weight" for h in range(num_heads)}
    shared = set(weights) == blocks
    if not shared and not blocks | projections <= set(weights):
        raise ValueError(
            f"{folder}: unrecognised Medusa weights: expected keys '{{h}}.{{l}}.linear.weight|bias' for "
            f"{num_heads} heads x {num_layers} layers, plus '{{h}}.{num_layers}.weight' (v0.1/1.0) or nothing more "
            f"('version 2'); missing {sorted(blocks | projections - set(weights))[:4]}"
        )
    if shared and num_layers != 1:
        raise ValueError(f"{folder}: Medusa 'version 2' layout: expected medusa_num_layers 1, got {num_layers}")
    hidden = weights["0.0.linear.weight"].shape[1]
    vocab = None if shared else weights[f"0.{num_layers}.weight"].shape[0]
    medusa_config = MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers,
                                 shared_lm_head=shared, base_model_name_or_path=config.get("base_model_name_or_path"))
    return medusa_config, {f"heads.{key}": weights[key] for key in blocks | (set() if shared else projections)}


def from_vllm(
    folder: Path, config: dict, weights: dict[str, torch.Tensor]
) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """vLLM's converted Medusa config.json and model weights."""
    weights = {re.sub(r"^medusa_heads\.", "", k): v for k, v in weights.items()}
    num_heads = int(config.get("num_heads", config.get("medusa_num_heads", 0)))
    num_layers = int(config.get("num_hidden_layers", config.get("medusa_num_layers", 1)))
    if "lm_heads.0.weight" not in weights or num_heads < 1:
        raise ValueError(f"{folder}: vLLM Medusa layout without lm_heads.0.weight or num_heads; cannot convert")
    vocab, hidden = weights["lm_heads.0.weight"].shape
    names = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            names[f"blocks.{h}.layers.{layer}.weight"] = f"heads.{h}.{layer}.linear.weight"
            names[f"blocks.{h}.layers.{layer}.bias"] = f"heads.{h}.{layer}.linear.bias"
        names[f"lm_heads.{h}.weight"] = f"heads.{h}.{num_layers}.weight"
    # unrecognised keys keep their name, so building the head names them
    tensors = {names.get(key, key): tensor for key, tensor in weights.items()}
    for h in range(num_heads):
        for layer in range(num_layers):
            tensors.setdefault(f"heads.{h}.{layer}.linear.bias", torch.zeros(hidden))
    return MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers), tensors
