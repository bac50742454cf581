"""The draft model's dynamic tree: every node it feeds sees exactly its own ancestors."""

from __future__ import annotations

import copy
import itertools

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.ragged import RaggedKVCache
from tests.conftest import make_model


def test_dynamic_tree_nodes_see_exactly_their_ancestors(monkeypatch):
    """With a copy of the target as the draft, the draft's logits at every node fed at depth d are the target's
    logits after some root-to-node path through the nodes fed at depths 1..d-1; a node that missed an ancestor
    (or saw a stranger) would match no path."""
    target = make_model("llama")
    draft = copy.deepcopy(target)
    ids = torch.tensor([[5, 9, 17, 5, 9, 17, 5, 9]])
    levels: list[tuple[torch.Tensor, torch.Tensor]] = []  # per draft tree forward: fed tokens [w], logits [w, V]
    original = RaggedKVCache.forward

    def recording(self, input_ids, *args, **kwargs):
        logits = original(self, input_ids, *args, **kwargs)
        # the draft's tree forwards feed top_k = 3 nodes (the forward of the committed tokens before them feeds 2)
        if self.model is draft and input_ids.shape[1] == 3 and len(levels) < 3:
            levels.append((input_ids[0].clone(), logits[0].clone()))
        return logits

    monkeypatch.setattr(RaggedKVCache, "forward", recording)
    config = SpeculativeConfig(method="draft", draft_model=draft, top_k=3, depth=4, total_tokens=10)
    hf_specdec.generate(target, ids, speculative=config, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert len(levels) == 3  # the first proposal fed depths 1, 2 and 3
    prefix = torch.cat([ids, ids.new_tensor([[0]])], dim=1)  # placeholder for the first committed token
    with torch.no_grad():
        prefix[0, -1] = target(ids).logits[0, -1].argmax()
    for depth, (tokens, logits) in enumerate(levels, start=1):
        earlier = [level[0].tolist() for level in levels[: depth - 1]]
        for token, node_logits in zip(tokens.tolist(), logits):
            paths = [list(p) + [token] for p in itertools.product(*earlier)]
            with torch.no_grad():
                candidates = target(torch.cat([prefix.expand(len(paths), -1), torch.tensor(paths)], dim=1)).logits[:, -1]
            distance = (candidates - node_logits).abs().amax(dim=-1).min()
            assert distance < 1e-4, f"depth {depth} token {token}: no root-to-node path gives its logits ({distance})"
