"""A draft model cut from its target: a few of the target's decoder layers (fine-tuned to imitate the whole model,
`hf-specdec train draft`), sharing the target's token embeddings and lm_head.

Such a draft costs a few layers plus the lm_head per drafted token, and, unlike a separately trained small model, it
starts from weights that already model the target's language. Its folder holds only what is its own, so it stays
small even where the vocabulary makes the embeddings the model's largest tensor:

* `config.json`: the draft's transformers config (the target's, with `num_hidden_layers` = the layers kept), plus
  `pruned_draft`: the target layers the draft's layers came from, the tensors shared with the target, and the
  target's hidden size and vocabulary size (checked on load);
* `model.safetensors`: every other tensor (decoder layers, final norm), and, for a draft with a token map, the map
  (`token_map`: target ids, ascending; `pruned_draft.token_map_size` in the config).

A draft with a token map (`hf-specdec train draft --token-map-size N`) drafts over those ids only: on load its lm_head
is the target's rows at the map (`TokenMapLMHead`: full-vocabulary logits, -inf elsewhere), which costs D / V of the
whole projection; the target still verifies over its whole vocabulary, so output is unchanged.

`load_pruned_draft(folder, target)` rebuilds the draft as an ordinary transformers causal LM in the target's dtype
and on its device, with the target's embedding and lm_head modules (shared, not copied), ready for
`SpeculativeConfig(method="draft", draft_model=...)`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from hf_specdec.heads.token_map import TokenMapLMHead, check_token_map

CONFIG_KEY = "pruned_draft"
WEIGHTS_FILE = "model.safetensors"
SHARED = ("model.embed_tokens.weight", "lm_head.weight")
TOKEN_MAP_KEY = "token_map"


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"target: {type(model).__name__} has no `model.layers` decoder stack; a pruned draft is cut "
                         "from decoder-only models laid out as Llama's (model.embed_tokens, model.layers, model.norm, "
                         "lm_head)")
    return layers


def check_target_layers(count: int, target_layers) -> tuple[int, ...]:
    """The layer indices (negative ones resolved) of a draft cut from a target of `count` layers."""
    resolved = tuple(int(i) % count if -count <= int(i) < count else int(i) for i in target_layers)
    if not resolved or any(not 0 <= i < count for i in resolved) or sorted(set(resolved)) != list(resolved):
        raise ValueError(f"target_layers: expected distinct increasing layer indices of the target's {count} layers "
                         f"(negative ones count from the end), got {list(target_layers)}")
    return resolved


def _draft_config(target: PreTrainedModel, target_layers: tuple[int, ...]):
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(target_layers)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in target_layers]
    return config


def _share(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    # [D] target ids, ascending, or None: the whole vocabulary
    token_map: torch.Tensor | None = None,
) -> None:
    draft.set_input_embeddings(target.get_input_embeddings())
    lm_head = target.get_output_embeddings()
    if token_map is not None:
        lm_head = TokenMapLMHead(lm_head, token_map, lm_head.weight.shape[0])
    draft.lm_head = lm_head


def pruned_copy(target: PreTrainedModel, target_layers) -> PreTrainedModel:
    """A draft of the target's layers `target_layers` (copies, float32, trainable) with its final norm (a copy) and
    its embeddings and lm_head (shared: the same modules)."""
    target_layers = check_target_layers(len(_decoder_layers(target)), target_layers)
    draft = AutoModelForCausalLM.from_config(_draft_config(target, target_layers), dtype=torch.float32)
    source = _decoder_layers(target)
    with torch.no_grad():
        for mine, index in zip(_decoder_layers(draft), target_layers):
            mine.load_state_dict(source[index].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    _share(draft, target)
    draft.config.pruned_draft = {"target_layers": list(target_layers)}
    return draft.to(target.device)


def save_pruned_draft(
    draft: PreTrainedModel,
    folder: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    # [D] target ids the draft drafts over (default: the map of a draft loaded with one, else none)
    token_map: torch.Tensor | None = None,
) -> None:
    """Write the draft's own tensors (in `dtype`), its token map if any, and its config; the shared ones are left to
    the target."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = draft.config.get_text_config(decoder=True)
    if token_map is None and isinstance(draft.lm_head, TokenMapLMHead):
        token_map = draft.lm_head.ids
    own = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in draft.state_dict().items()
           if name not in SHARED and not name.startswith("lm_head.")}
    record = {"hidden_size": text.hidden_size, "shared": list(SHARED),
              "target_layers": list(draft.config.pruned_draft["target_layers"]), "vocab_size": text.vocab_size}
    if token_map is not None:
        own[TOKEN_MAP_KEY] = check_token_map(token_map, text.vocab_size, "save_pruned_draft: token_map")
        record["token_map_size"] = len(own[TOKEN_MAP_KEY])
    save_file(own, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = draft.config.to_dict()
    config[CONFIG_KEY] = record
    config.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_pruned_draft(folder: str | Path, target: PreTrainedModel) -> PreTrainedModel:
    """The draft in `folder`, in the target's dtype and on its device, sharing the target's embeddings and lm_head (its
    rows at the draft's token map, for a draft saved with one)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"load_pruned_draft: no such folder {str(folder)!r}")
    try:
        record = json.loads((folder / "config.json").read_text())[CONFIG_KEY]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"load_pruned_draft: {folder / 'config.json'} is missing, damaged or not a pruned draft's "
                         f"config (no {CONFIG_KEY!r} entry): {error!r}") from error
    text = target.config.get_text_config(decoder=True)
    if (record["hidden_size"], record["vocab_size"]) != (text.hidden_size, text.vocab_size):
        raise ValueError(f"load_pruned_draft: the draft in {folder} was cut from a model with hidden size "
                         f"{record['hidden_size']} and vocabulary {record['vocab_size']}, but the target has "
                         f"{text.hidden_size} and {text.vocab_size}: it was trained for another model")
    config = AutoConfig.from_pretrained(folder)
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    try:
        weights = load_file(str(folder / WEIGHTS_FILE))
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise ValueError(f"load_pruned_draft: {folder / WEIGHTS_FILE} is missing or damaged: {error}") from error
    token_map = weights.pop(TOKEN_MAP_KEY, None)
    if token_map is not None:
        token_map = check_token_map(token_map, text.vocab_size, f"load_pruned_draft: {folder / WEIGHTS_FILE}: "
                                                                 f"{TOKEN_MAP_KEY}")
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - set(SHARED):
        raise ValueError(f"load_pruned_draft: {folder / WEIGHTS_FILE} does not fit its config: missing "
                         f"{sorted(set(missing) - set(SHARED))}, unexpected {sorted(unexpected)}")
    _share(draft, target, token_map)
    return draft.to(device=target.device, dtype=target.dtype).eval()
