"""What verification keeps of a proposal, in vLLM's vocabulary: a row's output is its *accepted* draft tokens, then
one more token, *recovered* (drawn where a draft was rejected) or *bonus* (after every draft on the path was
accepted). The path names the node each output token was chosen at, so the caches keep exactly the accepted
nodes' keys and values, and the outputs (scores, hidden states) come from the right positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class VerificationResult:
    # [B, D + 1]: accepted draft tokens, then the recovered or bonus token, then PLACEHOLDER_TOKEN_ID
    output_token_ids: torch.Tensor
    # [B]: draft tokens accepted per row (the row emits num_accepted + 1 tokens)
    num_accepted: torch.Tensor
    # [B, D + 1]: the node the walk stood on when it chose each output token (the root first; it repeats once the
    # walk stopped). For a chain, node j is the j-th position.
    path_nodes: torch.Tensor
    # N: nodes of the verified tree
    num_nodes: int

    @classmethod
    def chain(
        cls,
        # [B, k + 1]
        output_token_ids: torch.Tensor,
        # [B]
        num_accepted: torch.Tensor,
    ) -> VerificationResult:
        """The result over a chain of k drafts: output token j was chosen at position j."""
        width = output_token_ids.shape[1]
        path = torch.arange(width, device=output_token_ids.device).expand(output_token_ids.shape[0], -1)
        return cls(output_token_ids=output_token_ids, num_accepted=num_accepted, path_nodes=path, num_nodes=width)

    @property
    def kept_nodes(self) -> torch.Tensor:
        """[B, N] bool: the root and the accepted nodes."""
        return self.path_prefix(self.num_accepted + 1)

    def path_prefix(
        self,
        # [B]: how many nodes of its path each row keeps
        num_kept: torch.Tensor,
    ) -> torch.Tensor:
        """[B, N] bool: the first `num_kept` nodes of each row's path."""
        steps = torch.arange(self.path_nodes.shape[1], device=self.path_nodes.device)[None, :]
        spare = self.num_nodes  # unkept steps go to a column dropped below
        index = torch.where(steps < num_kept[:, None], self.path_nodes, spare)
        kept = torch.zeros(index.shape[0], self.num_nodes + 1, dtype=torch.bool, device=index.device)
        return kept.scatter_(1, index, True)[:, : self.num_nodes]
