"""hf_specdec: lossless, batched speculative decoding inside Hugging Face transformers' `generate`."""

from hf_specdec.config import SPEC_METHODS, SpeculativeConfig
from hf_specdec.decoding.loop import SpeculativeGenerateOutput
from hf_specdec.integration import disable, enable, generate, is_enabled
from hf_specdec.lossless import LosslessReport, check_greedy
from hf_specdec.stats import RowSpecStats, SpecStats

__version__ = "0.1.0"

__all__ = [
    "SPEC_METHODS",
    "LosslessReport",
    "RowSpecStats",
    "SpecStats",
    "SpeculativeConfig",
    "SpeculativeGenerateOutput",
    "check_greedy",
    "disable",
    "enable",
    "generate",
    "is_enabled",
]
