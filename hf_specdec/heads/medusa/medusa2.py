"""Medusa-2: heads trained together with a LoRA of the target. The folder holds the heads (our adapter folder) and
the target's peft LoRA adapter in `lora/`; loading merges the LoRA into the target, so `generate` runs on a plain
transformers model."""

from __future__ import annotations

from pathlib import Path

from peft import PeftModel
from torch import nn

from hf_specdec.heads.adapter import CONFIG_NAME
from hf_specdec.heads.medusa.model import MedusaHeads

LORA_FOLDER = "lora"  # the target's peft LoRA adapter, beside the heads


def load_medusa2(folder: str | Path, base_model: nn.Module) -> tuple[nn.Module, MedusaHeads]:
    """A Medusa-2 folder (heads + `lora/`, as `hf-specdec train medusa --stage 2` writes it) on `base_model`: the
    LoRA is applied through peft and merged, so `generate` runs on a plain transformers model; returns
    (merged model, heads). `base_model` is changed in place (merging writes into its weights)."""
    folder = Path(folder)
    if not (folder / LORA_FOLDER / CONFIG_NAME).is_file():
        raise ValueError(f"load_medusa2: folder: no LoRA adapter at {folder / LORA_FOLDER} (expected {CONFIG_NAME}); "
                         "for Medusa-1 heads use MedusaHeads.from_pretrained")
    heads = MedusaHeads.from_pretrained(folder)
    model = PeftModel.from_pretrained(base_model, folder / LORA_FOLDER).merge_and_unload()
    heads.check_target(model)
    return model.eval(), heads
