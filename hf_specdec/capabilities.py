"""Up-front checks: what speculative decoding cannot do raises a clear error before any forward pass."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from transformers import DynamicCache, GenerationConfig, StaticCache
from transformers.cache_utils import CacheLayerMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL

from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.cache.ragged import AttentionLayout
from hf_specdec.cache.recurrent import recurrent_layer_indices
from hf_specdec.compile import STATIC_CACHE_IMPLEMENTATIONS, uses_static_shapes
from hf_specdec.step.state import MODALITY_TYPE_INPUTS

# model_kwargs that `generate` prepares and the engine understands; anything else would be silently dropped, so
# it is refused.
KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", CACHE_KWARG, "use_cache", "logits_to_keep",
                      "cache_position", "token_type_ids", "inputs_embeds", "output_attentions",
                      "output_hidden_states", *MODALITY_TYPE_INPUTS}
# multimodal inputs, which plain `generate` feeds to the prompt's forward only; so does the engine
PROMPT_ONLY_MODEL_KWARGS = frozenset(MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL)
# Proposers that read the prompt's token ids, which a prompt given as `inputs_embeds` alone does not have.
NEEDS_PROMPT_IDS = ("draft", "eagle", "mtp", "early_exit")
SUPPORTED_CACHE_IMPLEMENTATIONS = (None, "dynamic", *STATIC_CACHE_IMPLEMENTATIONS)
# where the modules live whose output for a token depends on the other tokens of the same forward: torch.ao's
# dynamically quantized layers quantize their whole input with one scale, taken from its range
TOKEN_COUPLED_MODULES = "torch.ao.nn.quantized.dynamic"


def check_generation_supported(
    model: Any,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    synced_gpus: bool,
    # the config's method, then the methods that draft under it (`SpeculativeConfig.drafting_methods`)
    methods: Sequence[str],
    # how many token ids the prompt comes with (the output's first columns; generate's `input_ids`)
    prompt_ids: int,
) -> None:
    if model.config.is_encoder_decoder:
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; hf_specdec supports decoder-only LMs")
    _warn_if_forwards_couple_tokens(model)
    AttentionLayout.from_model(model)  # what the layers attend with, before anything reads the cache
    if generation_config.num_beams != 1:
        raise ValueError(
            f"num_beams={generation_config.num_beams}: beam search cannot be combined with speculative decoding; "
            "use num_beams=1 or drop the speculative config"
        )
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            f"generation mode {mode.value!r} cannot be combined with speculative decoding; it supports greedy "
            "decoding and sampling (drop penalty_alpha, dola_layers, ...)"
        )
    if synced_gpus:
        raise ValueError("synced_gpus=True (DeepSpeed ZeRO-3 / FSDP) is not supported by speculative decoding")
    if generation_config.cache_implementation not in SUPPORTED_CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r}: speculative decoding keeps its own "
            "KV cache, dynamic or (with 'static') of fixed capacity for compiled forwards; it does not offload or "
            f"quantize it; use one of {[c for c in SUPPORTED_CACHE_IMPLEMENTATIONS if c]} or drop cache_implementation"
        )
    cache = model_kwargs.get(CACHE_KWARG)
    if isinstance(cache, StaticCache) and cache.get_seq_length() > 0:
        raise ValueError(
            f"{CACHE_KWARG}: a filled StaticCache; speculative decoding continues a conversation only from a "
            "DynamicCache (what generate returns by default); pass an empty StaticCache, or a DynamicCache"
        )
    if cache is not None and type(cache) not in (DynamicCache, StaticCache):
        raise ValueError(
            f"{CACHE_KWARG}: a {type(cache).__name__}; speculative decoding continues only from a transformers "
            "DynamicCache (what generate returns by default) and takes an empty StaticCache; drop it or pass one "
            "of those"
        )
    embeds = model_kwargs.get("inputs_embeds")
    _check_prompt_covers_mask_and_cache(prompt_ids if embeds is None else embeds.shape[1],
                                        model_kwargs.get("attention_mask"), cache)
    reading_ids = [m for m in methods if m in NEEDS_PROMPT_IDS]
    if embeds is not None and reading_ids and prompt_ids < embeds.shape[1]:
        # with ids for every embedded position the drafter reads those: drafts guessed from the ids' text, verified
        # by the target on the embeddings like any other
        who = f"method={methods[0]!r}"
        if reading_ids[0] != methods[0]:
            who += f" (drafting with {reading_ids[0]!r})"
        raise ValueError(
            f"inputs_embeds: {who} drafts from the prompt's token ids, which a prompt given as embeddings does not "
            f"have ({embeds.shape[1]} embedded positions, {prompt_ids} token ids); pass input_ids for every embedded "
            "position as well, or use method 'ngram', 'medusa' or 'mlp_speculator' with inputs_embeds alone"
        )
    unknown = sorted(k for k, v in model_kwargs.items()
                     if k not in KNOWN_MODEL_KWARGS and k not in PROMPT_ONLY_MODEL_KWARGS and _given(v))
    if unknown:
        raise ValueError(
            f"model inputs {unknown} are not supported by speculative decoding: after the prompt's forward it feeds "
            "the model token ids, positions and segment ids only (the prompt's forward also takes the multimodal "
            "inputs plain generate gives it alone, such as pixel_values); drop them, or use plain generate"
        )
    multimodal = sorted(k for k in multimodal_inputs(model_kwargs) if k in PROMPT_ONLY_MODEL_KWARGS)
    if multimodal and embeds is not None and cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"multimodal inputs ({', '.join(multimodal)}) with inputs_embeds and a filled {CACHE_KWARG}: speculative "
            "decoding continues a conversation with new images from token ids; pass input_ids instead of "
            "inputs_embeds"
        )


def check_recurrent_supported(
    model: Any,
    config: Any,
    generation_config: GenerationConfig,
    # the cache generate prepared or the caller passed (None when there is none)
    cache: Any,
    # [B, P] or None: the prompt's mask
    attention_mask: Any,
    # how many token ids the prompt comes with
    prompt_ids: int,
) -> None:
    """A model with recurrent layers (`hf_specdec.cache.recurrent`) speculates with chains and dynamic shapes, from
    the prompt or continuing a filled cache (of a hybrid, with no padding among the new tokens); anything else
    raises here, before any forward. A draft model with recurrent layers drafts chains too."""
    for drafting in (config, config.fallback):
        draft = None if drafting is None else drafting.draft_model
        if hasattr(draft, "config") and recurrent_layer_indices(draft) and (
                drafting.drafts_trees or uses_static_shapes(generation_config, cache)):
            raise ValueError(f"draft_model: {type(draft).__name__} has recurrent layers, whose state follows one "
                             "sequence: it drafts chains with dynamic shapes; use tree_width=1 without "
                             "tree_total_tokens, and no static cache or compile_config")
    if not recurrent_layer_indices(model):
        return
    name = type(model).__name__
    if config.drafts_trees:
        raise ValueError(
            f"{name} has recurrent layers, whose state follows one sequence: it verifies chains of drafts, not token "
            f"trees (method={config.method!r}, tree_width={config.tree_width}, tree_total_tokens="
            f"{config.tree_total_tokens!r}); use tree_width=1 without tree_total_tokens or tree_paths, with method "
            "'ngram', 'suffix', 'draft', 'eagle', 'medusa', 'mlp_speculator' or 'auto' (token recycling drafts "
            "trees)"
        )
    if uses_static_shapes(generation_config, cache):
        raise ValueError(f"{name} has recurrent layers: static shapes (cache_implementation='static', compile_config, a "
                         "StaticCache) are not supported for it; drop them")
    if holds_tokens(cache):
        if not any(isinstance(layer, CacheLayerMixin) for layer in cache.layers):
            raise ValueError(f"{CACHE_KWARG}: a filled cache for {name}, a model without attention layers, whose "
                             "states do not say how many tokens they hold; pass the whole conversation as the "
                             "prompt without the cache")
        if isinstance(cache, DynamicCache) and cache.get_seq_length() > 0:
            new = (attention_mask.shape[1] if attention_mask is not None else prompt_ids) - cache.get_seq_length()
            if attention_mask is not None and new > 0 and not bool(attention_mask[:, -new:].all()):
                raise ValueError(
                    f"attention_mask: padding among the new tokens after a filled {CACHE_KWARG} of {name}, a model "
                    "with recurrent layers (their states would take the padding as text); pad the conversation on "
                    "the left, before the cached part"
                )


def holds_tokens(cache: Any) -> bool:
    """Whether a transformers cache holds anything: keys and values, or a recurrent layer's state."""
    if cache is None:
        return False
    if any(any(getattr(layer, "has_previous_state", {}).values()) for layer in cache.layers):
        return True
    return any(getattr(layer, "is_initialized", False) and layer.get_seq_length() > 0 for layer in cache.layers
               if isinstance(layer, CacheLayerMixin))


