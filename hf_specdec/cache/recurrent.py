"""Layers with a running state (the state-space, linear-attention and short-convolution layers of hybrid models:
Qwen3-Next, Qwen3.5, Nemotron-H, Bamba, Granite-4.0-H, LFM2, Mamba-2, ...), rolled back to each row's last kept
token.

Such a layer keeps, per row, a state of fixed size (a convolution's last inputs, an SSM or delta-rule matrix) that
every token updates in place: there is no slot to keep or drop, as there is for the attention layers' keys and
values (`hf_specdec.cache.storage`). A verify forward runs the layer over the step's tokens (the last committed one,
the draft, dummies past a short draft) and leaves each row's state after all of them. A row that keeps every token
of the step keeps that state. A row that keeps fewer (a draft token rejected, dummies after its draft) has its state
put back as it was before the step and advanced again over its kept tokens alone: the layer's own mixer
(projections, convolution, recurrence) runs once more on the inputs it received at those positions in the verify
forward, recorded by a hook. A kept token saw only earlier kept tokens in the verify forward, so those inputs are the
ones plain decoding feeds the layer, and the state is the one plain `generate` reaches (computed over the kept tokens
in one call, as a prefill computes it, where plain decoding takes them one at a time).

What it costs: a copy of every recurrent state per step with a draft, and the recurrent layers' mixers over the kept
tokens of the rows that did not keep the whole step: in the next forward's mixer call when every row keeps the same
number (always at batch 1; `RecurrentRollback`), else in calls of their own, one per distinct number of kept tokens
(no other layer runs again). Chains only: a token tree's branches would each need a state of their own.

A mixer must continue from its cached state over several tokens in one call, as a verify forward feeds it:
transformers' Mamba-1 scan starts such a call from a zero state, and `check_continues_from_state` refuses it.

The layers are the transformers cache-layer type for these states (`LinearAttentionLayer`), so every model reads
and writes them through the `Cache` methods it calls in plain `generate` (`get_conv_state`, `update_recurrent_state`,
...); their mixers are found as the deepest module of the layer's index whose forward takes the cache.
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer

# transformers' cache-layer types of layers with a running state (state-space and linear-attention layers are
# "linear_attention", LFM2's short convolutions "conv")
RECURRENT_LAYER_TYPES = ("linear_attention", "conv")
# layer types without any cache (Nemotron-H's MLP and MoE layers)
CACHELESS_LAYER_TYPES = ("mlp", "moe")


class RecurrentSlotLayer(LinearAttentionLayer):
    """A recurrent layer's states for every batch row, in the engine's cache (a `SlotCache`'s layer list)."""

    # what the engine's key/value code reads from every layer: nothing here
    key_buffer = None
    value_buffer = None

    def grow(self, capacity: int) -> None:
        """No slot axis: nothing grows with the sequence."""

    def move(self, sources: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Slots moved for the attention layers leave these states alone (`RecurrentRollback.commit` sets them)."""

    def select_rows(
        self,
        # [B'] long
        rows: torch.Tensor,
    ) -> None:
        """Keep these batch rows' states."""
        for states in (self.conv_states, self.recurrent_states):
            for index, state in states.items():
                if state is not None:
                    states[index] = state[rows.to(state.device)]

    def load(
        self,
        # {(kind, index): [B, ...]}: states of another cache's layer (a filled transformers cache's, continued)
        states: dict[tuple[str, int], torch.Tensor],
    ) -> None:
        """Take copies of these states, as if this layer had computed them."""
        load_states(self, {key: state.clone() for key, state in states.items()})

    def states(self) -> dict[tuple[str, int], torch.Tensor]:
        """{(kind, index): [B, ...]} every state this layer holds."""
        return layer_states(self)


def layer_states(layer: LinearAttentionCacheLayerMixin) -> dict[tuple[str, int], torch.Tensor]:
    """{("conv" | "recurrent", index): [B, ...]} every state a transformers recurrent cache layer holds."""
    kinds = (("conv", layer.conv_states), ("recurrent", layer.recurrent_states))
    return {(kind, index): state for kind, states in kinds for index, state in states.items() if state is not None}


def load_states(
    layer: LinearAttentionCacheLayerMixin,
    # {(kind, index): [B, ...]}, as `layer_states` gives them: taken as they are (not copied)
    states: dict[tuple[str, int], torch.Tensor],
) -> None:
    """Make a transformers recurrent cache layer hold these states, as if it had computed them."""
    for (kind, index), state in states.items():
        getattr(layer, f"{kind}_states")[index] = state
        getattr(layer, f"is_{kind}_states_initialized")[index] = True
        layer.has_previous_state[index] = True
        if kind == "conv":
            layer.conv_kernel_size[index] = state.shape[-1]
        layer.device, layer.dtype = state.device, state.dtype


def _set_rows(
    layer: LinearAttentionCacheLayerMixin,
    # {(kind, index): [B, ...] or [G, ...]}
    states: dict[tuple[str, int], torch.Tensor],
    # [G] long: the rows `states` are for (None: every row, `states` holding them all)
    rows: torch.Tensor | None = None,
) -> None:
    """Write these states into the layer's, in place (all rows, or those given)."""
    for (kind, index), state in states.items():
        target = getattr(layer, f"{kind}_states")[index]
        if rows is None:
            target.copy_(state)
        else:
            target[rows] = state


def recurrent_layer_indices(model: nn.Module) -> tuple[int, ...]:
    """The indices of the model's decoder layers with a running state (none for an attention-only model)."""
    config = model.config.get_text_config(decoder=True)
    layer_types = (getattr(config, "layer_types", None) or ())[: config.num_hidden_layers]  # (an early-exit view's)
    return tuple(index for index, kind in enumerate(layer_types) if kind in RECURRENT_LAYER_TYPES)


def find_mixers(model: nn.Module, indices: Sequence[int]) -> dict[int, tuple[nn.Module, str]]:
    """{layer index: (the module that updates that layer's state, the name its forward gives the cache)}: the deepest
    module of that `layer_idx` whose forward takes the cache (the decoder layer holding it passes the cache on).
    Looked up once per model and layers."""
    per_model = _MIXERS.setdefault(model, {})
    if tuple(indices) not in per_model:
        per_model[tuple(indices)] = _find_mixers(model, indices)
    return per_model[tuple(indices)]


def _find_mixers(model: nn.Module, indices: Sequence[int]) -> dict[int, tuple[nn.Module, str]]:
    found: dict[int, tuple[int, nn.Module, str]] = {}
    for name, module in model.named_modules():
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or index not in indices:
            continue
        parameters = inspect.signature(module.forward).parameters
        keyword = next((word for word in ("cache", "cache_params") if word in parameters), None)
        if keyword is None:
            continue
        depth = name.count(".")
        if index not in found or depth > found[index][0]:
            found[index] = (depth, module, keyword)
    missing = sorted(set(indices) - set(found))
    if missing:
        raise ValueError(f"{type(model).__name__}: its layers {missing} keep a running state, and hf_specdec cannot "
                         "find the modules that update it (a module of that layer_idx whose forward takes the "
                         "cache), so it cannot roll them back when a draft is rejected; use plain generate for this "
                         "model")
    return {index: (module, keyword) for index, (_, module, keyword) in found.items()}


# the most kept tokens whose mixer inputs wait for the next forward (`RecurrentRollback`): each step that rejects a
# draft adds its kept tokens to those already waiting (the states go back to before them), so past this many the
# mixers run over them at once and the wait starts again
MAX_PENDING_TOKENS = 8
# per model, {layer indices: `find_mixers`' answer}
_MIXERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# models whose recurrent layers continue from their state over several tokens in one forward (checked once each)
_CONTINUES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the largest relative difference, in float32, between a mixer's output over six tokens at once and over three, then
# three more continuing from its state: rounding (1e-7 for chunked and step-by-step scans) passes, a scan that
# starts a multi-token forward from a zero state (Mamba-1's, 4e-4 to 4e-2 on tiny random models) does not
CONTINUATION_TOLERANCE = 1e-5


def check_continues_from_state(model: nn.Module) -> None:
    """Refuse a model whose recurrent layers restart from a zero state in a forward of several tokens after the
    cache (transformers' Mamba-1 scan, in Mamba, Falcon-Mamba, Jamba and Zamba): a verify forward of such a model
    gives other outputs than plain decoding. Checked once per model (`continuation_difference`)."""
    if not recurrent_layer_indices(model) or model in _CONTINUES:
        return
    difference, mixer = continuation_difference(model)
    if difference > CONTINUATION_TOLERANCE:
        raise ValueError(
            f"{type(model).__name__}: its recurrent layers ({type(mixer).__name__}) start a forward of several "
            "tokens from a zero state instead of the cached one (their output over six tokens at once and over three "
            f"then three more differ by {difference:.1e}, relative), so a verify forward would not compute what plain "
            "decoding does; speculative decoding cannot run on this model; use plain generate"
        )
    _CONTINUES[model] = True


def continuation_difference(model: nn.Module) -> tuple[float, nn.Module]:
    """(The largest difference, relative to the largest output, between the model's first recurrent mixer's output
    over six random inputs in one call and over three, then three more continuing from the state the first three
    left, in float32 (on a copy); the mixer)."""
    index = recurrent_layer_indices(model)[0]
    mixer, keyword = find_mixers(model, recurrent_layer_indices(model))[index]
    probe = copy.deepcopy(mixer).float()
    hidden = torch.randn(1, 6, model.config.get_text_config(decoder=True).hidden_size,
                         generator=torch.Generator().manual_seed(0)).to(next(probe.parameters()).device)
    with torch.no_grad():
        whole = probe(hidden, attention_mask=None,
                      **{keyword: _LayerView(index + 1).holding(index, LinearAttentionLayer())})
        cache = _LayerView(index + 1).holding(index, LinearAttentionLayer())
        parts = torch.cat([probe(hidden[:, :3], attention_mask=None, **{keyword: cache}),
                           probe(hidden[:, 3:], attention_mask=None, **{keyword: cache})], dim=1)
    return float((parts - whole).abs().max() / whole.abs().max().clamp(min=1e-30)), mixer


class _LayerView(Cache):
    """A cache of `size` layers, all empty but the one a mixer is given through `holding`: what a mixer reads and
    updates when it runs outside the model's forward (some rows' states, a probe's)."""

    def __init__(self, size: int) -> None:
        super().__init__(layers=[DummyLayer() for _ in range(size)])

    def holding(self, index: int, layer: LinearAttentionLayer) -> _LayerView:
        self.layers[index] = layer
        return self


class RecurrentRollback:
    """Rolls each row's recurrent states back to its kept tokens at every commit; see the module docstring.

    The engine calls `begin(width, real)` before each forward of a step, `end()` after it, and `commit(kept,
    sources)` when the step ends, with `select_rows` when rows are dropped between steps and `settle` before the
    states are read.

    When every row keeps the same number n of the step's tokens and fewer than all (always at batch 1), the mixers do
    not run again at the commit: the states go back to the step's start and the mixers' inputs at the n kept positions
    wait (`pending`) to be fed in front of the next forward's own, in the same mixer call, whose output there is
    dropped. That forward's mixers then advance the states over the kept tokens and the new ones at once (a few
    tokens more in a call that verifies several anyway), where running them apart costs a call of their own per
    layer. The states after that forward cover the waiting tokens too, so a step that rejects again goes back to
    before them: its kept tokens join the waiting ones, up to MAX_PENDING_TOKENS, past which the mixers run over them
    at the commit. Rows keeping different numbers of tokens have their mixers run again at the commit, one call per
    number."""

    def __init__(self, model: nn.Module, layers: dict[int, RecurrentSlotLayer]) -> None:
        self.layers = layers
        self.mixers = find_mixers(model, sorted(layers))
        self.view = _LayerView(max(layers) + 1)  # the cache a mixer runs on outside the model's forward
        self.saved: dict[int, dict[tuple[str, int], torch.Tensor]] | None = None  # states before the step
        self.before: dict[int, dict[tuple[str, int], torch.Tensor]] | None = None  # before a forward with dummies
        self.inputs: dict[int, torch.Tensor] = {}  # {layer: [B, W, H] the mixer's input in the running forward}
        # the step's forwards so far: ({layer: [B, W, H] inputs}, [B, W] its real tokens or None for all, W); the
        # first's inputs start with the P pending ones
        self.forwards: list[tuple[dict[int, torch.Tensor], torch.Tensor | None, int]] = []
        self.real: torch.Tensor | None = None  # [B, W] the running forward's real tokens (None: all), and its width
        self.width = 0
        # a finished forward with dummies whose rows are not yet back to their real tokens' states
        self.unfixed: tuple | None = None
        # {layer: [B, P, H]}: the mixers' inputs at the last step's kept tokens, which the states do not hold yet
        self.pending: dict[int, torch.Tensor] = {}
        self.hooks: list = []  # the hooks that record the inputs (and feed the pending ones), while a forward runs
        # the thread whose forward the hooks serve: calls in other threads may run the same model meanwhile
        self.thread: int | None = None

    @property
    def num_pending(self) -> int:
        """P: the kept tokens whose inputs wait for the next forward (the same number in every row)."""
        return next(iter(self.pending.values())).shape[1] if self.pending else 0

    def _feed_and_record(self, index: int, feeding: bool):
        def feed(module, args, kwargs):
            if threading.get_ident() != self.thread:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            waiting = self.pending.get(index) if feeding else None
            if waiting is not None:
                hidden = torch.cat([waiting.to(hidden.dtype), hidden], dim=1)
                mask = kwargs.get("attention_mask")
                if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # a 2-D padding mask over the new tokens
                    kwargs["attention_mask"] = torch.cat([mask.new_ones(mask.shape[0], waiting.shape[1]), mask], 1)
                args, kwargs = ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
            self.inputs[index] = hidden
            return args, kwargs
        return feed

    def _drop_pending_outputs(self, index: int):
        def drop(module, args, kwargs, output):
            if threading.get_ident() != self.thread:
                return None
            count = self.pending[index].shape[1]
            if isinstance(output, tuple):
                return (output[0][:, count:], *output[1:])
            return output[:, count:]
        return drop

    def begin(
        self,
        width: int,
        # [B, W] bool: each row's real tokens (a prefix of the forward's), or None when all are real
        real: torch.Tensor | None = None,
    ) -> None:
        """A forward over `width` tokens per row is next: at a step's first, keep the states before the step; keep
        them before this forward too when some rows have dummies in it; record the mixers' inputs. A forward after
        one with dummies first puts those rows back to their real tokens' states (the step's later forwards start
        from them)."""
        first = self.saved is None
        if first:
            self.saved = self._copy()
            self.forwards = []
        elif self.unfixed is not None:
            self._fix(*self.unfixed)
        self.unfixed = None
        self.before = None if real is None else self._copy()
        self.real, self.width = real, width
        self.thread = threading.get_ident()
        feeding = first and bool(self.pending)
        for index, (mixer, _) in self.mixers.items():
            self.hooks.append(mixer.register_forward_pre_hook(self._feed_and_record(index, feeding),
                                                              with_kwargs=True))
            if feeding:
                self.hooks.append(mixer.register_forward_hook(self._drop_pending_outputs(index), with_kwargs=True))

    def _copy(self) -> dict[int, dict[tuple[str, int], torch.Tensor]]:
        return {index: {key: state.clone() for key, state in layer.states().items()}
                for index, layer in self.layers.items()}

    def end(self) -> None:
        """The forward ran: its inputs join the step's."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.saved is None:
            return
        inputs, self.inputs = self.inputs, {}
        if set(inputs) != set(self.layers):
            missing = sorted(set(self.layers) - set(inputs))
            self.saved = None
            raise RuntimeError(f"RecurrentRollback: the mixers of layers {missing} did not run in the forward")
        self.forwards.append((inputs, self.real, self.width))
        if self.before is not None:
            self.unfixed = (self.before, inputs, self.real, len(self.forwards) == 1)
        self.before = None

    def _fix(
        self,
        before: dict[int, dict[tuple[str, int], torch.Tensor]],
        # {layer: [B, W, H]}: the forward's inputs (after the pending ones, if it was the step's first)
        inputs: dict[int, torch.Tensor],
        # [B, W] bool
        real: torch.Tensor,
        first: bool,
    ) -> None:
        """Rows with dummies in a forward: back to the states before it, advanced over their real tokens alone."""
        offset = self.num_pending if first else 0
        counts = [offset + count for count in real.sum(dim=1).tolist()]  # (one read, for a step's later forwards)
        self._redo(before, inputs, counts)

    def commit(
        self,
        # per row, the tokens it keeps of the step's (a chain's: its real ones in order, from the first)
        kept: Sequence[int],
        # [B, M] long or None: the region slot of each kept token, in order (None: the first ones)
        sources: torch.Tensor | None = None,
    ) -> None:
        """Every row that keeps fewer tokens than it fed in the step gets the states of its kept tokens (with the
        pending ones fed before them): the states before the step, advanced over the inputs its mixers had at those
        positions, now or in front of the next forward."""
        saved, forwards = self.saved, self.forwards
        self.saved, self.forwards = None, []
        if saved is None:
            return
        before = self.num_pending
        self.pending = {}
        self.unfixed = None
        single = len(forwards) == 1 and sources is None  # a row keeping all its real tokens keeps all the forward's
        if single:
            fed = [before + forwards[0][2]] * len(kept)
        else:  # per row, every real token the step fed (and the pending ones)
            fed = [before] * len(kept)
            for _, real, width in forwards:
                counts = [width] * len(kept) if real is None else real.sum(dim=1).tolist()  # (one read each)
                fed = [total + count for total, count in zip(fed, counts)]
        kept = [before + count for count in kept]
        short = [row for row, (count, total) in enumerate(zip(kept, fed)) if count < total]
        if not short:
            return
        inputs = {index: torch.cat([step[index] for step, _, _ in forwards], dim=1) for index in self.layers}
        if single and len(short) == len(kept) and len(set(kept)) == 1 and kept[0] <= MAX_PENDING_TOKENS:
            # every row keeps the same tokens: back to the step's start, the kept ones fed with the next forward
            for index, layer in self.layers.items():
                _set_rows(layer, saved[index])
            if kept[0]:
                self.pending = {index: hidden[:, : kept[0]] for index, hidden in inputs.items()}
            return
        positions = None
        if sources is not None:  # [B, P + M]: the pending inputs, then the kept slots' (after them)
            pending = torch.arange(before, device=sources.device).expand(sources.shape[0], -1)
            positions = torch.cat([pending, before + sources], dim=1)
        self._redo(saved, inputs, kept, positions, rows=short)

    def _redo(
        self,
        # the states to go back to, per layer
        states: dict[int, dict[tuple[str, int], torch.Tensor]],
        # {layer: [B, T, H]} the mixers' inputs
        inputs: dict[int, torch.Tensor],
        # per row, how many tokens it keeps
        kept: Sequence[int],
        # [B, >= max(kept)] long: the input positions of each row's kept tokens, in order; None: the first ones
        positions: torch.Tensor | None = None,
        # the rows to redo (default: those keeping fewer tokens than `inputs` holds)
        rows: Sequence[int] | None = None,
    ) -> None:
        """Put these rows' states back to `states` and advance them over their kept tokens' inputs, one mixer call
        per layer and number of kept tokens."""
        width = next(iter(inputs.values())).shape[1]
        rows = [row for row, count in enumerate(kept) if count < width] if rows is None else rows
        groups: dict[int, list[int]] = {}
        for row in rows:
            groups.setdefault(kept[row], []).append(row)
        for count, members in groups.items():
            picked = torch.tensor(members)
            for index, layer in self.layers.items():
                on_device = picked.to(layer.device)  # (layers may sit on several devices)
                _set_rows(layer, {key: state[on_device] for key, state in states[index].items()}, on_device)
                if count:
                    hidden = inputs[index]
                    chosen = picked.to(hidden.device)
                    taken = hidden[chosen, :count] if positions is None else \
                        hidden[chosen[:, None], positions.to(hidden.device)[chosen, :count]]
                    self._advance(index, layer, on_device, taken)

    def _advance(
        self,
        index: int,
        layer: RecurrentSlotLayer,
        # [G] long: the rows
        rows: torch.Tensor,
        # [G, n, H]: their mixer's inputs at their n kept positions
        hidden: torch.Tensor,
    ) -> None:
        """Run layer `index`'s mixer over these rows' kept tokens from their (restored) states, and keep the states it
        leaves."""
        view = LinearAttentionLayer(number_of_states=layer.number_of_states)
        load_states(view, {key: state[rows] for key, state in layer.states().items()})  # (indexing copies them)
        mixer, keyword = self.mixers[index]
        mixer(hidden, attention_mask=None, **{keyword: self.view.holding(index, view)})
        _set_rows(layer, layer_states(view), rows)

    def settle(self) -> None:
        """Advance the states over the pending tokens now (between steps), so they hold every kept token."""
        if self.saved is not None:
            raise RuntimeError("RecurrentRollback: settled in the middle of a step")
        pending, self.pending = self.pending, {}
        for index, hidden in pending.items():
            layer = self.layers[index]
            self._advance(index, layer, torch.arange(hidden.shape[0], device=layer.device), hidden)

    def select_rows(
        self,
        # [B'] long: the rows kept
        rows: torch.Tensor,
    ) -> None:
        """Rows are dropped between steps (their pending inputs with them)."""
        if self.saved is not None:
            raise RuntimeError("RecurrentRollback: rows dropped in the middle of a step")
        self.pending = {index: hidden[rows.to(hidden.device)] for index, hidden in self.pending.items()}
