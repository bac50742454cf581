"""The committed text of every row (`DecodeState`), shared by the engine and the proposers, what the host knows of
it (`HostView`), and what `generate` prepared for the prompt besides its token ids (`PromptInputs`).

Device facts stay on the device and host facts on the host: the state lives in tensors, and once per step
`DecodeState.report` copies the few per-row numbers the host needs (lengths, finished rows, what the step emitted)
in one transfer, the step's one host sync. Every host decision (draft widths, budgets, which rows to drop, when to
stop) reads `DecodeState.host`, never the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class HostView:
    """Per-row facts on the host, as of the last `DecodeState.report`."""

    # committed length of each row (prompt and padding included)
    lengths: list[int]
    finished: list[bool]
    # tokens each row emitted in the last step, and draft tokens it accepted
    num_emitted: list[int]
    num_accepted: list[int]
    # [B, W]: the last step's output tokens (row b emitted its first num_emitted[b]); None unless asked for
    emitted: np.ndarray | None = None
    # per row, whether it emitted a token sampled from no distribution (`unsampleable_rows`); None when greedy
    unsampleable: list[bool] | None = None
    # draft tokens each row verified in the last step; None when the step drafted nothing
    num_draft_tokens: list[int] | None = None
    # [B, X_i] each: what the step shipped with its host read (`DecodeState.ship`), in the order shipped
    shipped: tuple[np.ndarray, ...] = ()

    @classmethod
    def start(cls, batch_size: int, prompt_length: int) -> HostView:
        return cls([prompt_length] * batch_size, [False] * batch_size, [0] * batch_size, [0] * batch_size)


@dataclass(frozen=True)
class RowSet:
    """Some of a step's rows (those one proposer drafts for): whether each row is one of them, on the host and the
    same on the device."""

    host: tuple[bool, ...]
    # [B] bool on the device
    mask: torch.Tensor


@dataclass
class DecodeState:
    """The committed tokens of every row.

    Row b holds its prompt (with its padding, left or right) and its committed tokens in
    `sequences[b, :lengths[b]]`, exactly the row plain `generate` would have built (padding included). The columns
    after `lengths[b]` hold `pad_token_id`, except while a step's emitted tokens wait there to be committed.
    """

    # [B, capacity]
    sequences: torch.Tensor
    # [B]: committed length of each row, left padding and prompt included
    lengths: torch.Tensor
    # [B]: left-padding tokens at the start of each row
    pad_lengths: torch.Tensor
    # [B] bool
    finished: torch.Tensor
    prompt_length: int
    max_length: int
    pad_token_id: int
    # [B, F]: the target's features (final hidden state, for Medusa) at the position that produced each row's last
    # committed token (kept only for proposers that read them, such as draft heads)
    target_hidden: torch.Tensor | None = None
    # [B, T, F]: the target's features (the proposer's `target_feature_layers`) at the positions that produced the
    # tokens the last step committed: entry j produced the step's j-th token. Before the first proposal it holds
    # the prompt's features instead (entry j produced prompt token j + 1; the last one, the first new token).
    target_features: torch.Tensor | None = None
    host: HostView = field(default=None)
    # the step's draft limits from a schedule (`hf_specdec.schedule`), None without one: per row on the host and
    # [B] on the device, and the step's width (the most any row drafts; under static shapes one of a fixed set)
    draft_limits: list[int] | None = None
    draft_limit_tensor: torch.Tensor | None = None
    draft_width: int | None = None
    # the target's KV cache (`hf_specdec.cache.ragged.RaggedKVCache`), which proposers may read and never write: an
    # early-exit draft starts from the prompt's keys and values in its first layers
    target_cache: Any = field(default=None, repr=False)
    # what the proposers of the call that returned the prompt's cache left for this one (`Proposer.carry`,
    # `hf_specdec.cache.carried`); each proposer takes its own
    carried: tuple = ()
    # per row, the proposer a schedule chose for it this step (`method="auto"`), None otherwise
    draft_methods: tuple[str, ...] | None = None
    # [B]: the host tensor the draft limits travel through (pinned on CUDA), made on the first scheduled step
    limit_buffer: torch.Tensor | None = field(default=None, repr=False)
    limit_host: np.ndarray | None = field(default=None, repr=False)  # the buffer's memory, seen from NumPy
    # [B]: the same for per-row values a proposer computes on the host (`stage_rows`)
    row_buffer: torch.Tensor | None = field(default=None, repr=False)
    row_host: np.ndarray | None = field(default=None, repr=False)
    # [B, X_i] int tensors to read with the step's host read (`ship`), cleared by it
    shipments: list[torch.Tensor] = field(default_factory=list, repr=False)
    # [1, W] column indices 0..W-1 on the device, by W (`columns`)
    _columns: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def start(
        cls,
        # [B, P]
        input_ids: torch.Tensor,
        # [B, P] or None
        attention_mask: torch.Tensor | None,
        max_length: int,
        extra_capacity: int,
        pad_token_id: int,
    ) -> DecodeState:
        batch, prompt_length = input_ids.shape
        capacity = max(max_length, prompt_length) + extra_capacity
        sequences = input_ids.new_full((batch, capacity), pad_token_id)
        sequences[:, :prompt_length] = input_ids
        if attention_mask is None:
            pad_lengths = input_ids.new_zeros(batch)
        else:
            pad_lengths = attention_mask.long().cumsum(dim=1).eq(0).sum(dim=1)  # leading zeros only
        return cls(
            sequences=sequences,
            lengths=input_ids.new_full((batch,), prompt_length),
            pad_lengths=pad_lengths,
            finished=torch.zeros(batch, dtype=torch.bool, device=input_ids.device),
            prompt_length=prompt_length,
            max_length=max_length,
            pad_token_id=pad_token_id,
            host=HostView.start(batch, prompt_length),
        )

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    def last_tokens(self) -> torch.Tensor:
        """[B]: each row's last committed token (padding before any: a prompt given as embeddings alone)."""
        return self.sequences.gather(1, (self.lengths - 1).clamp(min=0)[:, None]).squeeze(1)

    def draft_budget(self) -> torch.Tensor:
        """[B]: draft tokens worth proposing: the tokens still allowed after the step's own final token."""
        budget = (self.max_length - self.lengths - 1).clamp(min=0)
        if self.draft_limit_tensor is not None:
            budget = torch.minimum(budget, self.draft_limit_tensor)
        return torch.where(self.finished, 0, budget)

    def host_draft_budget(self) -> list[int]:
        """`draft_budget` from the host's view (no sync)."""
        host = self.host
        budget = [0 if done else max(self.max_length - length - 1, 0)
                  for length, done in zip(host.lengths, host.finished)]
        if self.draft_limits is not None:
            budget = [min(b, limit) for b, limit in zip(budget, self.draft_limits)]
        return budget

    def step_width(self, max_k: int) -> int:
        """Draft positions a proposal of fixed width has this step: `max_k`, or fewer under a schedule."""
        return max_k if self.draft_width is None else min(max_k, self.draft_width)

    def set_draft_limits(self, limits: list[int], width: int) -> None:
        """A schedule's limits for the next proposal (copied to the device without waiting for it)."""
        self.draft_limits, self.draft_width = limits, width
        if self.limit_buffer is None:
            self.limit_buffer, self.limit_host = self._host_buffer()
        self.draft_limit_tensor = self._staged(self.limit_buffer, self.limit_host, limits)

    def stage_rows(self, values: list[int]) -> torch.Tensor:
        """[B] long on the device: a per-row value a proposer computed on the host (at most once per step), copied
        as the limits are, without waiting for the device."""
        if self.row_buffer is None:
            self.row_buffer, self.row_host = self._host_buffer()
        return self._staged(self.row_buffer, self.row_host, values)

    def _host_buffer(self) -> tuple[torch.Tensor, np.ndarray]:
        """A [B] host tensor to copy per-row values through (pinned on CUDA), and its memory seen from NumPy."""
        if self.lengths.device.type == "cuda":
            buffer = torch.empty(self.batch_size, dtype=self.lengths.dtype, pin_memory=True)
            return buffer, buffer.numpy()
        host = np.empty(self.batch_size, dtype=np.int64)
        return torch.from_numpy(host), host

    def _staged(self, buffer: torch.Tensor, host: np.ndarray, values: list[int]) -> torch.Tensor:
        # refilling is safe: the previous step's copy out of the buffer finished before that step's host sync
        # (`report`) returned; on the CPU the buffer is itself the step's tensor, read only within the step
        host[:] = values  # written in place through its host view: no tensor built per step
        return buffer.to(self.lengths.device, non_blocking=True)

    @contextlib.contextmanager
    def limited_to(self, rows: RowSet) -> Iterator[None]:
        """Within the block, only `rows` may draft (a proposer drafting for some rows only), within their limits;
        the others get 0."""
        saved = self.draft_limits, self.draft_limit_tensor
        limits = self.draft_limits or [self.max_length] * self.batch_size
        self.draft_limits = [limit if mine else 0 for limit, mine in zip(limits, rows.host)]
        limit_tensor = self.max_length if self.draft_limit_tensor is None else self.draft_limit_tensor
        self.draft_limit_tensor = torch.where(rows.mask, limit_tensor, 0)
        try:
            yield
        finally:
            self.draft_limits, self.draft_limit_tensor = saved

    def ship(
        self,
        # [B, X] integers on the device
        values: torch.Tensor,
    ) -> int:
        """Have `values` read with this step's host read (`report`), at no sync of their own: after it they are
        `self.host.shipped[i]`, [B, X] int64, for the index i returned."""
        self.shipments.append(values)
        return len(self.shipments) - 1

    def report(
        self,
        # [B]: tokens each row emitted this step
        num_emitted: torch.Tensor,
        # [B]: draft tokens each row accepted this step
        num_accepted: torch.Tensor,
        # [B, W] or None: the step's output tokens, when the host needs them (a streamer, a host-side proposer)
        tokens: torch.Tensor | None = None,
        # [B] bool or None: rows that sampled from no distribution (when sampling)
        unsampleable: torch.Tensor | None = None,
        # [B] or None: draft tokens each row verified (None: the step drafted nothing)
        num_draft_tokens: torch.Tensor | None = None,
    ) -> HostView:
        """Copy what the host needs to `self.host`: one device-to-host transfer, the step's one host sync."""
        facts = {"lengths": self.lengths, "finished": self.finished.long(), "emitted": num_emitted,
                 "accepted": num_accepted}
        if unsampleable is not None:
            facts["unsampleable"] = unsampleable.long()
        if num_draft_tokens is not None:
            facts["drafts"] = num_draft_tokens
        packed = torch.stack([c.to(self.lengths.device) for c in facts.values()], dim=1)
        extra = ([] if tokens is None else [tokens]) + self.shipments
        if extra:
            packed = torch.cat([packed] + [part.to(packed) for part in extra], dim=1)
        values = packed.tolist()  # the one host read
        parts: list[np.ndarray] = []
        if extra:  # the columns after the facts: the tokens (if asked for), then each shipment
            after = np.array(values, dtype=np.int64)[:, len(facts):]
            parts = np.split(after, np.cumsum([part.shape[1] for part in extra])[:-1], axis=1)
        emitted = parts.pop(0) if tokens is not None else None
        self.shipments = []
        read = dict(zip(facts, map(list, zip(*values)))) if values else dict.fromkeys(facts, [])  # per fact, by row
        self.host = HostView(lengths=read["lengths"], finished=[bool(x) for x in read["finished"]],
                             num_emitted=read["emitted"], num_accepted=read["accepted"], emitted=emitted,
                             unsampleable=None if unsampleable is None else [bool(x) for x in read["unsampleable"]],
                             num_draft_tokens=read.get("drafts"), shipped=tuple(parts))
        return self.host

    def write(
        self,
        # [B, W]
        tokens: torch.Tensor,
        # [B]: how many of each row's tokens to write after its committed length
        counts: torch.Tensor,
    ) -> None:
        """Write each row's first `counts` tokens after its committed length (the columns there hold padding, and
        the others keep it)."""
        column = self.columns(tokens.shape[1])
        index = (self.lengths[:, None] + column).clamp(max=self.sequences.shape[1] - 1)
        self.sequences.scatter_(1, index, torch.where(column < counts[:, None], tokens, self.pad_token_id))

    def commit(self, num_emitted: torch.Tensor) -> None:
        """Advance lengths by the tokens written (`write`, with these counts) and emitted."""
        self.lengths = self.lengths + num_emitted

    def columns(self, width: int) -> torch.Tensor:
        """[1, width] long on the device: 0..width-1 (kept per width)."""
        if width not in self._columns:
            self._columns[width] = torch.arange(width, device=self.lengths.device)[None, :]
        return self._columns[width]