def multimodal_inputs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The multimodal inputs `generate` prepared: those only the prompt's forward takes (pixel values, the image
    features it encoded, ...) and each prompt token's modality (`mm_token_type_ids`)."""
    return {k: v for k, v in model_kwargs.items()
            if (k in PROMPT_ONLY_MODEL_KWARGS or k in MODALITY_TYPE_INPUTS) and _given(v)}


def _given(value: Any) -> bool:
    """Whether a model input holds something: `generate` passes a vision-language model's `mm_encoder_outputs` as
    an empty dict when there is no image."""
    return value is not None and not (isinstance(value, dict) and not value)


def _check_prompt_covers_mask_and_cache(
    # the prompt's positions: its token ids, or its embeddings when given as `inputs_embeds`
    prompt_length: int,
    # [B, M] or None
    attention_mask: Any,
    cache: Any,
) -> None:
    """Speculative decoding reads the whole conversation: its token ids (the drafters' context, the output's first
    columns) and, when a filled cache continues it, the positions that cache lacks. Plain `generate` also takes only
    the new tokens with a mask over the whole conversation, or a cache that already holds the whole prompt (it then
    feeds prompt tokens a second time); neither gives the engine a context to draft from."""
    filled = 0 if cache is None else cache.get_seq_length()
    if attention_mask is not None and attention_mask.shape[-1] != prompt_length:
        cached = f" and {CACHE_KWARG} holds {filled}" if filled else ""
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} positions but the prompt has {prompt_length}{cached}: "
            "speculative decoding needs the token ids of every position the mask covers (the cached ones too); pass "
            "the whole conversation as input_ids, with a mask of the same length"
        )
    if filled and filled >= prompt_length:
        raise ValueError(
            f"{CACHE_KWARG} already holds {filled} positions and the prompt has {prompt_length}: a filled cache "
            "continues a conversation, so the prompt must be that conversation (the cached tokens) followed by at "
            "least one new token"
        )


def _warn_if_forwards_couple_tokens(model: Any) -> None:
    """A target whose layers quantize each forward's input as a whole (torch.ao dynamic quantization) scores a token
    differently beside other tokens: a verify forward's greedy choice can then differ from plain decoding's."""
    coupled = next((name for name, module in model.named_modules()
                    if type(module).__module__.startswith(TOKEN_COUPLED_MODULES)), None)
    if coupled is None:
        return
    warnings.warn(
        f"{type(model).__name__}.{coupled} is dynamically quantized (torch.ao): it quantizes each forward's input "
        "with one scale taken from all its tokens, so a token's logits depend on the other tokens in the forward. "
        "Speculative decoding verifies several tokens per forward, so greedy output can part from plain "
        "generate's where its two best tokens are close (as plain generate's own output changes with the batch), "
        "and sampling follows the target as the verify forward computes it. For output identical to plain "
        "generate, run the target unquantized (float32 or bfloat16) or with weight-only quantization",
        stacklevel=4)
