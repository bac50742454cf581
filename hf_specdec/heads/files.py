"""Head folders on disk: our PEFT-style adapter folder, and the published Medusa layouts converted on load.

Ours: `adapter_config.json` (sorted keys: method, base_model_name_or_path, revision, task_type, head config,
library version) and `adapter_model.safetensors`. Unknown config keys are warned about and ignored.

Published layouts read (facts from the Medusa, TGI and vLLM repositories):
- FasterDecoding Medusa v0.1/1.0: `config.json` with `medusa_num_heads` / `medusa_num_layers`, weights
  `medusa_lm_head.safetensors` (or `.pt`, loaded with `torch.load(weights_only=True)`), keys
  `{h}.{l}.linear.weight|bias` and `{h}.{num_layers}.weight`;
- the "version 2" layout (legacy Medusa PR #97, TGI's MedusaHeadV2): the same files, keys `{h}.0.linear.weight|bias`
  only, one block per head; the target's lm_head projects every head (loaded with `shared_lm_head=True`);
- vLLM's converted layout: `config.json` with `model_type: "medusa"`, weights `blocks.{h}.layers.{l}.weight|bias`
  and `lm_heads.{h}.weight` (the `medusa_heads.` prefix stripped).
Anything else is refused with the keys that were expected.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import hf_specdec
from hf_specdec.heads.medusa import MedusaConfig, MedusaHeads

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LORA_FOLDER = "lora"  # Medusa-2: the peft LoRA adapter of the target, beside the heads
METHOD = "medusa"
TASK_TYPE = "CAUSAL_LM"
_CONFIG_FIELDS = tuple(f.name for f in fields(MedusaConfig))


def save_medusa(heads: MedusaHeads, folder: str | Path) -> None:
    write_adapter(folder, METHOD, heads.config.to_dict(), heads.state_dict())


def write_adapter(folder: str | Path, method: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Our adapter folder, for any head: the config plus method, task type and library version (sorted keys), and
    the tensors as safetensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = config | {"method": method, "task_type": TASK_TYPE, "library_version": hf_specdec.__version__}
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(folder / WEIGHTS_NAME))


def load_medusa(folder: str | Path) -> MedusaHeads:
    folder = Path(folder)
    if (folder / CONFIG_NAME).is_file():
        return _load_ours(folder)
    if (folder / "config.json").is_file():
        config = read_json(folder / "config.json")
        if "medusa_num_heads" in config:
            return _load_faster_decoding(folder, config)
        if config.get("model_type") == "medusa":
            return _load_vllm(folder, config)
    raise ValueError(
        f"{folder}: not a Medusa head folder (expected {CONFIG_NAME}, or a config.json with medusa_num_heads "
        "(FasterDecoding) or model_type 'medusa' (vLLM))"
    )


def _load_ours(folder: Path) -> MedusaHeads:
    _, values, weights = read_adapter(folder, (METHOD,), _CONFIG_FIELDS)
    heads = MedusaHeads(MedusaConfig(**values))
    heads.load_state_dict(weights)
    return heads.eval()


def read_adapter(
    folder: Path, methods: tuple[str, ...], config_fields: tuple[str, ...]
) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """Our adapter folder: its method, the values of `config_fields` it holds, and its tensors. Unknown config
    keys are warned about and ignored."""
    raw = read_json(folder / CONFIG_NAME)
    if raw.get("method") not in methods:
        expected = " or ".join(repr(m) for m in methods)
        raise ValueError(f"{folder / CONFIG_NAME}: method {raw.get('method')!r} is not {expected}")
    unknown = sorted(set(raw) - set(config_fields) - {"method", "task_type", "library_version"})
    if unknown:
        warnings.warn(f"{folder / CONFIG_NAME}: ignoring unknown keys {unknown}", stacklevel=4)
    return raw["method"], {k: raw[k] for k in config_fields if k in raw}, read_safetensors(folder / WEIGHTS_NAME)


def read_json(path: Path) -> dict:
    """A JSON object from `path`; a damaged file is named in the error."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error}); the file is damaged: save or download it again") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a missing, truncated or damaged file is named in the error."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file (the folder is incomplete: save or download it again)")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot be read as safetensors ({error}); the file is damaged or incomplete: "
                         "save or download it again") from error


def _read_weights(folder: Path, stem: str, pickle_name: str | None = None) -> dict[str, torch.Tensor]:
    """`{stem}.safetensors`, else the pickle `pickle_name` (default `{stem}.pt`), loaded with weights_only=True."""
    pickled = pickle_name or f"{stem}.pt"
    if (folder / f"{stem}.safetensors").is_file():
        return read_safetensors(folder / f"{stem}.safetensors")
    if (folder / pickled).is_file():
        try:
            return torch.load(folder / pickled, map_location="cpu", weights_only=True)
        except Exception as error:  # a truncated zip, a pickle with objects weights_only refuses, ...
            raise ValueError(f"{folder / pickled}: cannot be read as a weights file ({error}); it may be damaged or "
                             "incomplete: download or save it again") from error
    raise ValueError(f"{folder}: no {stem}.safetensors or {pickled}")


def _load_faster_decoding(folder: Path, config: dict) -> MedusaHeads:
    weights = _read_weights(folder, "medusa_lm_head")
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
    heads = MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers,
                                     shared_lm_head=shared,
                                     base_model_name_or_path=config.get("base_model_name_or_path")))
    heads.load_state_dict({f"heads.{key}": weights[key] for key in blocks | (set() if shared else projections)})
    return heads.eval()


def _load_vllm(folder: Path, config: dict) -> MedusaHeads:
    weights = {re.sub(r"^medusa_heads\.", "", k): v for k, v in _read_weights(folder, "model").items()}
    num_heads = int(config.get("num_heads", config.get("medusa_num_heads", 0)))
    num_layers = int(config.get("num_hidden_layers", config.get("medusa_num_layers", 1)))
    if "lm_heads.0.weight" not in weights or num_heads < 1:
        raise ValueError(f"{folder}: vLLM Medusa layout without lm_heads.0.weight or num_heads; cannot convert")
    vocab, hidden = weights["lm_heads.0.weight"].shape
    heads = MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers))
    mapped = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            mapped[f"heads.{h}.{layer}.linear.weight"] = weights[f"blocks.{h}.layers.{layer}.weight"]
            bias = weights.get(f"blocks.{h}.layers.{layer}.bias")
            mapped[f"heads.{h}.{layer}.linear.bias"] = torch.zeros(hidden) if bias is None else bias
        mapped[f"heads.{h}.{num_layers}.weight"] = weights[f"lm_heads.{h}.weight"]
    heads.load_state_dict(mapped)
    return heads.eval()


def load_medusa2(folder: str | Path, base_model: torch.nn.Module) -> tuple[torch.nn.Module, MedusaHeads]:
    """A Medusa-2 folder (heads + `lora/`, as `hf-specdec train medusa --stage 2` writes it) on `base_model`: the
    LoRA is applied through peft and merged, so `generate` runs on a plain transformers model; returns
    (merged model, heads). `base_model` is changed in place (merging writes into its weights)."""
    from peft import PeftModel

    folder = Path(folder)
    if not (folder / LORA_FOLDER / CONFIG_NAME).is_file():
        raise ValueError(f"load_medusa2: folder: no LoRA adapter at {folder / LORA_FOLDER} (expected {CONFIG_NAME}); "
                         "for Medusa-1 heads use MedusaHeads.from_pretrained")
    heads = load_medusa(folder)
    model = PeftModel.from_pretrained(base_model, folder / LORA_FOLDER).merge_and_unload()
    heads.check_target(model)
    return model.eval(), heads
