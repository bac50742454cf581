"""Static shapes and compiled forwards, switched on by transformers' own options.

With `cache_implementation="static"` (or one of transformers' other static cache names), a `compile_config`, or an
empty `StaticCache` passed as `past_key_values`, the engine runs with *static shapes*: every cache has a fixed
capacity allocated once, every verify forward has the same width for a (batch, k or tree budget), every drafter
forward the same width per kind (feed, draft step), and finished rows keep their slot (masked). A proposer that
knows on the host that no row drafts this step (an n-gram lookup without a match) verifies one token per row: a
second verify shape. The forwards are
then *compiled* with `torch.compile` when `compile_config` is set, or for a static cache on an accelerator (as
transformers' own `generate` does), unless `disable_compile=True`: the target's verify forward and the drafter's
forwards, each compiled once per shape (`dynamic=False`), kept on the module and reused across steps and calls.
`mode="reduce-overhead"` (transformers' default) captures CUDA graphs on CUDA; on a CPU, where there are none, the
default inductor mode is used.

`CompiledForward` counts the calls that compiled, per input shapes, so a test can hold recompiles to one per shape.
A static cache's capacity depends on the call's length limit, and every capacity is a new graph. Capacities come in
powers of two (`static_room`): a call reuses the graphs of every earlier call in its bucket, and attention spans
at most twice what the call can hold (transformers' own static cache keeps the largest size any call needed; a
short call at a long call's capacity ran 1.65x as long here: `benchmarks/static_capacity.py`).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig

# transformers' names of static caches (5.23): the engine takes each as "fixed capacity, fixed shapes"
STATIC_CACHE_IMPLEMENTATIONS = ("static", "sliding_window", "hybrid", "hybrid_chunked")
# transformers wraps every model's forward in one decorator, so every compiled model forward shares dynamo's cache
# of that code object: a target, its drafter, a few batch sizes, widths and cache buckets make more than dynamo's
# default of 8 (past the limit dynamo runs the forward eagerly)
RECOMPILE_LIMIT = 128
# the smallest static cache room (tokens per row) before the step's region
MIN_STATIC_ROOM = 64


@dataclass(frozen=True)
class CompileSettings:
    """How to compile: transformers' `CompileConfig` fields, with `dynamic=False` unless asked otherwise."""

    backend: Any = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool = False
    options: tuple[tuple[str, Any], ...] | None = None

    @classmethod
    def from_generation(
        cls, model: torch.nn.Module, generation_config: GenerationConfig, static_shapes: bool = True
    ) -> CompileSettings | None:
        """The settings when this call (running with `static_shapes` or not) compiles, else None (see the module
        docstring)."""
        if generation_config.disable_compile or not static_shapes:
            return None
        config = generation_config.compile_config
        if config is None:
            if model.device.type not in ("cuda", "xpu"):
                return None
            from transformers import CompileConfig

            config = CompileConfig()
        mode = config.mode
        if mode == "reduce-overhead" and model.device.type != "cuda":
            mode = None  # CUDA graphs need CUDA
        options = None if config.options is None else tuple(sorted(config.options.items()))
        return cls(backend=config.backend, mode=None if options else mode, fullgraph=bool(config.fullgraph),
                   dynamic=bool(config.dynamic), options=options)


def uses_static_shapes(generation_config: GenerationConfig, past_key_values: Any = None) -> bool:
    """Whether this call runs with static shapes (see the module docstring)."""
    from transformers import StaticCache

    return (generation_config.cache_implementation in STATIC_CACHE_IMPLEMENTATIONS
            or generation_config.compile_config is not None or isinstance(past_key_values, StaticCache))


