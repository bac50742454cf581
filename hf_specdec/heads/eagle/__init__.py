"""EAGLE heads (EAGLE-1/2 and EAGLE-3): config, module, published layouts and speculators export."""

from hf_specdec.heads.adapter import register_head
from hf_specdec.heads.eagle.config import EagleConfig, EagleVersion, default_feature_layers
from hf_specdec.heads.eagle.model import EagleHead, export_speculators

register_head(EagleHead)

__all__ = ["EagleConfig", "EagleHead", "EagleVersion", "default_feature_layers", "export_speculators"]
