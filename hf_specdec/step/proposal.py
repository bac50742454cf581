"""What a proposer offers for one step: a token tree per row, whose node 0 is the row's last committed token.

There is one shape: a chain of k draft tokens is the one-branch tree (`Proposal.chain`), so the engine verifies,
accepts and commits every proposal the same way. Whether it is a chain is a host fact (the tree's template), which
verification uses to pick the cheaper chain arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from hf_specdec.step.state import DecodeState
from hf_specdec.tree.template import TreeTemplate
from hf_specdec.tree.tree import TokenTree, template_tensors


@dataclass(frozen=True)
class Proposal:
    tree: TokenTree
    # per row, the depth of its deepest draft node, where the proposer drafts on the host and so knows it (n-gram
    # lookup, suffix decoding: a row with no match drafts nothing); None: every row drafted as deep as it was allowed
    host_depths: tuple[int, ...] | None = None
    # the draft positions the drafter computed, where more than the tree's depth (a drafter that stops a chain by its
    # confidence has computed the position it stopped at): the step costs drafting that many; None: the tree's depth
    drafted_positions: int | None = None

    @classmethod
    def chain(
        cls,
        # [B]: each row's last committed token (the root)
        root_token_ids: torch.Tensor,
        # [B, k]: entries at or after num_draft_tokens[b] are padding
        draft_token_ids: torch.Tensor,
        # [B]
        num_draft_tokens: torch.Tensor,
        # [B, k, V_target]: the distributions the drafts were sampled from; None for point-mass proposers
        draft_probs: torch.Tensor | None = None,
        # a host fact: every row has all k drafts (num_draft_tokens == k everywhere)
        dense: bool = False,
    ) -> Proposal:
        tokens = torch.cat([root_token_ids[:, None], draft_token_ids.to(root_token_ids.device)], dim=1)
        return cls.from_template(chain_template(draft_token_ids.shape[1]), tokens, num_draft_tokens, draft_probs,
                                 dense=dense)

    @classmethod
    def from_template(
        cls,
        template: TreeTemplate,
        # [B, N]: tokens in the template's node order (node 0 = each row's last committed token)
        token_ids: torch.Tensor,
        # [B]: draft tokens each row may take: nodes deeper than its budget are padding
        budget: torch.Tensor,
        # [B, N - 1, V_target] or None (point masses)
        draft_probs: torch.Tensor | None = None,
        # a host fact: every row's budget reaches the template's depth
        dense: bool = False,
    ) -> Proposal:
        """A tree of the template's shape, each row's nodes past its budget invalid (the template's depths are built
        once per template and device)."""
        depths = template_tensors(template, token_ids.device).depths
        valid = depths[None, :] <= budget.to(token_ids.device)[:, None]
        return cls(TokenTree.from_template(template, token_ids, valid, draft_probs, dense=dense))

    @classmethod
    def no_draft(cls, state: DecodeState) -> Proposal:
        """No draft: the step verifies each row's last committed token alone (the prefill's first token is chosen
        this way too)."""
        tree = TokenTree.from_template(chain_template(0), state.last_tokens()[:, None])
        return cls(tree, host_depths=(0,) * state.batch_size)

    def with_host_depths(self, depths, drafted_positions: int | None = None) -> Proposal:
        """This proposal, with each row's draft depth as the host knows it (see `host_depths`) and, where the
        drafter computed more positions than it drafted, how many (`drafted_positions`)."""
        return dataclasses.replace(self, host_depths=tuple(int(d) for d in depths),
                                   drafted_positions=drafted_positions)

    @property
    def num_nodes(self) -> int:
        """Verified positions per row: the root and the draft nodes."""
        return self.tree.num_nodes

    @property
    def draft_token_ids(self) -> torch.Tensor:
        """[B, N - 1]: the draft nodes' tokens (for a chain, the drafts in order)."""
        return self.tree.token_ids[:, 1:]

    @property
    def draft_probs(self) -> torch.Tensor | None:
        """[B, N - 1, V] or None: the distribution each draft node was drawn from (None: point masses)."""
        return self.tree.draft_probs

    @property
    def num_draft_tokens(self) -> torch.Tensor:
        """[B]: real draft nodes per row."""
        return self.tree.valid[:, 1:].sum(dim=1)

    def path_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, N, D] path tokens, [B, N] depths): the draft tokens from the root to every node, in depth order
        (what the logits processors see after the committed text at each node)."""
        tree = self.tree
        batch, nodes = tree.token_ids.shape
        depths = tree.depths
        drafts = tree.token_ids[:, 1:]
        if tree.is_chain:  # node j follows the first j drafts
            return drafts[:, None, :].expand(-1, nodes, -1), depths
        longest = max(tree.max_depth, 1)
        # ancestor a of node j (other than the root) at depth d goes to column d - 1; the rest to a spare column
        column = torch.where(tree.ancestors & (depths[:, None, :] > 0), depths[:, None, :] - 1, longest)
        path = tree.token_ids.new_zeros(batch, nodes, longest + 1)
        path.scatter_(2, column, tree.token_ids[:, None, :].expand(-1, nodes, -1))
        return path[:, :, :longest], depths


@functools.cache
def chain_template(length: int) -> TreeTemplate:
    return TreeTemplate.chain(length)
