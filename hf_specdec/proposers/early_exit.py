"""Early-exit self-speculation (`method="early_exit"`, LayerSkip; transformers' `assistant_early_exit=`): the target
drafts for itself with its first N layers, then its final norm and lm_head, and the full model verifies.

`early_exit_draft(target, N)` is that truncated model: a causal LM of the target's own class and config (with N
layers) whose modules are the target's (embeddings, the first N decoder layers, the final norm, the lm_head): the
same objects, so no weight is copied and nothing is trained. It is built once per (target, N) on the meta device and
filled with the target's modules. `EarlyExitProposer` drives it exactly as the draft-model proposer drives a draft
(chains, branches, EAGLE-2 dynamic trees, batched on its own ragged KV cache).

What is shared beyond the weights: the prompt. The draft's cache starts from the target's: the target has just
encoded the prompt, and its first N layers' keys and values over it are exactly what the draft's own prefill would
compute (the same modules on the same inputs), so they are copied and the draft's prefill computes nothing.

What is not shared: the drafted tokens. The verify forward computes the first N layers' keys and values of the
tokens the draft fed once more (LayerSkip reuses them), so each step pays N / L of a target forward over those
tokens twice. Reusing them would mean running the target's layers one range at a time, outside its own forward,
which transformers' models do not offer in one way across architectures; when verifying a few tokens costs about
what one costs (a GPU, or bf16 on a CPU with matrix instructions), it would save little.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from hf_specdec.cache.attention import takes_no_custom_mask
from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.proposers.draft_model import DraftModelProposer
from hf_specdec.step import DecodeState

_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def num_layers(target: nn.Module) -> int:
    return int(target.config.get_text_config(decoder=True).num_hidden_layers)


def decoder_layers_path(model: nn.Module) -> str:
    """The name of the model's decoder-layer list: the one ModuleList as long as its config's layer count."""
    count = num_layers(model)
    found = [name for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) == count and name]
    if len(found) != 1:
        raise ValueError(f"SpeculativeConfig.early_exit_layer: cannot tell the decoder layers of "
                         f"{type(model).__name__} (module lists of {count} layers: {found or 'none'}); early exit "
                         "needs one list of decoder layers")
    return found[0]


def check_exit_layer(target: nn.Module, layer: int) -> None:
    count = num_layers(target)
    if not 1 <= layer < count:
        raise ValueError(f"SpeculativeConfig.early_exit_layer: expected a layer from 1 to {count - 1} (the target has "
                         f"{count} layers; the draft is its first early_exit_layer of them), got {layer}")


def early_exit_draft(target: PreTrainedModel, layer: int) -> PreTrainedModel:
    """The target's first `layer` decoder layers, final norm and lm_head as a causal LM sharing the target's modules
    (built once per target and layer)."""
    check_exit_layer(target, layer)
    per_target = _VIEWS.setdefault(target, {})
    if layer not in per_target:
        per_target[layer] = _build_view(target, layer)
    return per_target[layer]


def _build_view(target: PreTrainedModel, layer: int) -> PreTrainedModel:
    layers_path = decoder_layers_path(target)
    config = copy.deepcopy(target.config)
    text = config.get_text_config(decoder=True)
    if getattr(text, "hidden_size_per_layer_input", 0):
        raise ValueError(
            f"SpeculativeConfig.early_exit_layer: {type(target).__name__} feeds every layer an input embedding of its "
            "own, one table for all its layers (Gemma-3n's per-layer inputs), which a model of fewer layers cannot "
            "read; use another method with it (method 'ngram', 'draft', 'eagle', ...)"
        )
    text.num_hidden_layers = layer
    if getattr(text, "layer_types", None) is not None:
        try:
            text.layer_types = list(text.layer_types[:layer])
        except AttributeError:  # computed from other fields and the layer count (Bamba's, from its attention indices)
            pass
    attention = target.config._attn_implementation
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(
            f"SpeculativeConfig.early_exit_layer: {type(target).__name__} (a {type(config).__name__}) has no causal-LM "
            "class of its config in transformers (a multimodal model whose language model is a part of it), and the "
            "early-exit draft is one, with fewer layers; use another method with it (method 'ngram', 'draft', "
            "'eagle', ...)"
        )
    try:
        with torch.device("meta"):  # the view runs in the engine alone, where flash and flex attention run as SDPA
            view = AutoModelForCausalLM.from_config(
                config, attn_implementation=("sdpa" if target._supports_sdpa else "eager")
                if takes_no_custom_mask(attention) else attention)
    except ValueError as error:  # a config that cannot be cut after `layer` layers (layers that share keys, ...)
        raise ValueError(
            f"SpeculativeConfig.early_exit_layer: {type(target).__name__}'s config does not describe a model of its "
            f"first {layer} layers ({error}); use another method with it (method 'ngram', 'draft', 'eagle', ...)"
        ) from error
    # the view's own containers down to the layer list (they hold the shortened config); every other module is the
    # target's, the same object
    containers = {""} | {".".join(layers_path.split(".")[:i]) for i in range(1, layers_path.count(".") + 2)}
    _share_modules(view, target, "", containers)
    left = [name for name, tensor in [*view.named_parameters(), *view.named_buffers()] if tensor.is_meta]
    if left:
        raise ValueError(f"SpeculativeConfig.early_exit_layer: {type(target).__name__} has tensors outside the modules "
                         f"the early-exit draft shares ({left[:4]}); early exit does not support this model")
    view.generation_config = copy.deepcopy(target.generation_config)
    return view.eval()


def _share_modules(mine: nn.Module, theirs: nn.Module, prefix: str, containers: set[str]) -> None:
    """Replace every child of `mine` outside `containers` by `theirs`' module of the same name (a child of a module
    list by index), whatever its class (a quantized or adapted layer in place of the config's: the view's forward
    calls it as the target's own does), and give the containers `theirs`' own parameters and buffers."""
    for name, child in list(mine.named_children()):
        path = f"{prefix}{name}"
        source = theirs._modules.get(name)
        if source is None:
            raise ValueError(f"SpeculativeConfig.early_exit_layer: {type(theirs).__name__} has no module {path!r}, "
                             "which a model of its config has; early exit does not support this model")
        if path in containers:
            _share_modules(child, source, f"{path}.", containers)
        else:
            mine._modules[name] = source
    for name in mine._parameters:
        mine._parameters[name] = theirs._parameters[name]
    for name in mine._buffers:
        mine._buffers[name] = theirs._buffers[name]


class EarlyExitProposer(DraftModelProposer):
    role = "the early-exit draft"

    def carry(self, state: DecodeState) -> tuple:
        return ()  # its prefill copies the target's own keys and values: nothing to save

    def _drafter(self, config: SpeculativeConfig, target: nn.Module) -> nn.Module:
        return early_exit_draft(target, config.early_exit_layer)

    def _prefill(
        self,
        state: DecodeState,
        # [B, P - 1] or None
        attention_mask: torch.Tensor | None,
    ) -> None:
        """The draft's layers are the target's first ones: the prompt's keys and values in them are copied from the
        target's cache, which has just encoded the prompt, instead of computed again."""
        if state.target_cache is None:
            super()._prefill(state, attention_mask)
        else:
            self.cache.prefill_shared(state.target_cache, state.prompt_length - 1, attention_mask)


def _build(config: SpeculativeConfig, target: nn.Module, sampling: DraftSampling) -> Proposer:
    return EarlyExitProposer(config, target, sampling)


register_proposer("early_exit", _build)
