"""`SpeculativeConfig(draft_quantization="int8")`: the drafter reads int8 copies of its weights in narrow calls.

A drafter at batch 1 on a CPU spends its time reading weights (`hf_specdec.kernels.int8_linear`), so a view of it
whose linear layers (`nn.Linear`, transformers' `Conv1D`), and whose lm_head at a token map, are `Int8Linear`s
drafts faster. Only the drafts change:
verification keeps exactly the target's tokens (greedy) or its distribution (sampling, where the drafts' own
probabilities, computed with the int8 weights, go to verification), so the option is as lossless as any drafter.

The view shares every tensor with the drafter and adds the int8 copies (half the size of bfloat16 weights); the
drafter itself is never modified. Views are kept per drafter and rebuilt when one of its weights changes (in
place, or replaced), so later calls reuse them.
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_specdec.heads.token_map import TokenMapLMHead
from hf_specdec.kernels.int8_linear import INNER_MULTIPLE, Int8Linear, int8_kernel_available

_LOCK = threading.Lock()
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> (signature, view)


# the proposers' `compile_refusal` with int8 copies
COMPILE_REFUSAL = ("SpeculativeConfig.draft_quantization='int8' runs the drafter eagerly (its int8 kernel is picked "
                   "per call from the call's shape and alignment); drop the compile config, or draft_quantization")


def int8_view(
    module: nn.Module,
    # how the drafter is named in errors
    role: str = "the drafter",
) -> nn.Module:
    """`module` with its linear layers (`nn.Linear`, transformers' `Conv1D`) and `TokenMapLMHead`s reading int8
    copies in narrow calls: a view sharing every other module and tensor, the same view while its weights are
    unchanged. Raises ValueError where the kernel would never run, so the option would do nothing: no kernel in this
    torch, a module off the CPU, no layer of an inner size the kernel takes (a multiple of 16)."""
    where = f"SpeculativeConfig.draft_quantization='int8': {role}"
    if not int8_kernel_available():
        raise ValueError(f"{where}: this torch {torch.__version__} has no int8 weight-only matmul "
                         "(torch.ops.aten._weight_int8pack_mm); upgrade torch or leave draft_quantization None")
    device = next(iter(module.state_dict().values())).device
    if device.type != "cpu":
        raise ValueError(f"{where} is on {device}; the int8 kernel serves drafters on a CPU: leave "
                         "draft_quantization None on a GPU")
    signature = _signature(module)
    with _LOCK:
        kept = _VIEWS.get(module)
        if kept is not None and kept[0] == signature:
            return kept[1]
        view = _view(module, {})
        if not any(isinstance(leaf, Int8Linear) and leaf.in_features % INNER_MULTIPLE == 0 for leaf in view.modules()):
            raise ValueError(f"{where} ({type(module).__name__}) has no "
                             f"linear layer of an inner size the int8 kernel takes (a multiple of {INNER_MULTIPLE}), "
                             "so nothing would be quantized; leave draft_quantization None")
        _VIEWS[module] = (signature, view)
        return view


def _quantizable(leaf: nn.Module) -> bool:
    return isinstance(leaf, (nn.Linear, Conv1D, TokenMapLMHead))


def _signature(module: nn.Module) -> tuple:
    """Which weights the view copies, and their versions: a new one means a new view."""
    return tuple((id(leaf), id(leaf.weight), leaf.weight._version) for leaf in module.modules() if _quantizable(leaf))


def _view(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """The view of `module` (`memo`: views made so far, so a module reached twice gets one view)."""
    if id(module) in memo:
        return memo[id(module)]
    if isinstance(module, nn.Linear):
        view = Int8Linear.from_linear(module)
    elif isinstance(module, Conv1D):  # x @ weight + bias, weight [in, out]
        view = Int8Linear(module.weight.t(), module.bias)
    else:
        children = {name: None if child is None else _view(child, memo) for name, child in module._modules.items()}
        projection = Int8Linear(module.weight, module.bias) if isinstance(module, TokenMapLMHead) else None
        if projection is None and all(children[name] is child for name, child in module._modules.items()):
            view = module  # nothing to copy below it
        else:
            view = copy.copy(module)
            view._modules = children  # its own module table: the original's stays as it is
            if projection is not None:
                view.projection = projection
    memo[id(module)] = view
    return view
