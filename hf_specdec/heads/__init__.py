"""Draft heads that read the target's hidden state: Medusa (EAGLE follows)."""

from hf_specdec.heads.medusa import MedusaConfig, MedusaHeads

__all__ = ["MedusaConfig", "MedusaHeads"]
