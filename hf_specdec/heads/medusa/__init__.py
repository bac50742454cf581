"""Medusa heads: config, module, static trees, published layouts, Medusa-2 (heads + the target's LoRA)."""

from hf_specdec.heads.adapter import register_head
from hf_specdec.heads.medusa.config import MedusaConfig
from hf_specdec.heads.medusa.medusa2 import LORA_FOLDER, load_medusa2
from hf_specdec.heads.medusa.model import MedusaHeads
from hf_specdec.heads.medusa.tree import fit_tree

register_head(MedusaHeads)

__all__ = ["LORA_FOLDER", "MedusaConfig", "MedusaHeads", "fit_tree", "load_medusa2"]
