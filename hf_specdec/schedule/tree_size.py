"""`SpeculativeConfig(tree_total_tokens="auto")`: the size of an EAGLE-2 dynamic tree (or of n-gram lookup's trie of
matched continuations) from what verifying costs on this model, device, dtype and batch size.

A tree pays while its extra nodes cost little to verify: the chain of depth k already costs a forward of k + 1
tokens per row, and each further node earns at most its chance of being accepted. Where a forward's cost is flat
in its width (typically a GPU at small batch, where a forward reads the weights once whatever its width; a CPU in
bfloat16 for SmolLM2-135M up to about 9 tokens, `benchmarks/results/forward_cost_smollm2_bf16_cpu.txt`) a tree
adds acceptance nearly for free; where it grows with every token (a CPU in float32, or a large batch) nodes past the
chain cost about what they bring. So the tree keeps the most nodes whose verify forward costs at most
`TREE_COST_TOLERANCE` more than the chain's, and never fewer than the chain's k.

The costs are measured once per (model, dtype, device, batch size, chain depth) in a process, before the first call
that asks: a cached context of `CONTEXT_TOKENS` random tokens (one row prefilled, repeated to the batch), then
forwards of growing widths over it, each timed beside the chain's in `ROUNDS` pairs (widths grow until one costs
more than the tolerance allows), on the model's own attention path. It costs one row's prefill of the context and
six forwards per width timed, once per key. The output never depends on it, only the tree's size, so every call
stays exactly as lossless as with a fixed size.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time
import weakref
from collections.abc import Callable

import torch
from transformers import DynamicCache

from hf_specdec.cache.naming import CACHE_KWARG

# a tree's verify forward may cost this much more than the chain's
TREE_COST_TOLERANCE = 0.10
# the most nodes an automatic tree keeps (EAGLE-2's GPU setting verifies 60)
MAX_AUTO_TREE_NODES = 64
# cached tokens under the timed forwards, and pairs of timed forwards (the chain's, a wider one's) per width
CONTEXT_TOKENS = 128
ROUNDS = 3

# model -> {(dtype, device, batch size, chain depth): {verify width in tokens: seconds}}, from one measurement
_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tree_size_for_costs(
    # verify forward width (tokens per row) -> seconds, measured at the widths the caller timed (the chain's among them)
    costs: dict[int, float],
    depth: int,
    max_nodes: int,
    tolerance: float = TREE_COST_TOLERANCE,
) -> int:
    """The most draft nodes n in [depth, max_nodes] whose verify forward (n + 1 tokens) costs at most `tolerance`
    more than the chain's (depth + 1 tokens); between measured widths the cost is read off the straight line between
    them, and past the widest measured one a node is not taken."""
    if depth < 1 or max_nodes < depth:
        raise ValueError(f"tree_size_for_costs: expected 1 <= depth <= max_nodes, got depth {depth}, max {max_nodes}")
    if depth + 1 not in costs:
        raise ValueError(f"tree_size_for_costs: the chain's width {depth + 1} was not measured ({sorted(costs)})")
    budget = costs[depth + 1] * (1.0 + tolerance)
    widths = sorted(w for w in costs if w >= depth + 1)
    best = depth
    for low, high in itertools.pairwise(widths):
        if costs[high] <= budget:
            best = high - 1
            continue
        if costs[low] < budget:  # the budget runs out between the two: where the line crosses it
            crossing = low + (budget - costs[low]) * (high - low) / (costs[high] - costs[low])
            best = max(best, int(crossing) - 1)
        break
    return min(best, max_nodes)


def measure_verify_costs(
    model: torch.nn.Module,
    batch_size: int,
    widths: list[int],
    stop_above: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[int, float]:
    """Seconds of one forward of `width` new tokens per row over a cache of `CONTEXT_TOKENS` tokens, for each of
    `widths` in ascending order; stops after the first width costing more than `stop_above` times the first one's.

    The first width is the reference: after a warm-up forward, each further width is timed in `ROUNDS` pairs of
    forwards (the reference's, then its own, back to back) and costs the median of the pairs' ratios times the
    reference's median time. Timing a width beside the reference makes its ratio proof against the machine slowing
    down between widths (on a 2-core CPU, SmolLM2-135M in bfloat16 at batch 1, timing each width alone three times
    chose 8 to 10 nodes in six processes; in three pairs, 8 or 9: `benchmarks/results/tree_size_spread_*`)."""
    device = model.device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, CONTEXT_TOKENS), generator=generator).to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    reference, *others = sorted(widths)
    with torch.no_grad():
        prefix = DynamicCache(config=model.config)
        model(input_ids=context, use_cache=True, **{CACHE_KWARG: prefix})
        prefix.batch_repeat_interleave(batch_size)  # every row the same context: one row's prefill

        def seconds(width: int) -> float:  # one forward of `width` new tokens per row over a fresh copy of it
            tokens = torch.randint(0, vocab, (batch_size, width), generator=generator).to(device)
            positions = torch.arange(CONTEXT_TOKENS, CONTEXT_TOKENS + width, device=device).expand(batch_size, -1)
            cache = copy.deepcopy(prefix)  # a fresh context each time (a sliding-window layer cannot crop)
            sync()
            start = clock()
            model(input_ids=tokens, position_ids=positions, use_cache=True, **{CACHE_KWARG: cache})
            sync()
            return clock() - start

        seconds(reference)  # warm-up
        reference_times: list[float] = []
        ratios: dict[int, float] = {}
        for width in others:
            pairs = [(seconds(reference), seconds(width)) for _ in range(ROUNDS)]
            reference_times += [first for first, _ in pairs]
            ratios[width] = statistics.median(second / first for first, second in pairs)
            if stop_above is not None and ratios[width] > stop_above:
                break
        reference_times = reference_times or [seconds(reference) for _ in range(ROUNDS)]  # the chain's alone
    base = statistics.median(reference_times)
    return {reference: base, **{width: ratio * base for width, ratio in ratios.items()}}


def ladder(depth: int, max_nodes: int) -> list[int]:
    """The verify widths timed for a tree of at most `max_nodes` nodes over a chain of `depth`: the chain's, then
    about a third more each rung, up to max_nodes + 1."""
    widths, width = [depth + 1], depth + 1
    while width < max_nodes + 1:
        width = min(max_nodes + 1, max(width + 1, round(width * 4 / 3)))
        widths.append(width)
    return widths


def auto_tree_size(model: torch.nn.Module, batch_size: int, depth: int, max_nodes: int,
                   measure: Callable[..., dict[int, float]] = measure_verify_costs) -> int:
    """The tree size for `model` at this batch size (`tree_size_for_costs` on costs measured once per process)."""
    max_nodes = min(max_nodes, MAX_AUTO_TREE_NODES)
    if max_nodes <= depth:
        return max_nodes
    key = (model.dtype, str(model.device), batch_size, depth)
    known = _MEASURED.setdefault(model, {}).get(key)
    widths = ladder(depth, max_nodes)
    if known is None or (max(known) < widths[-1] and _affordable(known, depth)):  # a larger tree may pay now
        known = _MEASURED[model][key] = measure(model, batch_size, widths, stop_above=1.0 + TREE_COST_TOLERANCE)
    return tree_size_for_costs(known, depth, max_nodes)


def _affordable(costs: dict[int, float], depth: int) -> bool:
    """Whether the widest width measured was still within the tolerance (so wider ones may be too)."""
    return costs[max(costs)] <= costs[depth + 1] * (1.0 + TREE_COST_TOLERANCE)
