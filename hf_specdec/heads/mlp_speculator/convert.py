"""IBM fms-extras' published MLP speculator layout (the `ibm-ai-platform/*-accelerator` and Granite speculators that
vLLM serves with `method="mlp_speculator"`), converted on load and written back. Facts from the fms-extras and vLLM
repositories:

- `config.json`: `model_type` "mlp_speculator", `vocab_size`, `emb_dim` (the target's hidden size; `hidden_size` is
  its alias), `inner_dim` (0: emb_dim), `n_predict`, `top_k_tokens_per_head`, `n_candidates`, `tie_weights`,
  `scale_input` (defaults when absent: inner_dim 0, top_k [5, 4, 3], n_candidates 5, both flags false);
- `model.safetensors` (or `pytorch_model.bin`, loaded with `torch.load(weights_only=True)`): `emb.{i}.weight`,
  `proj.{i}.weight`, `head.{i}.weight`, `ln.{i}.weight` and `ln.{i}.bias`, each optionally prefixed `speculator.`
  (fms-extras' Hugging Face wrapper writes the prefix; vLLM strips it). `scale_input`'s input norm has no weights.
- Tied speculators (`tie_weights`) share emb, ln and head across stages and proj across stages after the first;
  their files hold the shared tensors once (stage 0's, and proj.1) or once per stage. Copies are accepted when
  equal to the shared tensor and refused otherwise.
Anything else is refused: a file of another model type, a config the speculator cannot be built from, weights that
are missing, not recognised, or shaped unlike the config (named by `AdapterMixin.from_files`). The conversions are
pure functions of the config dict and the tensors; `read_published` reads the files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_specdec.heads.adapter import CONFIG_NAME, HeadFiles, read_json, read_weights
from hf_specdec.heads.mlp_speculator.config import MlpSpeculatorConfig

MODEL_TYPE = "mlp_speculator"
PUBLISHED_WEIGHTS_NAME = "model.safetensors"
PREFIX = "speculator."
ARCHITECTURES = ["MLPSpeculatorPreTrainedModel"]
_REQUIRED_KEYS = ("vocab_size", "emb_dim", "n_predict")
# the other published keys, with the value fms-extras' config class gives an absent one (None: 5, 4, 3, ... per stage)
_OPTIONAL_KEYS = {"inner_dim": 0, "top_k_tokens_per_head": None, "n_candidates": 5, "tie_weights": False,
                  "scale_input": False}
_LAYOUT = "fms-extras MLP speculator"


def read_published(folder: Path) -> HeadFiles:
    """An fms-extras MLP speculator folder, converted."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: not an MLP speculator folder (expected {CONFIG_NAME}, or fms-extras' config.json "
                         f"with model_type {MODEL_TYPE!r} and {PUBLISHED_WEIGHTS_NAME})")
    config = read_json(folder / "config.json")
    weights = read_weights(folder, "model", pickle_name="pytorch_model.bin")
    return HeadFiles(folder, _LAYOUT, "config.json", *from_fms_extras(folder, config, weights))


def from_fms_extras(
    folder: Path, config: dict, weights: dict[str, torch.Tensor]
) -> tuple[MlpSpeculatorConfig, dict[str, torch.Tensor]]:
    """fms-extras' config.json values and weights, as our config and parameter names."""
    where = folder / "config.json"
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{where}: model_type {config.get('model_type')!r} is not {MODEL_TYPE!r}; not an MLP "
                         "speculator")
    values = dict(config)
    if "emb_dim" not in values and "hidden_size" in values:
        values["emb_dim"] = values["hidden_size"]
    missing = [key for key in _REQUIRED_KEYS if key not in values]
    if missing:
        raise ValueError(f"{where}: missing {missing}; an fms-extras MLP speculator config holds "
                         f"{[*_REQUIRED_KEYS, *_OPTIONAL_KEYS]}")
    fields = {key: values[key] for key in _REQUIRED_KEYS} | {
        key: values.get(key, default) for key, default in _OPTIONAL_KEYS.items()}
    try:
        speculator = MlpSpeculatorConfig(**fields, base_model_name_or_path=config.get("base_model_name_or_path"))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error
    tensors = {key.removeprefix(PREFIX): tensor for key, tensor in weights.items()}
    if speculator.tie_weights:
        tensors = _shared(folder, tensors, speculator.n_predict)
    return speculator, tensors


def to_fms_extras(
    config: MlpSpeculatorConfig, tensors: dict[str, torch.Tensor]
) -> tuple[dict, dict[str, torch.Tensor]]:
    """fms-extras' config.json values and weights (prefixed `speculator.`) of a speculator with `config` and state
    dict `tensors` (a tied one holds each shared tensor once)."""
    values = {"architectures": ARCHITECTURES, "model_type": MODEL_TYPE} | {
        key: getattr(config, key) for key in (*_REQUIRED_KEYS, *_OPTIONAL_KEYS)}
    if config.base_model_name_or_path:
        values["base_model_name_or_path"] = config.base_model_name_or_path
    return values, {PREFIX + key: tensor for key, tensor in tensors.items()}


def _shared(folder: Path, tensors: dict[str, torch.Tensor], n_predict: int) -> dict[str, torch.Tensor]:
    """A tied speculator's tensors with each per-stage copy folded into the shared one it must equal (emb, ln, head:
    stage 0's; proj: proj.1 for every stage after the first)."""
    kept = dict(tensors)
    for stage in range(1, n_predict):
        for name in ("emb.{}.weight", "ln.{}.weight", "ln.{}.bias", "head.{}.weight", "proj.{}.weight"):
            if name.startswith("proj") and stage == 1:
                continue
            copy, shared = name.format(stage), name.format(1 if name.startswith("proj") else 0)
            if copy not in kept:
                continue
            tensor = kept.pop(copy)
            if shared not in kept:
                kept[shared] = tensor
            elif not torch.equal(kept[shared], tensor):
                raise ValueError(f"{folder}: {_LAYOUT} weights: tie_weights is true, but {copy} differs from "
                                 f"{shared}, the tensor it shares")
    return kept
