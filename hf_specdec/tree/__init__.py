"""Token trees: static shapes from path lists, and the batched trees a verify step checks."""

from hf_specdec.tree.template import MAX_TREE_NODES, TreeTemplate
from hf_specdec.tree.tree import TokenTree

__all__ = ["MAX_TREE_NODES", "TokenTree", "TreeTemplate"]
