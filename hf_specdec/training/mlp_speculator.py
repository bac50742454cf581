"""MLP speculator training on a frozen target, an objective of the shared training loop (`skeleton.py`: target-written
or raw-text rows, the target's final hidden states cached once, accelerate), as IBM's fms-fsdp trains it.

Teacher-forced on each row's own tokens x: at every position t, stage 0 reads the target's final normed hidden state
h_t and token x_{t+1}, stage i > 0 the state stage i - 1 left at t and token x_{t+1+i}, and stage i learns x_{t+2+i}
(the token i + 1 after the one it read). The loss is the unweighted sum over stages of each stage's mean
cross-entropy over the positions whose target token is trained on (a prompt record's continuation; never padding).

fms-fsdp trains in two stages, which here are the same objective on different rows:

1. on raw text (`--data-source text`): windows of the data files;
2. on the target's own continuations (`--data-source generated`, the default), starting from stage 1's weights
   (`--init-from`): fms-fsdp samples them (`--temperature 1`; the default 0 is greedy), 256 tokens after 64-token
   prompts, for its last 6000 of 21000 steps:

    hf-specdec train mlp_speculator --base TARGET --data FILES --out stage1 --data-source text --steps 15000
    hf-specdec train mlp_speculator --base TARGET --data FILES --out stage2 --init-from stage1 \\
        --temperature 1 --prompt-len 64 --seq-len 320 --steps 6000

A run started from a folder (ours, or fms-extras' published layout) keeps its architecture: its n_predict,
inner_dim, tie_weights, scale_input, shared_vocab, top_k_tokens_per_head and n_candidates must be this run's
options. A new speculator starts from fms-extras' random initialisation, or with `--init-from-target` from the
target's embedding matrix (every stage's `emb`) and lm_head (every stage's `head`): copies when `--inner-dim` is 0 or
the target's hidden size, else both projected onto the top inner_dim right singular vectors of the target's lm_head.

With `--shared-vocab` the speculator embeds and scores with the target's own matrices through learned maps (see
`hf_specdec.heads.mlp_speculator.model`): only the maps, projections and norms train, and the files stay small
whatever the state's width. The maps start as the identity (on the first coordinates when inner_dim differs from
the hidden size), or with `--init-from-target` and a narrower state as those singular vectors. `--token-map-size D`
then drafts over the D most frequent tokens of the training rows, and the stages learn over them (positions whose
token lies outside the map add no loss; accuracy counts them as missed).
The result is saved as our adapter folder, in float32 (`MlpSpeculator.from_pretrained(OUT)`);
`hf_specdec.heads.mlp_speculator.export_fms_extras` writes it in the layout vLLM loads. Defaults follow fms-fsdp:
3 stages, tied weights, scaled input, learning rate 1e-3.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from hf_specdec.heads.mlp_speculator import MlpSpeculator, MlpSpeculatorConfig
from hf_specdec.heads.token_map import map_index, most_frequent_tokens
from hf_specdec.training.config import TrainConfig
from hf_specdec.training.generated import TrainingRows
from hf_specdec.training.skeleton import Objective, train
from hf_specdec.training.target_features import FINAL_LAYER, TargetBatch

# the fields of MlpSpeculatorConfig the options set (the target gives emb_dim and vocab_size)
HEAD_OPTIONS = ("n_predict", "inner_dim", "tie_weights", "scale_input", "shared_vocab", "top_k_tokens_per_head",
                "n_candidates")


@dataclass
class MlpSpeculatorTrainConfig(TrainConfig):
    n_predict: int = field(default=3, metadata={"help": "stages: stage i guesses the token i + 1 after the last one"})
    inner_dim: int = field(default=0, metadata={"help": "width of the speculator's state (0: the target's hidden "
                                                        "size); its embeddings and heads are vocabulary x this"})
    tie_weights: bool = field(default=True, metadata={"help": "every stage shares one embedding, norm and lm_head "
                                                              "(files n_predict times smaller)"})
    scale_input: bool = field(default=True, metadata={"help": "normalise the target's hidden state before stage 0"})
    shared_vocab: bool = field(
        default=False, metadata={"help": "embed and score with the target's own embedding and lm_head through "
                                         "learned maps instead of vocabulary-sized matrices (small files at any "
                                         "inner_dim)"})
    token_map_size: int | None = field(
        default=None, metadata={"help": "with shared_vocab: draft over this many most frequent tokens of the "
                                        "training rows, and learn over them"})
    top_k_tokens_per_head: list[int] | None = field(
        default=None, metadata={"help": "candidates per stage for tree drafting, saved with the speculator (default 5 "
                                        "4 3 ...)"})
    n_candidates: int = field(default=5, metadata={"help": "tree paths kept when drafting, saved with the "
                                                           "speculator"})
    init_from: Path | None = field(
        default=None, metadata={"help": "start from this saved speculator folder (e.g. stage 1's output, for stage 2 "
                                        "on generated data)"})
    init_from_target: bool = field(
        default=False, metadata={"help": "start every stage's embedding and lm_head from the target's: copies at "
                                         "inner_dim 0, else both projected onto the inner_dim directions of the "
                                         "hidden state that move the target's logits most"})

    def _check(self) -> None:
        owner = type(self).__name__
        if self.init_from is not None:
            self.init_from = Path(self.init_from)
        text = AutoConfig.from_pretrained(self.base).get_text_config(decoder=True)
        wanted = self.head_config(text.hidden_size, text.vocab_size)
        if self.seq_len < self.n_predict + 2:
            raise ValueError(f"{owner}.seq_len: stage {self.n_predict - 1} learns the token {self.n_predict + 1} "
                             f"after a position; expected at least n_predict + 2 = {self.n_predict + 2} tokens per "
                             f"row, got {self.seq_len}")
        if self.token_map_size is not None and (isinstance(self.token_map_size, bool) or self.token_map_size < 1
                                                or not self.shared_vocab):
            raise ValueError(f"{owner}.token_map_size: expected an int >= 1 with shared_vocab, got "
                             f"{self.token_map_size!r} (shared_vocab={self.shared_vocab})")
        if self.token_map_size is not None and self.token_map_size > text.vocab_size:
            raise ValueError(f"{owner}.token_map_size: expected at most the target's vocabulary, {text.vocab_size}, "
                             f"got {self.token_map_size}")
        if self.init_from_target and self.init_from is not None:
            raise ValueError(f"{owner}.init_from_target: starts a new speculator from the target's embeddings, and "
                             f"init_from {self.init_from} from a saved one; pass one of them")
        if self.init_from_target and wanted.inner_size > text.hidden_size:
            raise ValueError(f"{owner}.init_from_target: starts the stages' embeddings and lm_head from the target's "
                             f"({text.hidden_size} wide), which cannot fill inner_dim {self.inner_dim}; use an "
                             f"inner_dim of at most {text.hidden_size} (0: the target's) or drop init_from_target")
        if self.init_from is not None:
            saved = load_speculator(self.init_from, owner).config
            saved.check_sizes(text.hidden_size, text.vocab_size, f"{owner}.init_from")
            for name in HEAD_OPTIONS:
                mine, theirs = (getattr(c, "inner_size" if name == "inner_dim" else name) for c in (wanted, saved))
                if mine != theirs:
                    raise ValueError(
                        f"{owner}.init_from: {self.init_from} holds a speculator with {name} {theirs!r}, this run "
                        f"asks for {mine!r}; pass the options it was trained with")

    def head_config(self, hidden_size: int, vocab_size: int) -> MlpSpeculatorConfig:
        """The speculator these options make for a target of `hidden_size` and `vocab_size` (errors name the
        options)."""
        try:
            return MlpSpeculatorConfig(emb_dim=hidden_size, vocab_size=vocab_size,
                                       **{name: getattr(self, name) for name in HEAD_OPTIONS},
                                       base_model_name_or_path=str(self.base))
        except ValueError as error:
            raise ValueError(str(error).replace("MlpSpeculatorConfig.", f"{type(self).__name__}.")) from None


def load_speculator(folder: Path, owner: str) -> MlpSpeculator:
    """The saved speculator in `folder` (errors name the option that gave it)."""
    try:
        return MlpSpeculator.from_pretrained(folder)
    except ValueError as error:
        raise ValueError(f"{owner}.init_from: {error}") from None


def init_from_target(head: MlpSpeculator, target: nn.Module) -> None:
    """Every stage's embedding and lm_head start from the target's embedding matrix and lm_head: copies when the
    speculator is as wide as the target, else both projected onto the top inner_dim right singular vectors of the
    target's lm_head (the directions of the hidden state that move its logits most), so that every token of the
    vocabulary, not only those the training rows hold, starts where the target puts it. A `shared_vocab`
    speculator uses the target's own matrices: its maps start as the identity, or as that projection."""
    embeddings, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    inner = head.config.inner_size
    if head.config.shared_vocab:
        if inner < lm_head.shape[1]:
            basis = _top_directions(lm_head, inner)
            with torch.no_grad():
                for emb_map, head_map in zip(head.emb_map, head.head_map, strict=True):
                    emb_map.weight.copy_(basis.T)
                    head_map.weight.copy_(basis)
        return
    if inner < lm_head.shape[1]:
        basis = _top_directions(lm_head, inner)
        # at the random initialisation's scale (entries of variance 1 / inner): the stages' states are normed, GELU'd
        # vectors, not the target's hidden states, and the target's own scale makes logits far too confident
        embeddings, lm_head = (_rescaled(matrix.detach().float() @ basis) for matrix in (embeddings, lm_head))
    with torch.no_grad():
        for modules, source, name in ((head.emb, embeddings, "embedding matrix"), (head.head, lm_head, "lm_head")):
            for module in modules:
                if module.weight.shape != source.shape:
                    raise ValueError(f"MlpSpeculatorTrainConfig.init_from_target: the target's {name} gives "
                                     f"{tuple(source.shape)}, the speculator's is {tuple(module.weight.shape)}; drop "
                                     f"init_from_target")
                module.weight.copy_(source)


