"""MTP proposer: the target's own multi-token-prediction layers draft (DeepSeek-V3, GLM-4.5, Mellum, ...).

Models whose checkpoints ship MTP layers (transformers: `config.num_mtp_layers`, the checkpoint's
`num_nextn_predict_layers`) carry, after their decoder, a few extra layers. Layer i takes a token's embedding and a
hidden state (the target's final one for layer 0, layer i - 1's output after it), normalises both, projects their
concatenation (`eh_proj`), runs one decoder layer of the target's own kind, and reads the next token through the
target's lm_head. transformers builds them as `transformers.modeling_layers.MtpModel`, which this proposer drives
inside hf_specdec's loop, batched, with chains and trees, like an EAGLE head (`proposers/eagle.py`):

* committed tokens are fed with the target's final hidden state at the position before each of them, taken from
  the verify forward (no extra target pass), through every MTP layer, so each layer keeps a KV history of the
  whole text; the first draft token comes from layer 0;
* the token drafted at depth d is fed with the output of the layer that drafted it, and the next token is read
  from layer d mod n (n MTP layers): the layers in order, then again from layer 0 when k exceeds n (as vLLM reuses
  them). Every layer is run at every fed token (n small forwards), so no layer's history has a hole;
* after verification only the committed tokens' KV is kept; the accepted ones are fed again next step with the
  target's true hidden states.

Verification decides every token, so output is exact whatever the MTP layers propose.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.proposers.draft_model import select_positions
from hf_specdec.proposers.eagle import EagleProposer

OTHER_METHODS = ("use method='draft' with a small model that shares its tokenizer, method='eagle' with an EAGLE "
                 "head trained for it, or method='ngram'")


def num_mtp_layers(model: nn.Module) -> int:
    """The MTP layers a model's config declares (0 when none)."""
    return int(getattr(model.config.get_text_config(decoder=True), "num_mtp_layers", None) or 0)


def check_has_mtp_layers(model: nn.Module) -> None:
    """Raise ValueError (naming the model and what to use instead) unless the model declares MTP layers."""
    if num_mtp_layers(model) == 0:
        raise ValueError(
            f"method='mtp': {type(model).__name__} has no multi-token-prediction layers (its config sets no "
            f"num_mtp_layers / num_nextn_predict_layers); {OTHER_METHODS}"
        )


def load_mtp_layers(model: nn.Module) -> nn.Module:
    """The model's MTP layers as transformers loads them for `generate(use_mtp=True)`: `MtpModel.from_pretrained`
    reads them from the checkpoint folder or Hub id the model was loaded from, on the device of its last layer."""
    from transformers.modeling_layers import MtpModel

    check_has_mtp_layers(model)
    name = type(model).__name__
    source = model.config.name_or_path
    if not source:
        raise ValueError(
            f"method='mtp': {name} was not loaded with from_pretrained, so there is no checkpoint to read its MTP "
            "layers from; load it with from_pretrained, or pass the layers as "
            "SpeculativeConfig(method='mtp', heads=transformers.modeling_layers.MtpModel(model, n))"
        )
    device = next(model.get_decoder().layers[-1].parameters()).device
    try:
        return MtpModel.from_pretrained(model, device_map={"": device}).eval()
    except (OSError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"method='mtp': could not load the MTP layers of {name} from {source!r} ({error}); {OTHER_METHODS}"
        ) from error


