"""The target's hidden states at a few entries of its `hidden_states`, recorded by hooks during a forward.

Asking a transformers model for `output_hidden_states=True` keeps every layer's hidden states until the forward
returns: over a prompt that is (layers + 1) x [B, P, H], for drafters that read one to three of them (EAGLE-1/2
the last, EAGLE-3 three, MTP the last). `FeatureTap` keeps only those: the input of decoder layer i for entry i
(entry 0 is the embeddings' output, which layer 0 takes), and the final norm's output for the last entry (which
transformers' causal LMs report there). Models whose decoder does not expose `layers` and `norm` are asked for
`output_hidden_states` as before (`FeatureTap.supported`).

The hooks sit on the model's modules, which `generate` calls in other threads share: a tap records the forwards run
in the thread that entered it, and no other.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn


class FeatureTap:
    """Hooks on the decoder that record the hidden states at `entries` (indices into the model's `hidden_states`,
    negative ones from its end) during the forwards run inside `with tap:` by the thread that entered it;
    `features()` returns them in order."""

    def __init__(self, model: nn.Module, entries: Sequence[int]) -> None:
        get_decoder = getattr(model, "get_decoder", None)
        decoder = get_decoder() if callable(get_decoder) else None
        layers = getattr(decoder, "layers", None)
        norm = getattr(decoder, "norm", None)
        self.supported = isinstance(layers, nn.ModuleList) and isinstance(norm, nn.Module)
        self.entries = tuple(entries)
        self._recorded: dict[int, torch.Tensor] = {}
        self._handles: list = []
        if not self.supported:
            return
        # the layers the forward runs (a checkpoint's MTP layers may follow them in the same list)
        text_config = model.config.get_text_config(decoder=True) if hasattr(model, "config") else None
        count = min(len(layers), getattr(text_config, "num_hidden_layers", None) or len(layers))
        resolved = [entry + count + 1 if entry < 0 else entry for entry in self.entries]
        if any(not 0 <= entry <= count for entry in resolved):
            self.supported = False
            return
        self._resolved = resolved
        self._modules = {entry: norm if entry == count else layers[entry] for entry in set(resolved)}
        self._count = count

    def __enter__(self) -> FeatureTap:
        self._recorded = {}
        self._thread = threading.get_ident()
        for entry, module in self._modules.items():
            if entry == self._count:
                self._handles.append(module.register_forward_hook(self._output_hook(entry)))
            else:
                self._handles.append(module.register_forward_pre_hook(self._input_hook(entry), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _input_hook(self, entry: int):
        def hook(module, args, kwargs):
            if threading.get_ident() == self._thread:
                self._recorded[entry] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _output_hook(self, entry: int):
        def hook(module, args, output):
            if threading.get_ident() == self._thread:
                self._recorded[entry] = output
        return hook

    def features(self) -> list[torch.Tensor]:
        """[B, W, H] per entry, in the order given: what the last forward inside `with` recorded (handed over: the
        tap keeps no reference to them)."""
        recorded, self._recorded = self._recorded, {}
        missing = [entry for entry, resolved in zip(self.entries, self._resolved) if resolved not in recorded]
        if missing:
            raise RuntimeError(f"the forward did not run the modules of hidden_states entries {missing}")
        return [recorded[resolved] for resolved in self._resolved]
