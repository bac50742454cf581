"""The MLP speculator (Wertheimer et al. 2024, arXiv 2404.19124) as IBM fms-extras trains it and vLLM serves it
(`method="mlp_speculator"`): a small recurrent MLP on the target's final hidden state that guesses `n_predict`
tokens after the last committed one, each stage conditioned on the token before the one it guesses.

Stage i (0-based) reads the state s_i and the token t_i of the chain: s_0 is the target's final normed hidden state
h at the position that produced the last committed token x, t_0 = x, and t_i (i > 0) is stage i - 1's guess (in
training, the row's true token there). Then

    s_{i+1}  = GELU(norm_i(proj_i(s_i) + (emb_weight / state_weight) * emb_i(t_i)))
    logits_i = head_i(s_{i+1})        # stage i's guess for the token after t_i, i + 1 tokens after x

* state_weight = 0.5 ** (0.5 / n_predict) and emb_weight = sqrt((1 - state_weight^2) * inner / 2): fms-extras'
  weighted add state_weight * proj + emb_weight * emb, divided by state_weight (the scale-free norm absorbs it);
* norm_i is what fms-extras and vLLM call their LayerNorm: x / sqrt(mean(x^2) + 1e-6), no mean subtracted, then
  times a weight plus a bias (keys `ln.{i}.weight`, `ln.{i}.bias`);
* `scale_input`: s_0 = norm(h) / sqrt(2), the same normalisation without weight or bias (fms-extras' `ln0`: no keys);
* proj_0 maps emb_dim -> inner and proj_i (i > 0) inner -> inner, without bias; emb_i is a [V, inner] embedding and
  head_i a [V, inner] projection without bias (inner = `inner_dim`, 0 meaning emb_dim);
* `tie_weights`: every stage uses emb.0, ln.0 and head.0, and every stage after the first proj.1 (proj.0 keeps its
  own: its input width differs). The module then holds only those, so its state dict is the deduplicated one the
  published checkpoints of tied speculators hold.

What it costs: the embeddings and heads are vocabulary-sized, 2 * V * inner parameters per distinct stage (one when
tied, n_predict otherwise), beside emb_dim * inner + inner^2 per further distinct projection. For SmolLM2-135M
(V = 49152, emb_dim 576) with 3 tied stages that is 57.3 M parameters at inner 576 (115 MB in bf16) and 25.4 M at inner
256 (51 MB); untied, 170.9 M and 75.8 M. The vocabulary part dominates: a small `inner_dim` and `tie_weights` keep
files small, at the price of a narrow state.

`shared_vocab` keeps the state wide and the files small: stage i embeds with the target's own input embedding E
[V, emb_dim] and scores with its lm_head W [V, emb_dim], each through a learned map,

    emb_i(t)    = emb_map_i(E[t])        # emb_map_i: emb_dim -> inner, no bias
    logits_i(s) = W @ head_map_i(s)      # head_map_i: inner -> emb_dim, no bias

which is the published speculator with emb_i = E @ emb_map_i^T and head_i = W @ head_map_i: `materialize` (and
`export_fms_extras`, which needs the target for it) writes those products, so vLLM serves it unchanged. The maps hold
2 * emb_dim * inner parameters per distinct stage: for SmolLM2 the whole speculator is 1.3 M parameters at inner 576
with 3 tied stages (2.7 MB in bf16), and 6.2 M at inner 1024 untied (12 MB; 304.7 M with matrices of its own).
Such a speculator runs only beside its target (`target_vocab(target)` hands the two matrices to the calls below;
E is the embedding's weight, whatever scaling the target applies to it in its own forward), and may draft over a
token map (`hf_specdec.heads.token_map`): the lm_head's rows at the D most frequent tokens of its training data, so
that each stage's scoring reads D rows rather than V.

Stored as our adapter folder (method "mlp_speculator"); fms-extras' published layout is converted on load and
written by `export_fms_extras` (`convert.py`), which vLLM loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from importlib.resources import files
from pathlib import Path

import torch
from torch import nn

from hf_specdec.heads.adapter import AdapterMixin, write_json, write_safetensors
from hf_specdec.heads.mlp_speculator.config import MlpSpeculatorConfig
from hf_specdec.heads.mlp_speculator.convert import PUBLISHED_WEIGHTS_NAME, read_published, to_fms_extras
from hf_specdec.heads.target_weights import bias_of, layer_spec, weight_of
from hf_specdec.heads.token_map import TokenMapLMHead, TokenMapMixin

NORM_EPS = 1e-6  # fms-extras' and vLLM's


def rms_normalize(
    # [..., D]
    x: torch.Tensor,
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + 1e-6) over the last dimension, in x's dtype (no mean subtracted)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)


class StageNorm(nn.Module):
    """A stage's norm: `rms_normalize`, then times `weight` plus `bias` (fms-extras' LayerNormParameterized with
    elementwise scale and shift)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x) * self.weight + self.bias