class MtpDrafter(nn.Module):
    """A transformers `MtpModel` called like a causal LM so a `RaggedKVCache` can drive it: `features` (the hidden
    state before each token), whether they are the target's, and the draft depth come as extra model inputs."""

    def __init__(self, mtp: nn.Module) -> None:
        super().__init__()
        self.mtp = mtp
        self.config = mtp.config  # the MTP layers' config: num_hidden_layers = their number, their layer types
        self.layer_types = getattr(mtp.config, "layer_types", None)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.mtp.layers.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.mtp.layers.parameters()).device

    def get_output_embeddings(self) -> None:
        """None: the MTP model projects with its own `_project_to_logits`, no lm_head module of this drafter's."""

    def forward(
        self,
        # [B, W]
        input_ids: torch.Tensor,
        # [B, W]
        position_ids: torch.Tensor,
        # [B, 1, W, S] additive, {layer type: mask}, or None (one query per row, every slot visible)
        attention_mask,
        cache,
        # [B, W, H]: the hidden state before each token (the target's, or the drafting layer's output at the parent)
        features: torch.Tensor,
        from_target: bool,
        # draft depth of the fed tokens (committed tokens: 0)
        depth: int = 0,
        # [B, N] long or None: the positions whose logits are computed (None: every position)
        logits_at: torch.Tensor | None = None,
        use_cache: bool = True,
        output_hidden_states: bool = False,
        return_dict: bool = True,
    ) -> CausalLMOutputWithPast:
        mtp, device = self.mtp, self.device
        position_ids = position_ids.to(device)
        embeds = mtp.embed_tokens(input_ids.to(mtp.embed_tokens.weight.device)).to(device)
        features = features.to(device=device, dtype=embeds.dtype)
        drafting = 0 if from_target else depth % len(mtp.layers)
        drafted = None
        rotaries = {}  # the rotary embedding per layer type (one for all layers without per-layer rope)
        for index, layer in enumerate(mtp.layers):
            layer_type = None if self.layer_types is None else self.layer_types[index]
            mask = attention_mask.get(layer_type) if isinstance(attention_mask, dict) else attention_mask
            rotary = None
            if mtp.rotary_emb is not None:
                key = layer_type if mtp.has_per_layer_rope else None
                if key not in rotaries:
                    rope_kwargs = {"layer_type": layer_type} if mtp.has_per_layer_rope else {}
                    rotaries[key] = mtp.rotary_emb(embeds, position_ids=position_ids, **rope_kwargs)
                rotary = rotaries[key]
            hidden = layer(embeds, features, position_embeddings=rotary, attention_mask=mask,
                           position_ids=position_ids, **{CACHE_KWARG: cache})
            if mtp.use_shared_post_norm:
                hidden = mtp.shared_post_norm(hidden)
            if index == drafting:
                drafted = hidden
        logits = mtp._project_to_logits(select_positions(drafted, logits_at))
        return CausalLMOutputWithPast(logits=logits, hidden_states=(drafted,))


_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its loaded MTP layers
_DRAFTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # MTP layers -> their drafter


class MtpProposer(EagleProposer):
    """Drafts with the target's MTP layers (see the module docstring); `SpeculativeConfig.heads` may hold an
    `MtpModel` built or loaded by the caller, else the layers are loaded from the target's checkpoint once."""

    role = "the MTP layers"

    def _drafter(self, config: SpeculativeConfig, target: nn.Module) -> nn.Module:
        check_has_mtp_layers(target)
        mtp = config.heads
        if mtp is None:
            if target not in _LOADED:
                _LOADED[target] = load_mtp_layers(target)
            mtp = _LOADED[target]
        if len(mtp.layers) != num_mtp_layers(target):
            raise ValueError(
                f"SpeculativeConfig.heads: {len(mtp.layers)} MTP layers, but {type(target).__name__} declares "
                f"{num_mtp_layers(target)} (config.num_mtp_layers); pass the layers built for this model"
            )
        if mtp not in _DRAFTERS:  # one drafter per MTP model, so a compiled forward of it is reused by later calls
            _DRAFTERS[mtp] = MtpDrafter(mtp)
        return _DRAFTERS[mtp]

    def _target_features(self, config: SpeculativeConfig, target: nn.Module) -> tuple[int, ...]:
        return (-1,)  # the target's final hidden state, as transformers' `use_mtp` reads it

    def _draft_inputs(self, parent_hidden: torch.Tensor | None, depth: int) -> dict:
        return {**super()._draft_inputs(parent_hidden, depth), "depth": depth}


def _build(config: SpeculativeConfig, target: nn.Module, sampling: DraftSampling) -> Proposer:
    return MtpProposer(config, target, sampling)


register_proposer("mtp", _build)
