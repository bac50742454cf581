"""The MLP speculator (IBM fms-extras, vLLM `method="mlp_speculator"`): config, module, fms-extras' published layout
(converted on load, written by `export_fms_extras`) and model card."""

from hf_specdec.heads.adapter import register_head
from hf_specdec.heads.mlp_speculator.config import MlpSpeculatorConfig, default_top_k_tokens_per_head
from hf_specdec.heads.mlp_speculator.model import MlpSpeculator, TargetVocab, export_fms_extras

register_head(MlpSpeculator)

__all__ = ["MlpSpeculator", "MlpSpeculatorConfig", "TargetVocab", "default_top_k_tokens_per_head", "export_fms_extras"]
