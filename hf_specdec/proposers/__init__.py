"""Proposers register themselves on import; `build_proposer` builds one by method name."""

from hf_specdec.proposers import draft_model, eagle, medusa, mtp, ngram  # noqa: F401  (registration)
from hf_specdec.proposers.base import DraftSampling, Proposer, build_proposer, register_proposer

__all__ = ["DraftSampling", "Proposer", "build_proposer", "register_proposer"]
