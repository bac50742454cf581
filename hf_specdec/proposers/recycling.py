"""Token recycling (arXiv 2408.08696): drafts from the candidates the target scored at earlier steps, no drafter.

Every verify forward scores the whole vocabulary at every verified node, and decoding keeps one token of it. Token
recycling keeps the rest: for each token id, the `RECYCLED_CANDIDATES` tokens the target scored highest after it
the last time it was verified (`RecycledTokens`, a [V, K] table on the target's device). A step drafts a static
token tree from the table: the node at rank path (r0, r1, ...) is the root's rank-r0 successor, then that token's
rank-r1 successor, and so on (`tree_paths`, as Medusa's; by default the `tree_total_tokens` paths of highest prior
acceptance, `recycling_tree`). After verification, the table row of every verified node's token takes that node's
top candidates: every node, accepted or not, since a row is the target's view of what follows the token in some
recent context. The table lives as long as the target in the process, so a later call starts warm (the paper's
hot start), and every row of a batch reads and feeds the same table. A call's prompt seeds it before the first
step: each prompt token's row takes the tokens that followed it in the prompt first (the most recent first), its
recycled candidates after them (`RecycledTokens.seed`): what a prompt lookup of one token would draft, at no
forward's cost, where the target's own candidates for the prompt were never computed (the prefill scores only its
last position).

Drafts are point masses chosen from earlier steps' scores only (never from the scores of the positions being
decided), so verification keeps greedy output identical to plain `generate` and sampling exact. Drafting is a
gather per tree depth and the update one top-k and one scatter per step, all on the device: no host sync in a step
(the prompt's seed reads and writes the rows it touches once per call).

The adaptive schedule learns how well the tree would do for rows that decode plainly without drafting it
(`lookahead`: the tree each such row would get, read with the step's one host read, walked down by the tokens the
row then emits), so a row turns drafting back on as soon as the table's guesses start to hold. It also knows before
each step which rows have no draft at all (`draft_depths`): the table's rows written so far are mirrored on the host
(`RecycledTokens.filled`, from the prompt's seed and the verified tokens each step ships back with its host read),
and a row whose last token has no row would verify a tree of unseen nodes, which the target never accepts (a call's
first steps on an empty table: on one MT-bench question, 7 drafting steps of 63 with nothing accepted).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from hf_specdec.config import DEFAULT_RECYCLING_NODES, RECYCLED_CANDIDATES, SpeculativeConfig
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.proposers.host_text import HostText
from hf_specdec.schedule.lookahead import ShippedTrees
from hf_specdec.step import DecodeState, Proposal
from hf_specdec.step.state import HostView
from hf_specdec.tree.template import TreeTemplate, level_ends, likeliest_rank_paths, up_to_depth
from hf_specdec.tree.tree import TokenTree, template_tensors

# how often the rank-r candidate was the next token, r = 0..7, at the root of 16 greedy 128-token answers of
# SmolLM2-135M-Instruct to Spec-Bench questions and coding requests, with the table kept across them and no prompt
# seeding it (`python benchmarks/recycling_replay.py record`, then `replay --no-prompt-seed`): the default tree keeps
# the paths whose product of these is highest
RANK_PRIOR = (0.171, 0.084, 0.039, 0.017, 0.013, 0.011, 0.006, 0.007)


def recycling_tree(num_draft_nodes: int, max_depth: int) -> TreeTemplate:
    """The `num_draft_nodes` rank paths of at most `max_depth` tokens with the highest product of `RANK_PRIOR` (the
    same prior at every depth)."""
    return TreeTemplate.from_paths(likeliest_rank_paths([RANK_PRIOR] * max_depth, num_draft_nodes))


class RecycledTokens:
    """[V, K] per token id, the top-K tokens the target scored after it when it was last verified (-1: not yet
    seen), on the target's device, plus a spare row that absorbs the updates of padding nodes."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.successors = torch.full((vocab_size + 1, RECYCLED_CANDIDATES), -1, dtype=torch.long, device=device)
        # [V + 1] on the host: the rows written (seeded, or updated by the steps `fill` was told of)
        self.filled = np.zeros(vocab_size + 1, dtype=bool)

    def fill(
        self,
        # [...] int: the rows an update wrote (`update`'s answer, read back after the step that wrote them)
        rows: np.ndarray,
    ) -> None:
        """Tell the host which rows an update wrote (the spare row is never read)."""
        self.filled[rows] = True

    def update(
        self,
        # [B, N]: the verified nodes' tokens
        token_ids: torch.Tensor,
        # [B, N] bool: nodes whose scores count (real nodes of unfinished rows)
        counted: torch.Tensor,
        # [B, N, V]: the target's processed scores at every node
        scores: torch.Tensor,
    ) -> torch.Tensor:
        """Returns [B, N] the rows written (the spare row for nodes not counted)."""
        top = scores.topk(RECYCLED_CANDIDATES, dim=-1).indices  # [B, N, K]
        rows = torch.where(counted, token_ids, self.vocab_size)  # padding goes to the spare row
        self.successors.index_copy_(0, rows.reshape(-1), top.reshape(-1, RECYCLED_CANDIDATES))
        return rows

    def seed(self, prompts: list[np.ndarray]) -> None:
        """Each prompt token's row starts with the tokens that followed it in the prompts (the most recent first),
        then its candidates before, the same ones once, up to RECYCLED_CANDIDATES. Once per call, on the host: one
        read and one write of the rows the prompts touch."""
        followers: dict[int, list[int]] = {}
        for tokens in reversed(prompts):  # the last pair first: the most recent follower leads
            for token, follower in zip(tokens[-2::-1].tolist(), tokens[:0:-1].tolist()):
                if not (0 <= token < self.vocab_size and 0 <= follower < self.vocab_size):
                    continue  # an id past the scores' width (a padded embedding) is never drafted
                seen = followers.setdefault(token, [])
                if len(seen) < RECYCLED_CANDIDATES and follower not in seen:
                    seen.append(follower)
        if not followers:
            return
        self.filled[list(followers)] = True
        ids = torch.tensor(list(followers), dtype=torch.long, device=self.successors.device)
        before = self.successors[ids].tolist()
        rows = []
        for first, old in zip(followers.values(), before):
            row = (first + [t for t in old if t >= 0 and t not in first])[:RECYCLED_CANDIDATES]
            rows.append(row + [-1] * (RECYCLED_CANDIDATES - len(row)))
        self.successors.index_copy_(0, ids, torch.tensor(rows, dtype=torch.long).to(self.successors.device))


