"""What a drafter's model can read where the text it drafts for reaches further: position ids past its table of
learned positions (GPT-2, OPT), and token ids past its input embedding (a draft whose vocabulary is padded less
than the target's, or that lacks tokens added to the target's). Its cache (`RaggedKVCache.reach`) feeds it the
last of each instead: only what the drafter reads changes, and the target verifies every draft, so the output
stays exact; drafts made there are rarely accepted."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

# names of the embedding tables of learned absolute positions (GPT-2 and GPT-BigCode: `wpe`; OPT, BioGPT:
# `embed_positions`)
LEARNED_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def learned_positions(model: nn.Module) -> int | None:
    """The number of position ids a model's table of learned positions holds (GPT-2's `wpe`, OPT's
    `embed_positions`, ...); None for a model without one (rotary or no positions: any position id runs)."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    size = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    tables = [name for name, module in model.named_modules()
              if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in LEARNED_POSITION_TABLES]
    return size if tables and size else None


def embedding_rows(model: nn.Module) -> int | None:
    """How many token ids a drafter's input embedding holds; None for a drafter that embeds otherwise (an EAGLE
    head or MTP layers take the target's embedding as a module of their own)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if get is not None else None
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None


@dataclass(frozen=True)
class DrafterReach:
    # the last position id the model's table of learned positions holds; None: any position runs
    last_position: int | None = None
    # how many token ids the model embeds, when fewer than the ids it may be fed; None: every id
    embedded_ids: int | None = None

    @classmethod
    def of(cls, model: nn.Module, fed_ids: int | None = None) -> DrafterReach:
        """`model`'s reach, fed token ids below `fed_ids` (the target's vocabulary; None: ids of its own)."""
        table, rows = learned_positions(model), embedding_rows(model)
        return cls(last_position=None if table is None else table - 1,
                   embedded_ids=rows if rows is not None and fed_ids is not None and rows < fed_ids else None)

    def positions(
        self,
        # [B, W] long
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """[B, W]: each position id, or the table's last one past it."""
        return positions if self.last_position is None else positions.clamp(max=self.last_position)

    def ids(
        self,
        # [B, W] long
        ids: torch.Tensor,
    ) -> torch.Tensor:
        """[B, W]: each token id, or the embedding's last one past it."""
        return ids if self.embedded_ids is None else ids.clamp(max=self.embedded_ids - 1)

    def warn_past_positions(self, last_fed: int, reached: str, stacklevel: int = 2) -> bool:
        """Warn, and say True, when the drafter is fed position `last_fed` and its table ends before it; `reached`
        names how far the call reaches; `stacklevel` as the caller would give `warnings.warn`."""
        if self.last_position is None or last_fed <= self.last_position:
            return False
        warnings.warn(
            f"the draft model's table of learned positions holds {self.last_position + 1} positions and this call "
            f"reaches {reached}: it reads every later position as its last one, so its drafts there are rarely "
            "accepted (the output is still exact); use a draft with a longer context",
            stacklevel=stacklevel + 1)
        return True
