"""MedusaConfig's checks."""

from __future__ import annotations

import pytest

from hf_specdec.heads import MedusaConfig


def test_medusa_config_checks_shared_lm_head_and_tree():
    with pytest.raises(ValueError, match="MedusaConfig.vocab_size: expected an int >= 1, got None"):
        MedusaConfig(hidden_size=8, vocab_size=None)
    assert MedusaConfig(hidden_size=8, vocab_size=None, shared_lm_head=True).vocab_size is None
    with pytest.raises(ValueError, match="MedusaConfig.shared_lm_head: expected a bool"):
        MedusaConfig(hidden_size=8, vocab_size=8, shared_lm_head="yes")
    with pytest.raises(ValueError, match="MedusaConfig.tree_paths: depth 3 needs as many heads, num_heads is 2"):
        MedusaConfig(hidden_size=8, vocab_size=8, num_heads=2, tree_paths=[[0], [0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="MedusaConfig.tree_paths: expected a list of rank paths forming a tree"):
        MedusaConfig(hidden_size=8, vocab_size=8, tree_paths=[[0, 1]])
    assert MedusaConfig(hidden_size=8, vocab_size=8, tree_paths=[(0,), (0, 0)]).tree_paths == [[0], [0, 0]]