def check_compilable(model: torch.nn.Module, role: str) -> None:
    """Raise ValueError, naming `role` ("the target", "the draft model"), when `model` cannot be compiled."""
    name = type(model).__name__
    if getattr(model, "_can_compile_fullgraph", True) is False:
        raise ValueError(
            f"compile_config: {role} ({name}) cannot be compiled (transformers marks it _can_compile_fullgraph=False); "
            "drop compile_config (and cache_implementation='static'), or pass disable_compile=True to keep static "
            "shapes without compiling"
        )
    devices = set(getattr(model, "hf_device_map", {}).values())
    if "disk" in devices or ("cpu" in devices and len(devices) > 1):
        raise ValueError(
            f"compile_config: {role} ({name}) is offloaded (device_map {sorted(map(str, devices))}), which "
            "torch.compile cannot run; load it on one device, or drop compile_config"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        raise ValueError(
            f"compile_config: {role} ({name}) is quantized with {type(quantizer).__name__}, which torch.compile "
            "cannot take; drop compile_config, or use a quantization method transformers marks compileable"
        )


class CompiledForward:
    """`module.forward` compiled with `settings`; counts the calls that compiled (`compiles`, per input shapes).

    Under CUDA graphs (`mode="reduce-overhead"`) a graph's outputs live in memory that its next replay writes again,
    while the engine keeps a step's logits and features past the next forward of the same shape (a draft model's
    chain runs one graph k times a step): such outputs are cloned as they come out (`outputs_copied`), only the part
    the caller keeps when it says which (`keep`)."""

    def __init__(self, module: torch.nn.Module, settings: CompileSettings) -> None:
        options = dict(settings.options) if settings.options else None
        # raised when compiling is asked for (never at import): a per-call patch would cost ~20 us a forward
        torch._dynamo.config.recompile_limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
        self.function = torch.compile(module.forward, backend=settings.backend, mode=settings.mode,
                                      fullgraph=settings.fullgraph, dynamic=settings.dynamic, options=options)
        self.outputs_copied = settings.mode == "reduce-overhead"
        self.compiles: collections.Counter = collections.Counter()

    def __call__(self, keep: Callable[[Any], Any] | None = None, **inputs: Any) -> Any:
        """The forward's output; with `keep` (output -> the part of it the caller keeps, e.g. the logits and one of
        the layers' hidden states), that part alone, so only it is copied."""
        before = graphs_compiled()
        out = self.function(**inputs)
        if graphs_compiled() != before:
            self.compiles[input_shapes(inputs)] += 1
        if keep is not None:
            out = keep(out)
        return copy_tensors(out) if self.outputs_copied else out


def copy_tensors(value: Any) -> Any:
    """`value` with every tensor in it cloned (through tuples, lists and dicts, a transformers `ModelOutput`
    included); any other object (a cache the forward wrote into) is passed through as it is."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):  # ModelOutput too: its fields set again, in place, keep its class
        for key, item in list(value.items()):
            value[key] = copy_tensors(item)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(copy_tensors(item) for item in value)
    return value


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far (a step during which it grew compiled one)."""
    return counters["stats"]["unique_graphs"]


def static_room(needed: int) -> int:
    """Token slots per row for a static cache that must hold `needed`: the next power of two, at least
    `MIN_STATIC_ROOM` (each is one set of compiled graphs)."""
    return max(MIN_STATIC_ROOM, 1 << max(needed - 1, 0).bit_length())


def input_shapes(inputs: dict[str, Any]) -> tuple:
    """A call's signature: the shapes of its tensor inputs (nested dicts of masks included) and its flags, by
    name (each signature is one graph)."""
    key = []
    for name, value in sorted(inputs.items()):
        if isinstance(value, torch.Tensor):
            key.append((name, tuple(value.shape)))
        elif isinstance(value, dict):
            key.append((name, input_shapes(value)))
        elif isinstance(value, (bool, int, str)) or value is None:
            key.append((name, value))
    return tuple(key)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_forward(module: torch.nn.Module, settings: CompileSettings) -> CompiledForward:
    """The module's compiled forward for these settings, built once and kept for later steps and calls."""
    per_module = _COMPILED.setdefault(module, {})
    if settings not in per_module:
        per_module[settings] = CompiledForward(module, settings)
    return per_module[settings]