def _top_directions(
    # [V, H]
    lm_head: torch.Tensor,
    inner: int,
) -> torch.Tensor:
    """[H, inner]: the top `inner` right singular vectors of the lm_head's weight."""
    _, _, right = torch.linalg.svd(lm_head.detach().float(), full_matrices=False)  # right: [H, H]
    return right[:inner].T


def _rescaled(
    # [V, inner]
    matrix: torch.Tensor,
) -> torch.Tensor:
    """`matrix` times one factor that makes its entries' mean square 1 / inner (fms-extras' initial variance)."""
    return matrix * torch.rsqrt(matrix.pow(2).mean() * matrix.shape[1])


class MlpSpeculatorObjective(Objective):
    """The speculator plus its loss."""

    feature_layers = FINAL_LAYER

    def __init__(self, head: MlpSpeculator) -> None:
        super().__init__()
        self.head = head
        self.min_batch_length = head.config.n_predict + 2  # every stage has a token to learn

    def forward(self, batch: TargetBatch, target: nn.Module) -> tuple[torch.Tensor, dict]:
        # ([B, L], [B, L] bool) per distance d = 1 .. n_predict + 1: x_{t+d}, and whether it is trained on; stage j
        # reads x_{t+1+j} and learns x_{t+2+j}
        ahead = [batch.ahead(distance) for distance in range(1, self.head.config.n_predict + 2)]
        keep = torch.stack([trained for _, trained in ahead[1:]]).any(0)  # [B, L]: positions some stage learns from
        state = self.head.input_state(batch.features[keep])  # [N, H]: h_t
        vocab = self.head.target_vocab(target, compact=True)  # None: the speculator's own matrices
        token_map = self.head.token_map  # [D] or None: learn over the map's ids, as it drafts
        # [V]: each target id's index in the map, -1 outside it
        index = None if token_map is None else map_index(token_map, self.head.config.vocab_size)
        total, losses, accuracies = state.new_zeros((), dtype=torch.float32), [], []
        for stage, ((read, _), (label, trained)) in enumerate(itertools.pairwise(ahead)):
            state = self.head.advance(stage, state, read[keep], vocab)  # [N, inner]
            logits = self.head.stage_logits(stage, state, vocab)  # [N, V], or [N, D] over a token map
            label, weight = label[keep], trained[keep].float()  # [N] each
            learned = weight
            if index is not None:  # renumbered to the map; a token outside it adds no loss, and is missed
                label = index[label]
                learned = weight * (label >= 0)
            count = weight.sum().clamp(min=1)
            entropy = nn.functional.cross_entropy(logits, label.clamp(min=0), reduction="none")
            loss = (entropy * learned).sum() / learned.sum().clamp(min=1)
            total = total + loss
            losses.append(float(loss.detach()))
            accuracies.append(float(((logits.argmax(-1) == label).float() * weight).sum() / count))
        # accuracy: stage 0's top-1 agreement with the row's token; the lists hold every stage
        return total, {"accuracy": accuracies[0], "stage_accuracy": accuracies, "stage_loss": losses}

    def save(self, out: Path, target: nn.Module, rows: TrainingRows, result: dict) -> None:
        self.head.save_pretrained(out)


