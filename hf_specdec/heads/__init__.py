"""Draft heads that read the target's hidden states, one folder per method (`medusa/`, `eagle/`, `mlp_speculator/`:
config, module, converters of published layouts, model card), over the method-independent adapter folder, Hub
transfer and model cards of `adapter.py`. A method's folder registers its head on import; adding a head means adding
a folder."""

from hf_specdec.heads.eagle import EagleConfig, EagleHead
from hf_specdec.heads.medusa import MedusaConfig, MedusaHeads, load_medusa2
from hf_specdec.heads.mlp_speculator import MlpSpeculator, MlpSpeculatorConfig

__all__ = ["EagleConfig", "EagleHead", "MedusaConfig", "MedusaHeads", "MlpSpeculator", "MlpSpeculatorConfig",
           "load_medusa2"]