@dataclass(frozen=True)
class TargetVocab:
    """What a `shared_vocab` speculator borrows from its target: the input embedding's weight [V', emb_dim] (V' >= V
    rows) and the lm_head it scores with ([..., emb_dim] -> [..., V'] logits; at a token map, -inf outside it, or
    the map's [..., D] in training)."""

    embeddings: torch.Tensor
    lm_head: nn.Module


class MlpSpeculator(AdapterMixin, TokenMapMixin, nn.Module):
    config_class = MlpSpeculatorConfig
    adapter_types = ("mlp_speculator",)
    card_template = files(__package__).joinpath("card.md")
    upload_message = "Upload MLP speculator (hf_specdec)"
    read_published = staticmethod(read_published)

    def __init__(self, config: MlpSpeculatorConfig) -> None:
        super().__init__()
        self.config = config
        inner, stages, width = config.inner_size, config.n_predict, config.emb_dim
        distinct = 1 if config.tie_weights else stages
        self.proj = nn.ModuleList(nn.Linear(width if i == 0 else inner, inner, bias=False)
                                  for i in range(min(stages, 2) if config.tie_weights else stages))
        self.ln = nn.ModuleList(StageNorm(inner) for _ in range(distinct))
        if config.shared_vocab:
            self.emb_map = nn.ModuleList(nn.Linear(width, inner, bias=False) for _ in range(distinct))
            self.head_map = nn.ModuleList(nn.Linear(inner, width, bias=False) for _ in range(distinct))
        else:
            self.emb = nn.ModuleList(nn.Embedding(config.vocab_size, inner) for _ in range(distinct))
            self.head = nn.ModuleList(nn.Linear(inner, config.vocab_size, bias=False) for _ in range(distinct))
        self._init_token_map(config.vocab_size)
        # fms-extras' initialisation: N(0, 1 / inner) for embeddings and projections (norms start as 1 and 0); the
        # maps of a shared vocabulary start as the identity (on the first coordinates when inner differs from emb_dim)
        with torch.no_grad():
            for module in (*self.proj, *(() if config.shared_vocab else (*self.emb, *self.head))):
                module.weight.normal_(0, 1 / math.sqrt(inner))
            for module in (*self.emb_map, *self.head_map) if config.shared_vocab else ():
                module.weight.copy_(torch.eye(*module.weight.shape))

    def token_map_refusal(self) -> str | None:
        if not self.config.shared_vocab:
            return ("this speculator scores with its own lm_head; a token map is for one that scores with the "
                    "target's (shared_vocab=True)")
        return None

    def target_vocab(self, target: nn.Module, compact: bool = False) -> TargetVocab | None:
        """What the calls below borrow from `target`: its embedding and lm_head (at the token map, if any;
        `compact`: the map's own [..., D] logits, as training learns over them), or None for a speculator with a
        vocabulary of its own."""
        if not self.config.shared_vocab:
            return None
        lm_head = target.get_output_embeddings()
        if compact and self.token_map is not None:
            lm_head = TokenMapLMHead(lm_head, self.token_map, self.config.vocab_size, compact=True)
        else:
            lm_head = self.draft_lm_head(lm_head)
        return TargetVocab(target.get_input_embeddings().weight, lm_head)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj[0].weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj[0].weight.device

    def _stage(self, stage: int) -> tuple[nn.Module, nn.Linear, StageNorm, nn.Linear]:
        """The embedding (its map, with `shared_vocab`), projection, norm and head (its map) stage `stage` uses."""
        if not 0 <= stage < self.config.n_predict:
            raise ValueError(f"MlpSpeculator: stage {stage} does not exist; the speculator has n_predict "
                             f"{self.config.n_predict} stages (0 to {self.config.n_predict - 1})")
        distinct, proj = (0, min(stage, 1)) if self.config.tie_weights else (stage, stage)
        emb, head = (self.emb_map, self.head_map) if self.config.shared_vocab else (self.emb, self.head)
        return emb[distinct], self.proj[proj], self.ln[distinct], head[distinct]

    def _vocab(self, vocab: TargetVocab | None, where: str) -> TargetVocab | None:
        if self.config.shared_vocab and vocab is None:
            raise ValueError(f"MlpSpeculator.{where}: vocab: this speculator embeds and scores with its target's "
                             "embedding and lm_head (shared_vocab); pass target_vocab(target)")
        return vocab

    def input_state(
        self,
        # [..., emb_dim]: the target's final normed hidden state at the position that produced the last token
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """s_0 [..., emb_dim] in the speculator's dtype: the hidden state, normalised and divided by sqrt(2) with
        `scale_input`."""
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        return rms_normalize(hidden) / math.sqrt(2) if self.config.scale_input else hidden

    def advance(
        self,
        stage: int,
        # [..., emb_dim] (stage 0: `input_state`'s) or [..., inner] (the previous stage's)
        state: torch.Tensor,
        # [...]: the token the chain holds at this stage (stage 0: the last committed one)
        tokens: torch.Tensor,
        vocab: TargetVocab | None = None,
    ) -> torch.Tensor:
        """The next state [..., inner]: GELU(norm(proj(state) + (emb_weight / state_weight) * emb(tokens))).
        `vocab`: `target_vocab(target)`, required with `shared_vocab`."""
        emb, proj, norm, _ = self._stage(stage)
        vocab = self._vocab(vocab, "advance")
        if vocab is None:
            embedded = emb(tokens.to(self.device))
        else:
            rows = nn.functional.embedding(tokens.to(vocab.embeddings.device), vocab.embeddings)  # [..., emb_dim]
            embedded = emb(rows.to(self.device, self.dtype))
        mixed = proj(state) + embedded * (self.config.emb_weight / self.config.state_weight)
        return nn.functional.gelu(norm(mixed))

    def stage_logits(
        self,
        stage: int,
        # [..., inner]: the state `advance(stage, ...)` returned
        state: torch.Tensor,
        vocab: TargetVocab | None = None,
    ) -> torch.Tensor:
        """Float logits [..., V]: stage `stage`'s guess for the token after the one it read (-inf outside a token
        map; [..., D] with a compact `vocab`). `vocab`: `target_vocab(target)`, required with `shared_vocab`."""
        head = self._stage(stage)[3]
        vocab = self._vocab(vocab, "stage_logits")
        if vocab is None:
            return head(state).float()
        spec = layer_spec(vocab.lm_head)
        return vocab.lm_head(head(state).to(spec.device, spec.dtype)).float()

    def forward(
        self,
        # [..., emb_dim]: the target's final normed hidden state at the position that produced tokens[..., 0]
        hidden: torch.Tensor,
        # [..., T], T <= n_predict: the last committed token, then the path's drafted tokens
        tokens: torch.Tensor,
        vocab: TargetVocab | None = None,
    ) -> torch.Tensor:
        """Float logits [..., T, V] along a token path: entry j is stage j's guess for the token after tokens[..., j]
        (j + 1 tokens after the last committed one), given the path's tokens up to j. `vocab`:
        `target_vocab(target)`, required with `shared_vocab`."""
        length = tokens.shape[-1]
        if not 1 <= length <= self.config.n_predict:
            raise ValueError(f"MlpSpeculator.forward: tokens: expected 1 to n_predict {self.config.n_predict} tokens "
                             f"per path, got {length}")
        state, logits = self.input_state(hidden), []
        for stage in range(length):
            state = self.advance(stage, state, tokens[..., stage], vocab)
            logits.append(self.stage_logits(stage, state, vocab))
        return torch.stack(logits, dim=-2)

    @torch.no_grad()
    def greedy_chain(
        self,
        # [B, emb_dim]: the target's final normed hidden state at the position that produced `last_tokens`
        hidden: torch.Tensor,
        # [B]: the last committed token of each row
        last_tokens: torch.Tensor,
        num_tokens: int,
        vocab: TargetVocab | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain of `num_tokens` (1 to n_predict) greedy guesses: tokens [B, k] and the float logits [B, k, V] each
        was chosen from (each stage reads the previous stage's guess). `vocab`: `target_vocab(target)`, required
        with `shared_vocab` (not compact)."""
        most = self.config.n_predict
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= most:
            raise ValueError(f"MlpSpeculator.greedy_chain: num_tokens: expected an int from 1 to n_predict "
                             f"{self.config.n_predict} (the speculator guesses at most that many tokens ahead), got "
                             f"{num_tokens!r}")
        state, token = self.input_state(hidden), last_tokens
        chosen, logits = [], []
        for stage in range(num_tokens):
            state = self.advance(stage, state, token, vocab)
            logits.append(self.stage_logits(stage, state, vocab))
            token = logits[-1].argmax(-1)
            chosen.append(token)
        return torch.stack(chosen, dim=-1), torch.stack(logits, dim=-2)

    def check_target(self, target: nn.Module, owner: str = "SpeculativeConfig.heads") -> None:
        """Clear errors when the speculator was made for another model shape (hidden size or vocabulary), or
        shares a vocabulary the target cannot lend."""
        text = target.config.get_text_config(decoder=True)
        self.config.check_sizes(text.hidden_size, text.vocab_size, owner)
        if not self.config.shared_vocab:
            return
        wanted = (self.config.vocab_size, self.config.emb_dim)
        for name, module in (("input embedding", target.get_input_embeddings()),
                             ("lm_head", target.get_output_embeddings())):
            shape = None if getattr(module, "weight", None) is None else tuple(module.weight.shape)
            if shape is None or shape[0] < wanted[0] or shape[1] != wanted[1]:
                raise ValueError(f"{owner}: this MLP speculator embeds and scores with its target's input embedding "
                                 f"and lm_head ({wanted[0]} x {wanted[1]}); the target's {name} is {shape}")
        if self.token_map is not None and int(self.token_map[-1]) >= self.config.vocab_size:
            raise ValueError(f"{owner}: the MLP speculator's token map holds ids up to {int(self.token_map[-1])}, "
                             f"past its vocabulary ({self.config.vocab_size})")

    @torch.no_grad()
    def materialize(self, target: nn.Module) -> MlpSpeculator:
        """This speculator with vocabulary matrices of its own (a `shared_vocab` one's products with `target`'s
        embedding and lm_head: emb_i = E @ emb_map_i^T, head_i = W @ head_map_i), over the whole vocabulary, in
        this speculator's dtype; it drafts as this one does without a token map. Itself when not shared."""
        if not self.config.shared_vocab:
            return self
        self.check_target(target, "MlpSpeculator.materialize")
        lm_head = target.get_output_embeddings()
        if bias_of(lm_head) is not None:
            raise ValueError("MlpSpeculator.materialize: the target's lm_head has a bias, which the published layout's "
                             "head cannot hold")
        vocab = self.config.vocab_size
        embeddings = weight_of(target.get_input_embeddings())[:vocab].to(self.device, torch.float32)  # [V, emb_dim]
        scores = weight_of(lm_head)[:vocab].to(self.device, torch.float32)  # [V, emb_dim]
        config = replace(self.config, shared_vocab=False, token_map_size=None)
        own = MlpSpeculator(config).to(self.device, self.dtype)
        for stage in range(len(self.emb_map)):
            own.emb[stage].weight.copy_(embeddings @ self.emb_map[stage].weight.float().T)
            own.head[stage].weight.copy_(scores @ self.head_map[stage].weight.float())
        for ours, theirs in ((own.proj, self.proj), (own.ln, self.ln)):
            ours.load_state_dict(theirs.state_dict())
        return own.train(self.training)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def card_fields(self) -> dict:
        config = self.config
        tying = ("tied: one embedding, norm and lm_head for every stage" if config.tie_weights
                 else "each stage with its own embedding, norm and lm_head")
        vocabulary = f"its own embeddings and lm_heads over {config.vocab_size} tokens"
        if config.shared_vocab:
            vocabulary = ("the target's own embedding and lm_head, through learned maps" +
                          ("" if config.token_map_size is None else
                           f", drafting over {config.token_map_size} of its {config.vocab_size} tokens (a token map)"))
        return dict(n_predict=config.n_predict, emb_dim=config.emb_dim, inner=config.inner_size,
                    vocabulary=vocabulary, tying=tying, scale_input=config.scale_input,
                    parameters=f"{self.num_parameters() / 1e6:.1f} M")


def export_fms_extras(head: MlpSpeculator, folder: str | Path, target: nn.Module | None = None) -> None:
    """Write `config.json` and `model.safetensors` in IBM fms-extras' published layout (`model_type`
    "mlp_speculator", keys `speculator.{emb,proj,ln,head}.{i}.*`), which vLLM serves with
    `speculative_config={"method": "mlp_speculator", "model": folder}`. The tensors keep the head's dtype (convert
    it first, e.g. `head.to(torch.bfloat16)`, for a smaller file); our `revision` has no place in the format. A
    `shared_vocab` speculator needs its `target`: the layout holds the vocabulary matrices (`materialize`), and no
    token map."""
    if head.config.shared_vocab:
        if target is None:
            raise ValueError("export_fms_extras: target: this speculator embeds and scores with its target's "
                             "embedding and lm_head (shared_vocab), which the published layout stores in full; pass "
                             "the target")
        head = head.materialize(target)
    values, tensors = to_fms_extras(head.config, head.state_dict())
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", values)
    write_safetensors(folder / PUBLISHED_WEIGHTS_NAME, tensors)
