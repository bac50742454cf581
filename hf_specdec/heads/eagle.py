"""EAGLE draft heads (Li et al. 2024, 2025): a one-layer transformer that drafts from the target's own features.

* `version="eagle"` (EAGLE-1; EAGLE-2 is the same head with a dynamic draft tree): the input at a position is
  `fc(cat(embed(token), feature))`, where `feature` is the target's final hidden state (after its last norm) at the
  position before the token. One Llama decoder layer without an input norm follows; its output is the next
  feature, and the target's own lm_head turns it into logits. The target's embeddings and lm_head are reused, not
  copied into the head.
* `version="eagle3"` (EAGLE-3): the target feature is the concatenation of the residual stream entering three
  target layers (by default 2, L // 2 and L - 3; `hidden_states[i]` in transformers), reduced by `fc` (no bias) to
  the hidden size; the head's own outputs are fed back without `fc`. The decoder layer ("midlayer") attends over
  `cat(input_layernorm(embed), hidden_norm(hidden))`, twice the hidden size wide; a final norm and the head's own
  lm_head give logits over a draft vocabulary, mapped to target ids by `d2t` (target id = draft id + d2t[id]).

Parameter names follow the SafeAILab checkpoints (`fc`, `layers.0.*` / `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`), so their files load as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

EagleVersion = Literal["eagle", "eagle3"]


def default_feature_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target layers (the residual stream entering each): 2, L // 2 and L - 3, as EAGLE, vLLM and
    speculators choose them (clamped into range for very shallow targets)."""
    last = num_target_layers - 1
    return tuple(min(max(i, 0), last) for i in (2, num_target_layers // 2, num_target_layers - 3))


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
        for name in ("head_dim", "draft_vocab_size", "target_hidden_size"):
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
            raise ValueError(f"EagleConfig.rope_parameters: expected a dict with 'rope_type', got {self.rope_parameters!r}")
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
                f"EagleConfig.draft_vocab_size: expected at most vocab_size {self.vocab_size}, got {self.draft_vocab_size}"
            )

    @classmethod
    def for_target(cls, target: nn.Module, version: EagleVersion = "eagle", **overrides) -> EagleConfig:
        """A head shaped like one layer of `target` (hidden size, heads, MLP width, RoPE, vocabulary)."""
        text = target.config.get_text_config(decoder=True)
        values = dict(
            version=version,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            vocab_size=text.vocab_size,
            head_dim=getattr(text, "head_dim", None),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_parameters=dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
            max_position_embeddings=text.max_position_embeddings,
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


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over cat(input_layernorm(embed), hidden_norm(hidden)), then the MLP."""

    def __init__(self, config: EagleConfig, llama: LlamaConfig) -> None:
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = LlamaAttention(llama, layer_idx=0)
        heads, kv_heads, head_dim = llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim
        width = 2 * llama.hidden_size
        self.self_attn.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.mlp = LlamaMLP(llama)
        self.hidden_norm = LlamaRMSNorm(llama.hidden_size, eps=llama.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(llama.hidden_size, eps=llama.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(llama.hidden_size, eps=llama.rms_norm_eps)

    def forward(
        self,
        # [B, W, H]
        embeds: torch.Tensor,
        # [B, W, H]
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        # [B, 1, W, S] additive, or None (causal is then not applied: callers always pass one)
        attention_mask: torch.Tensor | None,
        past_key_values,
    ) -> torch.Tensor:
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        attended, _ = self.self_attn(
            torch.cat([self.input_layernorm(embeds), hidden], dim=-1),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
        )
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.llama_config = config.llama_config()
        hidden = config.hidden_size
        if config.version == "eagle":
            self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
            layer = LlamaDecoderLayer(self.llama_config, layer_idx=0)
            layer.input_layernorm = nn.Identity()  # EAGLE-1's layer 0 has no input norm
            self.layers = nn.ModuleList([layer])
        else:
            self.fc = nn.Linear(config.feature_size, hidden, bias=False)
            self.midlayer = Eagle3Layer(config, self.llama_config)
            self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            draft_vocab = config.draft_vocab_size or config.vocab_size
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
            # target id = draft id + d2t[draft id]; t2d marks the target ids the draft vocabulary holds
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[:draft_vocab] = True
            self.register_buffer("t2d", t2d)
        self.rotary_emb = LlamaRotaryEmbedding(self.llama_config)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def forward(
        self,
        # [B, W, H]: the target's embeddings of the tokens
        embeds: torch.Tensor,
        # [B, W, F]: the feature before each token: the target's (F = config.feature_size) or the head's own
        # output at the parent position (F = hidden_size)
        features: torch.Tensor,
        # [B, W]
        position_ids: torch.Tensor,
        # [B, 1, W, S] additive mask over the head's KV cache slots
        attention_mask: torch.Tensor | None,
        past_key_values=None,
        from_target: bool = True,
    ) -> torch.Tensor:
        """The head's output hidden states [B, W, H]: the next features, and (through `logits`) its guesses."""
        embeds, features = embeds.to(self.dtype), features.to(self.dtype)
        if self.config.version == "eagle":
            hidden = self.fc(torch.cat([embeds, features], dim=-1))
            position_embeddings = self.rotary_emb(hidden, position_ids)
            return self.layers[0](hidden, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_values=past_key_values, position_embeddings=position_embeddings)
        hidden = self.fc(features) if from_target else features
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.midlayer(embeds, hidden, position_embeddings, attention_mask, past_key_values)

    def logits(
        self,
        # [..., H]: the head's output hidden states
        hidden: torch.Tensor,
        # the target's lm_head (EAGLE-1/2 reuses it)
        target_lm_head: nn.Module,
    ) -> torch.Tensor:
        """Float logits [..., V_target]; ids outside an EAGLE-3 draft vocabulary get -inf."""
        if self.config.version == "eagle":
            weight = target_lm_head.weight
            return target_lm_head(hidden.to(weight.dtype)).float()
        draft_logits = self.lm_head(self.norm(hidden)).float()
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        target_ids = torch.arange(draft_logits.shape[-1], device=self.d2t.device) + self.d2t
        return full.index_copy(-1, target_ids.to(full.device), draft_logits)

    def check_target(self, target: nn.Module) -> None:
        """Clear errors when the head was made for another model shape."""
        text = target.config.get_text_config(decoder=True)
        embed_size = target.get_input_embeddings().weight.shape[1]
        if embed_size != self.config.hidden_size:
            raise ValueError(
                f"SpeculativeConfig.heads: hidden_size {self.config.hidden_size} does not match the target's "
                f"embeddings ({embed_size}); this EAGLE head was trained for another model"
            )
        if text.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"SpeculativeConfig.heads: vocab_size {self.config.vocab_size} does not match the target's "
                f"{text.vocab_size}; this EAGLE head was trained for another model"
            )
        if self.config.version == "eagle3":
            layers = text.num_hidden_layers
            fused = self.target_feature_layers(target)
            if max(fused) >= layers:
                raise ValueError(
                    f"SpeculativeConfig.heads: feature_layers {fused} need a target with more "
                    f"than {max(fused)} layers; the target has {layers}"
                )
            width = self.config.target_hidden_size or self.config.hidden_size
            if width != text.hidden_size:
                raise ValueError(
                    f"SpeculativeConfig.heads: target_hidden_size {width} does not match the target's "
                    f"{text.hidden_size}"
                )

    def target_feature_layers(self, target: nn.Module) -> tuple[int, ...]:
        """The entries of `target`'s `hidden_states` the head reads (-1: the final, normed one)."""
        return self.config.target_feature_layers(target.config.get_text_config(decoder=True).num_hidden_layers)

    def save_pretrained(self, folder) -> None:
        """Write the PEFT-style adapter folder (adapter_config.json + adapter_model.safetensors)."""
        from hf_specdec.heads.eagle_files import save_eagle

        save_eagle(self, folder)

    @classmethod
    def from_pretrained(cls, path_or_repo_id, revision: str | None = None, num_target_layers: int | None = None,
                        feature_layers: tuple[int, ...] | None = None) -> EagleHead:
        """Our adapter folder, or a SafeAILab EAGLE-1 / EAGLE-3 or speculators checkpoint (converted on load): a
        local folder or a Hub id. SafeAILab EAGLE-3 files do not say which target layers they fuse: the head then
        fuses the target's layers 2, L // 2 and L - 3 (as EAGLE, vLLM and SGLang do), resolved when it meets its
        target at `generate`; `num_target_layers` (fixes them now) or `feature_layers` override that."""
        from hf_specdec.heads.eagle_files import load_eagle
        from hf_specdec.heads.hub import resolve_folder

        return load_eagle(resolve_folder(path_or_repo_id, revision), num_target_layers=num_target_layers,
                          feature_layers=feature_layers)

    def push_to_hub(self, repo_id: str, private: bool | None = None, token: str | None = None,
                    commit_message: str | None = None, measured: dict[str, float] | None = None):
        """Upload the adapter folder with a model card (measured acceptance/speedup go in when given)."""
        from hf_specdec.heads.hub import eagle_card, push_folder

        return push_folder(repo_id, self.save_pretrained, eagle_card(self, repo_id, measured),
                           "Upload EAGLE head (hf_specdec)", private, token, commit_message)
