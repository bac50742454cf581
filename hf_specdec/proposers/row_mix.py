"""A step whose rows draft with different proposers (`method="auto"` choosing per row, a hybrid's suffix and
fallback rows): each proposer drafts for its own rows, the step verifies every row's tree in one forward
(`hf_specdec.tree.merge`), and each proposer commits what it drafted.

A proposer sees the step's result as over its own tree: its rows as verified (a merged tree keeps each row's nodes
in its tree's order, so node indices agree), and the other rows as rows whose draft was rejected at once (it drafted
nothing there that the target kept; a proposer with a cache catches up with their tokens as after a step it
skipped).
"""

from __future__ import annotations

import dataclasses

import torch

from hf_specdec.proposers.base import Proposer
from hf_specdec.step import DecodeState, Proposal, RowSet, VerificationResult


def commit_own_rows(
    proposer: Proposer,
    state: DecodeState,
    result: VerificationResult,
    # the proposer's own proposal this step
    proposal: Proposal,
    # the rows that drafted with this proposer
    own: RowSet,
) -> None:
    """`proposer.commit` with the result over its own rows and tree (see the module docstring)."""
    nodes, columns = proposal.tree.num_nodes, proposal.tree.max_depth + 1
    kept = VerificationResult(
        output_token_ids=result.output_token_ids[:, :columns],
        num_accepted=torch.where(own.mask, result.num_accepted, 0),
        path_nodes=torch.where(own.mask[:, None], result.path_nodes[:, :columns], 0).clamp(max=nodes - 1),
        num_nodes=nodes,
    )
    host = state.host
    mine = [n if own_row else 0 for n, own_row in zip(host.num_accepted, own.host)]
    state.host = dataclasses.replace(host, num_accepted=mine)
    try:
        proposer.commit(state, kept)
    finally:
        state.host = host
