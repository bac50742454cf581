"""Proposers register themselves on import; `build_proposer` builds one by method name."""

from hf_specdec.proposers import (  # noqa: F401  (registration)
    auto,
    draft_model,
    eagle,
    early_exit,
    medusa,
    mlp_speculator,
    mtp,
    ngram,
    recycling,
    suffix,
)
from hf_specdec.proposers.base import DraftSampling, Proposer, build_proposer, register_proposer

__all__ = ["DraftSampling", "Proposer", "build_proposer", "register_proposer"]
