"""The drafters committed in this repository, for the two models it measures on, and loading them.

* `testbed`: the 12M test-bed target's draft model (`examples/testbed/draft`) and heads (`examples/heads/<kind>`);
* `smollm2`: SmolLM2-135M-Instruct's drafters (`examples/drafters/smollm2/<kind>`), trained for it on this
  repository's trainers from the target's own answers (each folder's README has the command and curves): a draft
  cut from its layers (`pruned_draft.py`: stored without the embeddings it shares with the target), Medusa heads,
  an EAGLE-1/2 head, an EAGLE-3 head and an MLP speculator.

`load_drafter(model, kind, target)` returns what `SpeculativeConfig` takes for the kind: a draft model for
`"draft"`, `MedusaHeads`, an `EagleHead` or an `MlpSpeculator` for the heads. Early exit needs no drafter:
`EARLY_EXIT_LAYER` is the layer measured to draft best from for a model (benchmarks/RESULTS.md, "Early exit and a
draft with another tokenizer").
"""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaForCausalLM, PreTrainedModel

from hf_specdec.heads import EagleHead, MedusaHeads, MlpSpeculator
from hf_specdec.pruned_draft import load_pruned_draft
from hf_specdec.testbed.loading import heads_dir, testbed_dir

MODELS = ("testbed", "smollm2")
KINDS = ("draft", "medusa", "eagle", "eagle3", "mlp_speculator")
# the exit layer early exit drafts from by default, per model, chosen with benchmarks/early_exit_layers.py: SmolLM2's
# first layers' guesses are rarely the whole model's (mean acceptance length at k = 4: 1.02 at layer 4, 1.03 at 8 and
# 12, 1.08 at 16, 1.16 at 20, 1.40 at 24 of 30), so its default is the shallowest layer whose drafts are accepted at
# a measurable rate
EARLY_EXIT_LAYER: dict[str, int] = {"smollm2": 24}
HEAD_CLASSES = {"medusa": MedusaHeads, "eagle": EagleHead, "eagle3": EagleHead, "mlp_speculator": MlpSpeculator}


def drafter_dir(model: str, kind: str) -> Path:
    """The committed folder of one drafter (it may not exist: `has_drafter` says; the test bed's heads raise
    `FileNotFoundError` then)."""
    _check_names(model, kind)
    if model == "testbed":
        return testbed_dir() / "draft" if kind == "draft" else heads_dir(kind)
    return testbed_dir().parent / "drafters" / "smollm2" / kind


def _check_names(model: str, kind: str) -> None:
    if model not in MODELS:
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")


def _marker(kind: str) -> str:
    """The file a folder holding a drafter of `kind` has: a draft model's config, or a head's adapter config."""
    return "config.json" if kind == "draft" else "adapter_config.json"


def has_drafter(model: str, kind: str) -> bool:
    try:
        folder = drafter_dir(model, kind)
    except FileNotFoundError:
        return False
    return (folder / _marker(kind)).is_file()


def load_drafter(model: str, kind: str, target: PreTrainedModel, folder: str | Path | None = None):
    """The committed drafter of `kind` for `model`, or another one of the same kind in `folder` (the committed
    folder's layout: a head's adapter folder as `hf-specdec train` writes it), in the target's dtype and on its
    device, in eval mode."""
    if folder is None:
        folder = drafter_dir(model, kind)
        if not has_drafter(model, kind):
            raise FileNotFoundError(f"no committed {kind} drafter for {model!r} at {folder}; train one with "
                                    "`hf-specdec train` (see that folder's README) or pass your own")
    else:
        _check_names(model, kind)
        folder = Path(folder)
        if not (folder / _marker(kind)).is_file():
            raise FileNotFoundError(f"folder {str(folder)!r}: no {_marker(kind)} there, so it holds no {kind} "
                                    "drafter; pass a folder laid out as the committed one")
    if kind == "draft":
        if model == "smollm2":
            return load_pruned_draft(folder, target)
        draft = LlamaForCausalLM.from_pretrained(folder, dtype=target.dtype, use_safetensors=True,
                                                 local_files_only=True)
        return draft.to(target.device).eval()
    heads = HEAD_CLASSES[kind].from_pretrained(folder)
    return heads.to(device=target.device, dtype=target.dtype).eval()