def make_objective(config: MlpSpeculatorTrainConfig, target: nn.Module, rows: TrainingRows) -> MlpSpeculatorObjective:
    """The speculator to train: the saved one of `init_from`, or a new one for the target (its embeddings and heads
    copies of the target's with `init_from_target`), wrapped in its loss."""
    text = target.config.get_text_config(decoder=True)
    least = config.n_predict + 2
    if rows.input_ids.shape[1] < least:
        raise ValueError(f"MlpSpeculatorTrainConfig.n_predict: stage {config.n_predict - 1} learns the token "
                         f"{least - 1} after a position; the training rows hold {rows.input_ids.shape[1]} tokens, "
                         f"expected at least {least}")
    if config.init_from is not None:
        head = load_speculator(config.init_from, type(config).__name__)
        head.config.base_model_name_or_path, head.config.revision = str(config.base), None
    else:
        head = MlpSpeculator(config.head_config(text.hidden_size, text.vocab_size))
        if config.init_from_target:
            init_from_target(head, target)
    if config.token_map_size is not None:
        head.set_token_map(most_frequent_tokens(rows.tokens(), text.vocab_size, config.token_map_size))
    head.check_target(target, type(config).__name__)
    return MlpSpeculatorObjective(head.train().to(target.device))


def train_mlp_speculator(config: MlpSpeculatorTrainConfig) -> dict:
    return train(config, make_objective)
