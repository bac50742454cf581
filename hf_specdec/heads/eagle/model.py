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
`t2d`), so their files load as they are. Stored as our adapter folder (method "eagle" or "eagle3"); SafeAILab
and speculators checkpoints are converted on load and speculators ones written by `export_speculators`
(`convert.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from importlib.resources import files
from pathlib import Path

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

from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.heads.adapter import AdapterMixin, resolve_folder, write_json, write_safetensors
from hf_specdec.heads.eagle.config import EagleConfig, resolve_feature_layers
from hf_specdec.heads.eagle.convert import SPECULATORS_WEIGHTS_NAME, read_published, to_speculators
from hf_specdec.heads.target_weights import layer_spec
from hf_specdec.heads.token_map import TokenMapMixin


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
        cache,
    ) -> torch.Tensor:
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        attended, _ = self.self_attn(
            torch.cat([self.input_layernorm(embeds), hidden], dim=-1),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **{CACHE_KWARG: cache},
        )
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(AdapterMixin, TokenMapMixin, nn.Module):
    config_class = EagleConfig
    adapter_types = ("eagle", "eagle3")
    adapter_type_field = "version"
    card_template = files(__package__).joinpath("card.md")
    upload_message = "Upload EAGLE head (hf_specdec)"
    read_published = staticmethod(read_published)

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
        self._init_token_map(config.vocab_size)

    def token_map_refusal(self) -> str | None:
        if self.config.version == "eagle3":
            return ("an EAGLE-3 head has its own draft vocabulary (draft_vocab_size, set in training); a token map "
                    "is for EAGLE-1/2 heads, which project with the target's lm_head")
        return None

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
        cache=None,
        from_target: bool = True,
    ) -> torch.Tensor:
        """The head's output hidden states [B, W, H]: the next features, and (through `logits`) its guesses."""
        embeds, features = embeds.to(self.dtype), features.to(self.dtype)
        if self.config.version == "eagle":
            hidden = self.fc(torch.cat([embeds, features], dim=-1))
            position_embeddings = self.rotary_emb(hidden, position_ids)
            return self.layers[0](hidden, attention_mask=attention_mask, position_ids=position_ids,
                                  **{CACHE_KWARG: cache}, position_embeddings=position_embeddings)
        hidden = self.fc(features) if from_target else features
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.midlayer(embeds, hidden, position_embeddings, attention_mask, cache)

    def logits(
        self,
        # [..., H]: the head's output hidden states
        hidden: torch.Tensor,
        # the target's lm_head (EAGLE-1/2 reuses it)
        target_lm_head: nn.Module,
    ) -> torch.Tensor:
        """Float logits [..., V_target]; ids outside an EAGLE-3 draft vocabulary get -inf."""
        if self.config.version == "eagle":
            return target_lm_head(hidden.to(layer_spec(target_lm_head).dtype)).float()
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

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, revision: str | None = None,
                        num_target_layers: int | None = None,
                        feature_layers: Sequence[int] | None = None) -> EagleHead:
        """Our adapter folder, or a SafeAILab EAGLE-1 / EAGLE-3 or speculators checkpoint (converted on load): a
        local folder or a Hub id. SafeAILab EAGLE-3 files do not say which target layers they fuse: the head then
        fuses the target's layers 2, L // 2 and L - 3 (as EAGLE, vLLM and SGLang do), resolved when it meets its
        target at `generate`; `num_target_layers` (fixes them now) or `feature_layers` override that. Where the
        folder records them, these must agree with it."""
        if num_target_layers is not None and (isinstance(num_target_layers, bool)
                                              or not isinstance(num_target_layers, int) or num_target_layers < 1):
            raise ValueError(f"EagleHead.from_pretrained: num_target_layers: expected an int >= 1, got "
                             f"{num_target_layers!r}")
        head_files = cls.read_folder(resolve_folder(path_or_repo_id, revision))
        config = head_files.config
        if config.version == "eagle3":
            layers = resolve_feature_layers(head_files.folder, config.feature_layers, num_target_layers, feature_layers)
            head_files = replace(head_files, config=replace(config, feature_layers=layers))
        return cls.from_files(head_files)

    def card_fields(self) -> dict:
        config = self.config
        if config.version == "eagle":
            title = "EAGLE-1/2"
            reads = "the target's final hidden state"
            vocabulary = "the target's lm_head and vocabulary"
            if config.token_map_size is not None:
                vocabulary += f" (drafting over its rows at {config.token_map_size} token ids: a token map)"
        else:
            title = "EAGLE-3"
            layers = (list(config.feature_layers) if config.feature_layers
                      else "2, L // 2 and L - 3 (L: its layer count)")
            reads = f"the target's hidden states entering layers {layers} (fused)"
            vocabulary = (f"its own lm_head over a draft vocabulary of {config.draft_vocab_size or config.vocab_size} "
                          "tokens")
        return dict(title=title, reads=reads, vocabulary=vocabulary, hidden_size=config.hidden_size,
                    vocab_size=config.vocab_size)


def export_speculators(
    head: EagleHead,
    folder: str | Path,
    verifier_name_or_path: str | None = None,
    speculative_tokens: int = 3,
    verifier_architectures: Sequence[str] = (),
) -> None:
    """Write `config.json` and `model.safetensors` in the speculators format. EAGLE-3 heads become an "eagle3"
    speculator, which vLLM serves with its verifier; EAGLE-1/2 heads become speculators' older "eagle" model
    (speculators 0.4), which vLLM's speculators loader does not take. The verifier defaults to the head's base model;
    `speculative_tokens` is the greedy proposal's draft length. Our `revision` has no place in the format."""
    config = head.config
    verifier = verifier_name_or_path or config.base_model_name_or_path
    if not verifier:
        raise ValueError(
            "export_speculators: verifier_name_or_path: expected the target's Hub id or path (vLLM loads it), got "
            "None, and the head records no base_model_name_or_path"
        )
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ValueError(f"export_speculators: speculative_tokens: expected an int >= 1, got {speculative_tokens!r}")
    if config.version == "eagle3" and config.feature_layers is None:
        raise ValueError(
            "export_speculators: the head does not record which target layers it fuses (the target's default); load "
            "it with num_target_layers=<the target's num_hidden_layers> or feature_layers=(...) before exporting"
        )
    # speculators has no token map: the exported head drafts over the whole vocabulary
    weights = {name: tensor for name, tensor in head.state_dict().items() if name != "token_map"}
    values, tensors = to_speculators(config, weights, verifier, speculative_tokens, verifier_architectures)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", values)
    write_safetensors(folder / SPECULATORS_WEIGHTS_NAME, tensors)
