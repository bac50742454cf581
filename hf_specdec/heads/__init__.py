"""Draft heads that read the target's hidden states: Medusa and EAGLE."""

from hf_specdec.heads.eagle import EagleConfig, EagleHead
from hf_specdec.heads.files import load_medusa2
from hf_specdec.heads.medusa import MedusaConfig, MedusaHeads

__all__ = ["EagleConfig", "EagleHead", "MedusaConfig", "MedusaHeads", "load_medusa2"]
