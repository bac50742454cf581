"""Fused kernels (Triton), each next to the torch reference it is tested against."""

from hf_specdec.kernels.tree_mask import (
    ancestor_bits_from_parents,
    tree_attention_mask,
    tree_attention_mask_reference,
    tree_attention_mask_triton,
)

__all__ = [
    "ancestor_bits_from_parents",
    "tree_attention_mask",
    "tree_attention_mask_reference",
    "tree_attention_mask_triton",
]