# one table per target model and vocabulary size, for the life of the model (a later call starts warm)
_TABLES: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, str], RecycledTokens]] = \
    weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def recycled_tokens(target: torch.nn.Module, vocab_size: int, device: torch.device) -> RecycledTokens:
    """The target's table for this vocabulary size and device (made empty on first use)."""
    with _TABLES_LOCK:
        tables = _TABLES.setdefault(target, {})
        key = (vocab_size, str(device))
        if key not in tables:
            tables[key] = RecycledTokens(vocab_size, device)
        return tables[key]


def forget_recycled_tokens(target: torch.nn.Module) -> None:
    """Empty the target's tables: its next call with method='recycling' starts cold, as the first one did."""
    with _TABLES_LOCK:
        _TABLES.pop(target, None)


class RecyclingProposer(Proposer):
    reads_target_scores = True
    # the adaptive schedule checks the tree a plainly decoding row would get against what it emits (`lookahead`)
    looks_ahead = True
    reads_emitted_tokens = True
    # a row whose last token has no row in the table yet has no draft: the schedule knows it before deciding
    knows_draft_depths = True

    def __init__(self, config: SpeculativeConfig, target: torch.nn.Module) -> None:
        self.target = target
        if config.tree_paths is not None:
            self.template = TreeTemplate.from_paths(config.tree_paths)
        else:
            nodes = DEFAULT_RECYCLING_NODES if config.tree_total_tokens is None else config.tree_total_tokens
            self.template = recycling_tree(nodes, config.num_speculative_tokens)
        # [N - 1] the template without its root, for lookahead trees: node i + 1's parent, -1 for the root's children
        self.lookahead_parents = np.asarray(self.template.parents[1:], dtype=np.int64) - 1
        self.table: RecycledTokens | None = None
        # each row's prompt (no padding), seeded into the table at the first scores (which say its size and device)
        self.prompts: list[np.ndarray] = []
        # the last step's verified tokens, not yet told to the table's host view (`RecycledTokens.fill`): their
        # index among the step's shipments (`DecodeState.ship`) and the host view before the read that brings them
        self.unfilled: tuple[int, HostView] | None = None

    def draft_depth(self, config: SpeculativeConfig) -> int:
        return self.template.max_depth

    def num_nodes(self, config: SpeculativeConfig) -> int:
        return self.template.num_nodes

    def start(
        self,
        state: DecodeState,
        # [B, P] or None
        attention_mask: torch.Tensor | None,
    ) -> None:
        text = HostText(state, attention_mask)
        self.prompts = [text.row(row) for row in range(state.batch_size)]

    def _table(self, scores: torch.Tensor) -> RecycledTokens:
        if self.table is None:
            self.table = recycled_tokens(self.target, scores.shape[-1], scores.device)
            self.table.seed(self.prompts)
        return self.table

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        budget = state.draft_budget()  # [B]
        # a step the schedule narrows drafts the tree's levels it allows (under static shapes, every level)
        template = self.template if self.fixed_shapes else up_to_depth(self.template, state.step_width(
            self.template.max_depth))
        structure = template_tensors(template, state.sequences.device)
        tokens = self._tree_tokens(template, state.last_tokens())
        # a node is real when its token was seen (then so was every ancestor's) and it is within the row's budget
        valid = (tokens >= 0) & (structure.depths[None, :] <= budget[:, None])
        return Proposal(TokenTree.from_template(template, tokens.clamp(min=0), valid))

    def _tree_tokens(
        self,
        template: TreeTemplate,
        # [R]: each row's last token, the tree's root
        roots: torch.Tensor,
    ) -> torch.Tensor:
        """[R, N] the token of each node of `template` for each row, read from the table (-1: not seen yet)."""
        structure = template_tensors(template, roots.device)
        tokens = roots.new_full((roots.shape[0], template.num_nodes), -1)
        tokens[:, 0] = roots
        if self.table is not None:  # before the first verify forward nothing was seen: no drafts
            ends = level_ends(template)
            for start, end in zip(ends[:-1], ends[1:]):  # one depth at a time, its parents' tokens known
                parent_tokens = tokens[:, structure.parents[start:end]]  # [R, n_d]
                found = self.table.successors[parent_tokens.clamp(min=0), structure.ranks[start:end]]
                tokens[:, start:end] = torch.where(parent_tokens >= 0, found, -1)
        return tokens

    def draft_depths(self, state: DecodeState) -> np.ndarray:
        """[B]: the template's depth for a row whose last token has a row in the table, else 0 (its whole tree
        would be unseen nodes, which the target never accepts). From the step's host read: the last token each row
        emitted, and the rows the table wrote up to the last step."""
        self._fill(state)
        host = state.host
        if self.table is None or host.emitted is None:
            return np.zeros(len(host.lengths), dtype=np.int64)
        counts = np.asarray(host.num_emitted)
        last = host.emitted[np.arange(len(counts)), np.maximum(counts - 1, 0)]
        vocab = self.table.vocab_size  # its row of `filled` is the spare row's: never a token's
        seen = (counts > 0) & (last < vocab) & self.table.filled[np.clip(last, 0, vocab)]
        return np.where(seen, self.template.max_depth, 0)

    def _fill(self, state: DecodeState) -> None:
        """Tell the table's host view the rows the last step's update wrote (shipped with that step's host read,
        unless the step ended before it)."""
        if self.unfilled is not None and self.table is not None:
            index, before = self.unfilled
            if state.host is not before:
                self.table.fill(state.host.shipped[index])
        self.unfilled = None

    def finish(self, state: DecodeState | None) -> None:
        if state is not None:  # the last step's rows reach the table's host view, for later calls
            self._fill(state)

    @torch.no_grad()
    def lookahead(self, state: DecodeState, rows: list[int]) -> ShippedTrees:
        """The whole tree `propose` would draft for each row now, shipped with the step's host read (built for
        every row: one shape per call). Its nodes not seen yet are -1, never matched: a proposal verifies them too
        (the step costs its width), and the schedule counts them as rejected drafts, not as a row without one."""
        tokens = self._tree_tokens(self.template, state.last_tokens())  # [B, N]
        return ShippedTrees(state.ship(tokens[:, 1:]), self.lookahead_parents)

    @torch.no_grad()
    def observe_scores(
        self,
        state: DecodeState,
        # the verified tree (this proposer's, or the root alone on a step it skipped)
        tree: TokenTree,
        # [B, N, V]: the target's processed scores at every node
        scores: torch.Tensor,
    ) -> None:
        counted = tree.valid & ~state.finished[:, None]
        self._fill(state)
        written = self._table(scores).update(tree.token_ids, counted, scores)
        self.unfilled = (state.ship(written), state.host)


def _build(config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> Proposer:
    return RecyclingProposer(config, target)


register_proposer("recycling", _build)
