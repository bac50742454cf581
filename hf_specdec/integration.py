"""How users reach the engine: `hf_specdec.generate(model, ...)`, or `enable()` and `model.generate(...)`.

`enable()` wraps transformers' `GenerationMixin.generate` once (idempotent; `disable()` restores it) so that it
accepts `speculative=SpeculativeConfig(...)`, or `assistant=model` / `spec_method="ngram"`, and routes transformers'
own `assistant_early_exit=N` (self-speculation from the first N layers) to `method="early_exit"`. A call with none
of them is passed through untouched. A speculative call becomes `generate(custom_generate=speculative_generate)`, so
generate's own preparation is reused; the streamer travels under another name because `custom_generate` drops it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerationMixin

from hf_specdec.cache.naming import given_cache
from hf_specdec.config import (
    HEADS_CLASS,
    SPEC_METHODS,
    SpeculativeConfig,
    describe,
    heads_class,
    is_causal_lm,
    is_mtp_model,
    method_hint,
)
from hf_specdec.decoding.loop import speculative_generate

SUPPORTED_TRANSFORMERS = (Version("5.23.0"), Version("5.25.0"))  # [low, high): the versions the suite runs on
_TRANSFORMERS_GENERATE = GenerationMixin.generate


def check_transformers_version(version: str = transformers.__version__) -> None:
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= Version(version) < high:
        raise RuntimeError(
            f"hf_specdec supports transformers >={low},<{high}; found {version}. "
            f"Install a supported version: pip install 'transformers>={low},<{high}'"
        )


def resolve_config(
    speculative: SpeculativeConfig | None,
    assistant: Any,
    spec_method: str | None,
) -> SpeculativeConfig:
    """One SpeculativeConfig from the three spellings; conflicting values are an error, never a silent choice."""
    if speculative is None:
        return SpeculativeConfig(**_assistant_fields(assistant, spec_method))
    if not isinstance(speculative, SpeculativeConfig):
        raise ValueError(f"speculative: expected a hf_specdec.SpeculativeConfig, got {type(speculative).__name__}")
    if assistant is not None and assistant is not speculative.draft_model and assistant is not speculative.heads:
        raise ValueError("assistant=: conflicts with speculative's draft_model / heads; pass the drafter in one place "
                         "only")
    if spec_method is not None and spec_method != speculative.method:
        raise ValueError(
            f"spec_method={spec_method!r} conflicts with speculative.method={speculative.method!r}; pass one"
        )
    return speculative


def _assistant_fields(assistant: Any, spec_method: str | None) -> dict[str, Any]:
    """The SpeculativeConfig fields `assistant=` / `spec_method=` stand for, checked here so errors name them.
    Without spec_method the method follows from the assistant: heads pick their method, a model 'draft'."""
    if spec_method is not None and spec_method not in SPEC_METHODS:
        raise ValueError(f"spec_method={spec_method!r}: unknown method; expected one of {list(SPEC_METHODS)}")
    method = spec_method
    if method is None:
        method = "mtp" if is_mtp_model(assistant) else next(
            (m for m in HEADS_CLASS if isinstance(assistant, heads_class(m))), "draft")
    if method == "early_exit":
        raise ValueError("spec_method='early_exit' needs the layer to draft from: pass assistant_early_exit=N or "
                         "speculative=SpeculativeConfig(method='early_exit', early_exit_layer=N)")
    if method == "mtp":  # the target's own MTP layers: loaded from its checkpoint unless given
        return {"method": method, "heads": assistant}
    if method in ("ngram", "suffix", "recycling"):
        if assistant is not None:
            fallback = " (a fallback drafter: speculative=SpeculativeConfig(method='suffix', fallback=...))"
            raise ValueError(
                f"assistant=: spec_method={method!r} drafts from the text and takes no assistant, got "
                f"{describe(assistant)}; drop assistant={method_hint(assistant)}{fallback if method == 'suffix' else ''}"
            )
        return {"method": method}
    if assistant is None:
        raise ValueError(
            f"spec_method={method!r} needs assistant=<{HEADS_CLASS.get(method, 'a draft model')}> "
            "(or pass speculative=SpeculativeConfig(...))"
        )
    if method in HEADS_CLASS:
        if not isinstance(assistant, heads_class(method)):
            raise ValueError(f"assistant=: spec_method={method!r} needs {HEADS_CLASS[method]}, got "
                             f"{describe(assistant)}{method_hint(assistant)}")
        return {"method": method, "heads": assistant}
    if not is_causal_lm(assistant):
        raise ValueError(f"assistant=: spec_method='draft' needs a transformers causal LM, got "
                         f"{describe(assistant)}{method_hint(assistant)}")
    return {"method": method, "draft_model": assistant}


# transformers' options of its assisted loop that `assistant_early_exit=` reads, and what hf_specdec makes of them
EARLY_EXIT_OPTIONS = ("assistant_early_exit", "num_assistant_tokens", "num_assistant_tokens_schedule",
                      "assistant_confidence_threshold")


def early_exit_config(kwargs: dict[str, Any]) -> SpeculativeConfig | None:
    """transformers' spelling `assistant_early_exit=N` (popped from kwargs with its companions) as
    `SpeculativeConfig(method="early_exit", early_exit_layer=N)`; `num_assistant_tokens` is k. None without it."""
    if not _early_exit_asked(kwargs):
        return None
    options = {name: kwargs.pop(name) for name in EARLY_EXIT_OPTIONS if name in kwargs}
    schedule = options.get("num_assistant_tokens_schedule")
    if schedule not in (None, "constant"):
        raise ValueError(f"num_assistant_tokens_schedule={schedule!r}: with assistant_early_exit, hf_specdec drafts "
                         "num_assistant_tokens tokens every step; pass 'constant' or drop it")
    threshold = options.get("assistant_confidence_threshold")
    if threshold not in (None, 0, 0.0):
        raise ValueError(f"assistant_confidence_threshold={threshold!r}: with assistant_early_exit, hf_specdec drafts "
                         "num_assistant_tokens tokens every step; its own stop is on a row's running confidence "
                         "(the product of the draft's top probabilities), not each token's: pass "
                         "speculative=SpeculativeConfig(method='early_exit', early_exit_layer=N, draft_confidence=...) "
                         "instead, or pass 0 or drop assistant_confidence_threshold")
    k = options.get("num_assistant_tokens")
    return SpeculativeConfig(method="early_exit", early_exit_layer=options["assistant_early_exit"],
                             **({} if k is None else {"num_speculative_tokens": k}))


def _generate(
    original: Any,
    model: Any,
    args: tuple,
    kwargs: dict[str, Any],
    speculative: SpeculativeConfig | None,
    assistant: Any,
    spec_method: str | None,
):
    check_transformers_version()
    early_exit = early_exit_config(kwargs)
    if early_exit is not None:
        if speculative is not None or assistant is not None or spec_method is not None:
            raise ValueError("assistant_early_exit=: transformers' spelling of SpeculativeConfig(method='early_exit', "
                             "early_exit_layer=N); pass it alone, or speculative=/assistant=/spec_method= without it")
        speculative = early_exit
    config = _with_tokenizers(resolve_config(speculative, assistant, spec_method), kwargs)
    for name in ("assistant_model", "prompt_lookup_num_tokens", "use_mtp", "custom_generate"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name}: transformers' own option cannot be combined with hf_specdec's speculative decoding; "
                "drop one of them"
            )
    streamer = kwargs.pop("streamer", None)
    _stop_strings_to_criteria(model, kwargs)
    return original(
        model,
        *args,
        custom_generate=speculative_generate,
        speculative_config=config,
        spec_streamer=streamer,
        spec_user_cache=given_cache(kwargs),
        **kwargs,
    )


def _with_tokenizers(config: SpeculativeConfig, kwargs: dict[str, Any]) -> SpeculativeConfig:
    """transformers' spelling of a draft with another tokenizer, `assistant_tokenizer=` beside `tokenizer=` (the
    target's), as the config's `draft_tokenizer` / `tokenizer`."""
    draft_tokenizer = kwargs.pop("assistant_tokenizer", None)
    if draft_tokenizer is None:
        return config
    if config.method != "draft":
        raise ValueError(f"assistant_tokenizer=: only a draft model (method='draft') takes it, got "
                         f"method={config.method!r}")
    if kwargs.get("tokenizer") is None:
        raise ValueError("assistant_tokenizer=: a draft with another tokenizer also needs the target's tokenizer; "
                         "pass tokenizer=... to generate")
    if config.draft_tokenizer is not None:
        raise ValueError("assistant_tokenizer=: conflicts with speculative.draft_tokenizer; pass it in one place")
    return dataclasses.replace(config, draft_tokenizer=draft_tokenizer, tokenizer=kwargs["tokenizer"])


def _stop_strings_to_criteria(model: Any, kwargs: dict[str, Any]) -> None:
    """Build the stop-string criterion here: `custom_generate` drops `tokenizer=` before generate would build it."""
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.pop("stop_strings", None)
    config = kwargs.get("generation_config") or model.generation_config
    if stop_strings is None and getattr(config, "stop_strings", None) is not None:
        stop_strings = config.stop_strings
        kwargs["generation_config"] = config = copy.deepcopy(config)
        config.stop_strings = None
    if stop_strings is None:
        return
    if tokenizer is None:
        raise ValueError("stop_strings: stopping on strings needs the tokenizer; pass tokenizer=... to generate")
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria


def generate(
    model: Any,
    *args: Any,
    speculative: SpeculativeConfig | None = None,
    assistant: Any = None,
    spec_method: str | None = None,
    **kwargs: Any,
):
    """`model.generate(...)` with speculative decoding, without patching transformers."""
    if not _speculation_asked(speculative, assistant, spec_method, kwargs):
        raise ValueError("hf_specdec.generate needs speculative=SpeculativeConfig(...), assistant=..., spec_method=... "
                         "or assistant_early_exit=...")
    return _generate(_TRANSFORMERS_GENERATE, model, args, kwargs, speculative, assistant, spec_method)


def _early_exit_asked(kwargs: dict[str, Any]) -> bool:
    return kwargs.get("assistant_early_exit") is not None


def _speculation_asked(speculative: Any, assistant: Any, spec_method: str | None, kwargs: dict[str, Any]) -> bool:
    """Whether a generate call asks for speculative decoding (else the patched generate passes it through)."""
    return speculative is not None or assistant is not None or spec_method is not None or _early_exit_asked(kwargs)


# transformers' assisted-generation options, which its own loop runs one row at a time, and hf_specdec's spelling
TRANSFORMERS_ASSISTED = {"assistant_model": "assistant=<the draft model>",
                         "prompt_lookup_num_tokens": "spec_method='ngram'"}


def _check_assisted_batch(args: tuple, kwargs: dict[str, Any]) -> None:
    """transformers' own assisted generation on a batch: say how to get it batched before transformers refuses."""
    asked = [name for name in TRANSFORMERS_ASSISTED if kwargs.get(name) is not None]
    names = ("input_ids", "inputs", "inputs_embeds")
    inputs = args[0] if args else next((kwargs[name] for name in names if kwargs.get(name) is not None), None)
    rows = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 else 1
    if asked and rows > 1:
        name = asked[0]
        raise ValueError(
            f"{name}=: transformers' own assisted generation runs one row at a time, and this batch has {rows}; "
            f"hf_specdec drafts for the whole batch: pass {TRANSFORMERS_ASSISTED[name]} instead of {name}= (or "
            "speculative=SpeculativeConfig(...)), or generate row by row")


def _patched_generate(self, *args: Any, speculative=None, assistant=None, spec_method=None, **kwargs: Any):
    if not _speculation_asked(speculative, assistant, spec_method, kwargs):
        _check_assisted_batch(args, kwargs)
        return _TRANSFORMERS_GENERATE(self, *args, **kwargs)
    return _generate(_TRANSFORMERS_GENERATE, self, args, kwargs, speculative, assistant, spec_method)


functools.update_wrapper(_patched_generate, _TRANSFORMERS_GENERATE)


def enable() -> None:
    """Teach every transformers model's `generate` the speculative keywords (idempotent)."""
    check_transformers_version()
    GenerationMixin.generate = _patched_generate


def disable() -> None:
    """Restore transformers' own `generate`."""
    GenerationMixin.generate = _TRANSFORMERS_GENERATE


def is_enabled() -> bool:
    return GenerationMixin.generate is _patched_generate