# model inputs giving each token's modality (0: text), which `generate` extends with zeros for new tokens
MODALITY_TYPE_INPUTS = ("mm_token_type_ids", "moe_mm_token_type_ids")


@dataclass(frozen=True)
class PromptInputs:
    """What `generate` prepared for the prompt besides its token ids."""

    # [B, P] or None (1 = real token, 0 = padding)
    attention_mask: torch.Tensor | None = None
    # [B, P] or None
    position_ids: torch.Tensor | None = None
    # [B, P] or None: segment ids (GPT-2 style models); new tokens take each row's last one, as in `generate`
    token_type_ids: torch.Tensor | None = None
    # [B, P, H] or None: the prompt as embeddings (the token ids are then [B, 0])
    inputs_embeds: torch.Tensor | None = None
    # a filled transformers cache holding the prompt's first tokens (continuing an earlier call), or None
    past_key_values: Any = None
    # multimodal inputs (pixel values, image features `generate` encoded, ...), which plain `generate` feeds to the
    # prompt's forward only (transformers' MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL), and so does the engine; and
    # each prompt token's modality ({"mm_token_type_ids": [B, P]}: every later token is text, 0)
    multimodal: dict[str, Any] = field(default_factory=dict)

    def select(
        self,
        # [R] long: the rows to keep
        rows: torch.Tensor,
    ) -> PromptInputs:
        """These rows' prompt inputs, without a filled cache. The inputs only the prompt's forward takes (images)
        are not split by row (an image's patches are not a row's), so a prompt with them is refused here."""
        images = self.images
        if images:
            raise ValueError(f"PromptInputs.select: multimodal inputs {images} are not split by row")
        positions = self.position_ids
        return PromptInputs(
            attention_mask=None if self.attention_mask is None else self.attention_mask[rows],
            position_ids=None if positions is None else positions[..., rows, :],  # [B, P] or [A, B, P]
            token_type_ids=None if self.token_type_ids is None else self.token_type_ids[rows],
            inputs_embeds=None if self.inputs_embeds is None else self.inputs_embeds[rows],
            multimodal={name: value[rows] for name, value in self.multimodal.items()},  # modalities [B, P]
        )

    @property
    def images(self) -> list[str]:
        """The names of the multimodal inputs only the prompt's forward takes (pixel values, ...), sorted."""
        return sorted(name for name in self.multimodal if name not in MODALITY_TYPE_INPUTS)
