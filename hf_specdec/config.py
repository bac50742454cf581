"""`SpeculativeConfig`: what the user asks for, validated before any work is done."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, fields
from typing import Any, Literal, get_args

from hf_specdec.tree.template import DEFAULT_MEDUSA_TREE, MAX_TREE_NODES, TreeTemplate

SpecMethod = Literal["draft", "ngram", "medusa", "eagle", "mtp"]
SPEC_METHODS: tuple[str, ...] = get_args(SpecMethod)

# Beyond this many draft tokens per step the verify forward is mostly wasted work; vLLM caps at 128.
MAX_SPECULATIVE_TOKENS = 64


@dataclass
class SpeculativeConfig:
    """How to speculate. Validated in `__post_init__`; every error names the field."""

    method: SpecMethod = field(default="draft", metadata={"help": f"proposer, one of {SPEC_METHODS}"})
    draft_model: Any = field(default=None, metadata={"help": "the small model for method='draft' (the target's "
                                                     "tokenizer, or another one with draft_tokenizer)"})
    draft_tokenizer: Any = field(
        default=None,
        metadata={"help": "method='draft' with a draft whose tokenizer differs from the target's: the draft's "
                  "tokenizer (with `tokenizer`, the target's); drafts are re-tokenised across the two"},
    )
    tokenizer: Any = field(default=None, metadata={"help": "the target's tokenizer, with draft_tokenizer"})
    heads: Any = field(
        default=None,
        metadata={"help": "draft heads: hf_specdec.heads.MedusaHeads for method='medusa', EagleHead for 'eagle'; "
                  "for 'mtp', optionally the target's MTP layers as a transformers MtpModel (default: loaded from "
                  "the target's checkpoint)"},
    )
    tree_paths: Any = field(
        default=None,
        metadata={
            "help": "method='medusa': a static tree as a list of rank paths (Medusa choices); 'default' for the "
            "heads' own tree (fitted to them in training, else the built-in 34-node tree for 4 heads, or its "
            "rank-sum <= 2 paths over fewer heads); None for a chain"
        },
    )
    num_speculative_tokens: int = field(default=5, metadata={"help": "draft tokens proposed per step (k)"})
    prompt_lookup_min: int = field(default=1, metadata={"help": "shortest n-gram the ngram proposer matches"})
    prompt_lookup_max: int = field(default=3, metadata={"help": "longest n-gram the ngram proposer matches"})
    tree_width: int = field(
        default=1,
        metadata={
            "help": "branches per step: 1 drafts a chain; w > 1 drafts a token tree (the draft model's top-w first "
            "tokens, each continued for k tokens; or up to w matched continuations for ngram)"
        },
    )
    tree_total_tokens: int | None = field(
        default=None,
        metadata={
            "help": "draft model or EAGLE head: build a dynamic (EAGLE-2) tree instead of fixed branches: at each of "
            "k depths expand the tree_width best nodes by cumulative log-probability, then keep the best "
            "tree_total_tokens draft nodes"
        },
    )
    lossy_typical_acceptance: bool = field(
        default=False,
        metadata={
            "help": "LOSSY, opt-in: Medusa's typical acceptance when sampling (accept a draft token when its target "
            "probability exceeds min(posterior_threshold, posterior_alpha * exp(-entropy))); outputs then no longer "
            "follow the target's distribution"
        },
    )
    posterior_threshold: float = field(default=0.09, metadata={"help": "typical acceptance: probability cap"})
    posterior_alpha: float = field(default=0.3, metadata={"help": "typical acceptance: entropy scale"})
    seed: int | None = field(
        default=None,
        metadata={"help": "seed of the torch.Generator used for sampling; None uses torch's global RNG"},
    )
    # EAGLE's names for the dynamic tree, accepted as aliases: top_k = tree_width, depth = num_speculative_tokens,
    # total_tokens = tree_total_tokens
    top_k: InitVar[int | None] = None
    depth: InitVar[int | None] = None
    total_tokens: InitVar[int | None] = None

    def __post_init__(self, top_k: int | None, depth: int | None, total_tokens: int | None) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        for alias, name, value in (("top_k", "tree_width", top_k), ("depth", "num_speculative_tokens", depth),
                                   ("total_tokens", "tree_total_tokens", total_tokens)):
            if value is None:
                continue
            if getattr(self, name) not in (defaults[name], value):
                raise ValueError(
                    f"SpeculativeConfig.{alias}: an alias of {name}, given both ({value} and {getattr(self, name)}); "
                    f"give one"
                )
            setattr(self, name, value)
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"SpeculativeConfig.method: unknown method {self.method!r}; expected one of {list(SPEC_METHODS)}"
            )
        if self.method == "draft":
            if self.draft_model is None:
                raise ValueError(
                    "SpeculativeConfig.draft_model: method='draft' needs a draft model "
                    "(a transformers causal LM that shares the target's tokenizer)"
                )
            if not is_causal_lm(self.draft_model) or is_mtp_model(self.draft_model):
                raise ValueError(
                    "SpeculativeConfig.draft_model: expected a transformers causal LM (a PreTrainedModel), got "
                    f"{describe(self.draft_model)}{method_hint(self.draft_model)}"
                )
            if (self.draft_tokenizer is None) != (self.tokenizer is None):
                given, missing = (("draft_tokenizer", "tokenizer") if self.tokenizer is None
                                  else ("tokenizer", "draft_tokenizer"))
                raise ValueError(
                    f"SpeculativeConfig.{missing}: a draft with another tokenizer needs both tokenizers; {given} "
                    f"was given, {missing} is missing"
                )
            for name in ("draft_tokenizer", "tokenizer"):
                value = getattr(self, name)
                if value is not None and not all(callable(getattr(value, m, None)) for m in ("encode", "decode",
                                                                                             "get_vocab")):
                    raise ValueError(
                        f"SpeculativeConfig.{name}: expected a transformers tokenizer, got {describe(value)}"
                    )
        elif self.draft_tokenizer is not None or self.tokenizer is not None:
            raise ValueError(
                f"SpeculativeConfig.draft_tokenizer: only method='draft' takes tokenizers, got method={self.method!r}"
            )
        elif self.draft_model is not None:
            raise ValueError(
                f"SpeculativeConfig.draft_model: method={self.method!r} does not use a draft model; "
                "drop draft_model or use method='draft'"
            )
        if self.method in HEADS_CLASS:
            if not isinstance(self.heads, heads_class(self.method)):
                raise ValueError(
                    f"SpeculativeConfig.heads: method={self.method!r} needs {HEADS_CLASS[self.method]}, got "
                    f"{describe(self.heads)}{method_hint(self.heads)}"
                )
        elif self.method == "mtp":
            if self.heads is not None and not is_mtp_model(self.heads):
                raise ValueError(
                    "SpeculativeConfig.heads: method='mtp' takes the target's MTP layers as a transformers "
                    f"MtpModel, or None to load them from the target's checkpoint; got {describe(self.heads)}"
                    f"{method_hint(self.heads)}"
                )
        elif self.heads is not None:
            raise ValueError(
                f"SpeculativeConfig.heads: only methods 'medusa', 'eagle' and 'mtp' use heads, got "
                f"method={self.method!r}"
            )
        if self.tree_paths is not None and self.method != "medusa":
            raise ValueError(
                f"SpeculativeConfig.tree_paths: static trees; only method='medusa' uses them, got method={self.method!r}"
            )
        if self.tree_paths == "default":  # the heads' own tree: fitted to them in training, else the built-in one
            own_tree = getattr(self.heads, "tree", None)
            self.tree_paths = own_tree() if callable(own_tree) else DEFAULT_MEDUSA_TREE
        if self.tree_paths is not None:
            try:
                TreeTemplate.from_paths(self.tree_paths)  # validates: a tree, within the node budget
            except (ValueError, TypeError) as error:
                raise ValueError(f"SpeculativeConfig.tree_paths: {error}") from error
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, None)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, None)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"SpeculativeConfig.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        _check_int("tree_width", self.tree_width, 1, MAX_TREE_NODES)
        if 1 + self.tree_width * self.num_speculative_tokens > MAX_TREE_NODES:
            raise ValueError(
                f"SpeculativeConfig.tree_width: a tree of {self.tree_width} branches x {self.num_speculative_tokens} "
                f"tokens has {1 + self.tree_width * self.num_speculative_tokens} nodes, over the budget of "
                f"{MAX_TREE_NODES}"
            )
        if self.tree_total_tokens is not None:
            if self.method not in ("draft", "eagle", "mtp"):
                raise ValueError(
                    f"SpeculativeConfig.tree_total_tokens: dynamic trees need method 'draft', 'eagle' or 'mtp', got "
                    f"{self.method!r}"
                )
            candidates = self.tree_width + (self.num_speculative_tokens - 1) * self.tree_width**2
            _check_int("tree_total_tokens", self.tree_total_tokens, 1, min(candidates, MAX_TREE_NODES - 1))
        for name in ("posterior_threshold", "posterior_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"SpeculativeConfig.{name}: expected a number in (0, 1], got {value!r}")
        if not isinstance(self.lossy_typical_acceptance, bool):
            raise ValueError("SpeculativeConfig.lossy_typical_acceptance: expected True or False")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, None)


    @property
    def max_draft_depth(self) -> int:
        """The deepest draft token a step can propose: k, or the depth of a static tree (`tree_paths`)."""
        if self.tree_paths is None:
            return self.num_speculative_tokens
        return max(self.num_speculative_tokens, TreeTemplate.from_paths(self.tree_paths).max_depth)


# the class each head-based method takes, as users import it
HEADS_CLASS = {"medusa": "hf_specdec.heads.MedusaHeads", "eagle": "hf_specdec.heads.EagleHead"}


def heads_class(method: str) -> type:
    from hf_specdec.heads.eagle import EagleHead
    from hf_specdec.heads.medusa import MedusaHeads

    return {"medusa": MedusaHeads, "eagle": EagleHead}[method]


def is_mtp_model(value: Any) -> bool:
    """transformers' container of a model's multi-token-prediction layers (what `generate(use_mtp=True)` loads)."""
    from transformers.modeling_layers import MtpModel

    return isinstance(value, MtpModel)


def is_causal_lm(value: Any) -> bool:
    """A transformers model (or a wrapper of one, such as a peft model): what method='draft' drafts with."""
    return all(callable(getattr(value, name, None)) for name in ("forward", "get_input_embeddings")) and hasattr(
        value, "config")


def describe(value: Any) -> str:
    """How an error names what the user passed: its class (and None as None)."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def method_hint(value: Any) -> str:
    """'; for a MedusaHeads use method='medusa'' when `value` is what another method takes, else ''."""
    for method in HEADS_CLASS:
        if isinstance(value, heads_class(method)):
            return f"; {describe(value)} is for method={method!r}"
    if is_mtp_model(value):
        return "; an MtpModel holds a target's MTP layers, for method='mtp'"
    if is_causal_lm(value):
        return "; a causal LM is a draft model, for method='draft'"
    return ""


def _check_int(name: str, value: Any, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SpeculativeConfig.{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"SpeculativeConfig.{name}: expected an int {bound}, got {value}")
