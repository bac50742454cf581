"""What transformers calls the KV cache: `past_key_values` up to 5.23, `cache` from 5.24 (in model inputs,
`generate`'s model kwargs and outputs). 5.24 still takes `past_key_values=` in `generate` and model forwards, with a
deprecation warning, so a caller may pass either; the engine speaks the installed version's name."""

from __future__ import annotations

import inspect
from typing import Any

import transformers
from packaging.version import Version

CACHE_KWARG = "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"
SPELLINGS = ("cache", "past_key_values")


def given_cache(kwargs: dict[str, Any]) -> Any:
    """The cache in `kwargs` under either spelling (None when there is none)."""
    return next((kwargs[name] for name in SPELLINGS if kwargs.get(name) is not None), None)


def cache_keyword(model: Any) -> str:
    """The keyword `model`'s forward takes its KV cache under: `cache` (transformers >= 5.24 models, the engine's
    drafters) or `past_key_values` (earlier versions; remote code written for them); a forward that names neither
    (a wrapper taking **kwargs) gets the installed transformers' name."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in SPELLINGS if name in parameters), CACHE_KWARG)
