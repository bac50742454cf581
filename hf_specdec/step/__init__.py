"""The data of one decode step, below both the proposers and the loop: the committed text (`DecodeState`), what a
proposer offers (`Proposal`) and what the target kept of it (`VerificationResult`)."""

from hf_specdec.step.proposal import Proposal
from hf_specdec.step.result import PLACEHOLDER_TOKEN_ID, VerificationResult
from hf_specdec.step.state import DecodeState, PromptInputs, RowSet

__all__ = ["PLACEHOLDER_TOKEN_ID", "DecodeState", "PromptInputs", "Proposal", "RowSet", "VerificationResult"]
