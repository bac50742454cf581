"""EagleConfig: the shape of an EAGLE head (EAGLE-1/2 or EAGLE-3), validated on construction; stored in its adapter
folder with the version as the adapter type (`method` "eagle" or "eagle3"). EAGLE-3's fused target layers are
recorded when known, else resolved when the head meets its target (2, L // 2, L - 3)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, get_args

from torch import nn
from transformers import LlamaConfig

EagleVersion = Literal["eagle", "eagle3"]


def default_feature_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target layers (the residual stream entering each): 2, L // 2 and L - 3, as EAGLE, vLLM and
    speculators choose them (clamped into range for very shallow targets)."""
    last = num_target_layers - 1
    return tuple(min(max(i, 0), last) for i in (2, num_target_layers // 2, num_target_layers - 3))


def target_rope_parameters(text_config) -> dict:
    """The RoPE a head shaped like one layer of the target uses: the target's, or, where it sets one per layer type
    (Gemma-3: local layers at another base), its full-attention layers' (a head attends over the whole context)."""
    rope = getattr(text_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    if "rope_type" not in rope and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    return dict(rope)


def target_mlp_width(text_config) -> int:
    """The width of the target's MLP under the name its family gives it (Llama's `intermediate_size`, GPT-2's
    `n_inner`, OPT's `ffn_dim`, Falcon's `ffn_hidden_size`, MPT's `expansion_ratio` times the width), or GPT-2's
    default, four times the hidden size."""
    for name in ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"):
        width = getattr(text_config, name, None)
        if width:
            return int(width)
    ratio = getattr(text_config, "expansion_ratio", None)
    return int((ratio or 4) * text_config.hidden_size)


def target_max_positions(text_config) -> int:
    """The target's longest context under the name its family gives it; 4096 for models without a limit (ALiBi:
    BLOOM, MPT without `max_seq_len`)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        length = getattr(text_config, name, None)
        if length:
            return int(length)
    return 4096


@dataclass
class EagleConfig:
    version: EagleVersion
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    # the target's vocabulary (logits are returned over it)
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    # eagle: fc has a bias unless the checkpoint says otherwise (LLaMA-3 heads have none); eagle3: never
    fc_bias: bool = True
    # eagle only: draft over this many rows of the target's lm_head (the head's `token_map`; None: all of them)
    token_map_size: int | None = None
    # eagle3 only: the head's own output vocabulary (None: the target's) and the fused target layers
    draft_vocab_size: int | None = None
    feature_layers: tuple[int, ...] | None = None
    # eagle3 only: width of each fused target feature (None: hidden_size)
    target_hidden_size: int | None = None
    # eagle3 only: speculators' flag; the residual is the normed hidden state instead of the raw one
    norm_before_residual: bool = False
    base_model_name_or_path: str | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        if self.version not in get_args(EagleVersion):
            raise ValueError(f"EagleConfig.version: expected one of {get_args(EagleVersion)}, got {self.version!r}")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "max_position_embeddings"):
            _check_positive(name, getattr(self, name))
        for name in ("head_dim", "draft_vocab_size", "target_hidden_size", "token_map_size"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"EagleConfig.head_dim: hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}; give head_dim"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"EagleConfig.num_key_value_heads: expected a divisor of num_attention_heads "
                f"{self.num_attention_heads}, got {self.num_key_value_heads}"
            )
        if not isinstance(self.rope_parameters, dict) or "rope_type" not in self.rope_parameters:
            raise ValueError(
                f"EagleConfig.rope_parameters: expected a dict with 'rope_type', got {self.rope_parameters!r}"
            )
        if self.token_map_size is not None and self.token_map_size > self.vocab_size:
            raise ValueError(f"EagleConfig.token_map_size: expected at most vocab_size {self.vocab_size}, "
                             f"got {self.token_map_size}")
        if self.version == "eagle3" and self.token_map_size is not None:
            raise ValueError("EagleConfig.token_map_size: only for version 'eagle' (an EAGLE-3 head has its own "
                             "draft vocabulary: draft_vocab_size)")
        if self.version == "eagle":
            for name in ("draft_vocab_size", "feature_layers", "target_hidden_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"EagleConfig.{name}: only for version 'eagle3', got {getattr(self, name)!r}")
            if self.norm_before_residual:
                raise ValueError("EagleConfig.norm_before_residual: only for version 'eagle3'")
            return
        if self.fc_bias:
            raise ValueError("EagleConfig.fc_bias: EAGLE-3's fc has no bias; set fc_bias=False")
        if self.feature_layers is None:  # the target's default three, resolved when the head meets its target
            pass
        elif len(self.feature_layers) == 0:
            raise ValueError("EagleConfig.feature_layers: expected the target layers the head fuses, e.g. (2, 16, 29), "
                             "or None for the target's default (2, L // 2, L - 3)")
        elif any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.feature_layers):
            raise ValueError(f"EagleConfig.feature_layers: expected layer indices >= 0, got {self.feature_layers}")
        else:
            self.feature_layers = tuple(self.feature_layers)
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"EagleConfig.draft_vocab_size: expected at most vocab_size {self.vocab_size}, "
                f"got {self.draft_vocab_size}"
            )

    @classmethod
    def for_target(cls, target: nn.Module, version: EagleVersion = "eagle", **overrides) -> EagleConfig:
        """A head shaped like one layer of `target` (hidden size, heads, MLP width, RoPE, vocabulary)."""
        text = target.config.get_text_config(decoder=True)
        values = dict(
            version=version,
            hidden_size=text.hidden_size,
            intermediate_size=target_mlp_width(text),
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            vocab_size=text.vocab_size,
            head_dim=getattr(text, "head_dim", None),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_parameters=target_rope_parameters(text),
            max_position_embeddings=target_max_positions(text),
            base_model_name_or_path=getattr(target.config, "_name_or_path", None) or None,
        )
        if version == "eagle3":
            values.update(fc_bias=False, feature_layers=default_feature_layers(text.num_hidden_layers))
        values.update(overrides)
        return cls(**values)

    def target_feature_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The entries of the target's `hidden_states` the head reads (-1: the final, normed one); an EAGLE-3 head
        that records none fuses the target's default layers (2, L // 2, L - 3)."""
        if self.version == "eagle":
            return (-1,)
        return self.feature_layers or default_feature_layers(num_target_layers)

    @property
    def num_feature_layers(self) -> int:
        if self.version == "eagle":
            return 1
        return len(self.feature_layers) if self.feature_layers is not None else len(default_feature_layers(3))

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads."""
        if self.version == "eagle":
            return self.hidden_size
        return self.num_feature_layers * (self.target_hidden_size or self.hidden_size)

    def to_dict(self) -> dict:
        values = asdict(self)
        if values["feature_layers"] is not None:
            values["feature_layers"] = list(values["feature_layers"])
        return values

    def llama_config(self) -> LlamaConfig:
        """The Llama config of the head's one decoder layer (sdpa attention)."""
        config = LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            attention_bias=False,
            mlp_bias=False,
        )
        config._attn_implementation = "sdpa"
        return config


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EagleConfig.{name}: expected an int >= 1, got {value!r}")



def resolve_feature_layers(
    folder: Path,
    recorded: Sequence[int] | None,
    num_target_layers: int | None,
    feature_layers: Sequence[int] | None,
) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head fuses: as its folder records them, else as the caller says (both must
    agree), else None (the target's default layers, resolved when the head meets it)."""
    given = tuple(feature_layers) if feature_layers is not None else (
        default_feature_layers(num_target_layers) if num_target_layers is not None else None)
    if recorded is None:
        return given
    recorded = tuple(recorded)
    if given is not None and given != recorded:
        raise ValueError(f"{folder}: feature_layers: the checkpoint fuses target layers {recorded}, not {given}")
    return recorded
