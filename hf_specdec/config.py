"""`SpeculativeConfig`: what the user asks for, validated before any work is done."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, fields
from typing import Any, Literal, get_args

from hf_specdec.heads.token_map import check_token_map
from hf_specdec.suffix.cache import SuffixCache
from hf_specdec.suffix.config import SuffixConfig
from hf_specdec.tree.dynamic import candidate_count
from hf_specdec.tree.template import DEFAULT_MEDUSA_TREE, MAX_TREE_NODES, TreeTemplate

SpecMethod = Literal["draft", "ngram", "medusa", "eagle", "mtp", "mlp_speculator", "early_exit", "suffix",
                     "recycling", "auto"]
SPEC_METHODS: tuple[str, ...] = get_args(SpecMethod)
# the candidates method='auto' chooses among: the lookups, then the model drafters (each needs its drafter given)
AutoMethod = Literal["ngram", "suffix", "recycling", "draft", "medusa", "eagle", "mlp_speculator"]
AUTO_METHODS: tuple[str, ...] = get_args(AutoMethod)
# the host lookups (their drafting costs next to nothing): method='auto' takes them without auto_methods, beside the
# draft model or heads given; token recycling only when listed
AUTO_LOOKUPS = ("ngram", "suffix")
Schedule = Literal["adaptive", "fixed"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
DraftQuantization = Literal["int8"]
# SpeculativeConfig.tree_total_tokens: the tree's size from measured verify costs (hf_specdec.schedule.tree_size)
TREE_SIZE_AUTO = "auto"
# method='recycling' keeps this many candidates per token: its trees' ranks are below it
RECYCLED_CANDIDATES = 8
# methods whose drafter drafts position by position, so that draft_confidence can stop a row's chain
CONFIDENCE_METHODS = ("draft", "eagle", "mtp", "early_exit", "auto")
DRAFT_QUANTIZATIONS: tuple[str, ...] = get_args(DraftQuantization)
# methods that draft with a model of their own (a draft model or heads), whose weights draft_quantization may copy
QUANTIZABLE_METHODS = ("draft", "medusa", "eagle", "mlp_speculator")

# Beyond this many draft tokens per step the verify forward is mostly wasted work; vLLM caps at 128.
MAX_SPECULATIVE_TOKENS = 64
DEFAULT_SPECULATIVE_TOKENS = 5
# method='recycling' without tree_paths or tree_total_tokens: draft nodes of its default tree
DEFAULT_RECYCLING_NODES = 8
# methods that draft token trees whatever tree_width says (suffix decoding drafts chains for a target that needs them)
TREE_METHODS = ("recycling",)
# methods whose static trees are rank paths (tree_paths)
STATIC_TREE_METHODS = ("medusa", "recycling")
# methods a suffix config may fall back to when its draft scores low (hybrid drafting)
FALLBACK_METHODS = ("draft", "medusa", "eagle")
# SpeculativeConfig's suffix settings (vLLM's names), the SuffixConfig fields they set, and their defaults (its own)
SUFFIX_FIELDS = ("max_tree_depth", "max_cached_requests", "max_spec_factor", "max_spec_offset", "min_token_prob")
SUFFIX_CONFIG_FIELDS = ("max_depth", "max_cached_requests", "max_spec_factor", "max_spec_offset", "min_token_prob")
SUFFIX_DEFAULTS = {name: field_.default for name, field_ in zip(
    SUFFIX_FIELDS, (SuffixConfig.__dataclass_fields__[own] for own in SUFFIX_CONFIG_FIELDS), strict=True)}


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
    draft_token_map: Any = field(
        default=None,
        metadata={"help": "a draft model with the target's tokenizer: a 1-D tensor of the token ids it drafts "
                          "(e.g. hf_specdec.heads.token_map.most_frequent_tokens of text like the target's): its "
                          "lm_head projects onto those rows only, which is cheaper; None: the whole vocabulary "
                          "(heads carry their own map: set_token_map)"},
    )
    heads: Any = field(
        default=None,
        metadata={"help": "draft heads: hf_specdec.heads.MedusaHeads for method='medusa', EagleHead for 'eagle', "
                          "MlpSpeculator for 'mlp_speculator'; for 'mtp', optionally the target's MTP layers as a "
                          "transformers MtpModel (default: loaded from the target's checkpoint)"},
    )
    early_exit_layer: int | None = field(
        default=None,
        metadata={"help": "method='early_exit': draft with the target's first N layers, its final norm and lm_head "
                          "(N from 1 to the target's layers - 1)"},
    )
    tree_paths: Any = field(
        default=None,
        metadata={
            "help": "method='medusa': a static tree as a list of rank paths (Medusa choices); 'default' for the "
            "heads' own tree (fitted to them in training, else the built-in 34-node tree for 4 heads, or its "
            "rank-sum <= 2 paths over fewer heads); None for a chain. method='recycling': its tree's rank paths "
            "(ranks < 8; default: the tree_total_tokens paths of highest prior acceptance)"
        },
    )
    num_speculative_tokens: int | None = field(
        default=None,
        metadata={"help": f"draft tokens proposed per step (k); default {DEFAULT_SPECULATIVE_TOKENS}, and for "
                          "method='suffix' max_tree_depth (a maximum: a suffix draft is as long as its score allows)"},
    )
    prompt_lookup_min: int = field(default=1, metadata={"help": "shortest n-gram the ngram proposer matches"})
    prompt_lookup_max: int = field(default=3, metadata={"help": "longest n-gram the ngram proposer matches"})
    tree_width: int = field(
        default=1,
        metadata={
            "help": "branches per step: 1 drafts a chain; w > 1 drafts a token tree (the drafter's top-w first "
            "tokens, each continued for k tokens, for draft, early_exit and mlp_speculator; or up to w matched "
            "continuations for ngram)"
        },
    )
    tree_total_tokens: int | Literal["auto"] | None = field(
        default=None,
        metadata={
            "help": "draft model, early exit, EAGLE head or MLP speculator: build a dynamic (EAGLE-2) tree instead of "
            "fixed branches: at each of k depths expand the tree_width best nodes by cumulative log-probability, "
            "then keep the best tree_total_tokens draft nodes (a step the "
            "adaptive schedule narrows to d < k depths keeps ceil(tree_total_tokens * d / k); method='auto': its "
            "draft model, EAGLE head or MLP speculator drafts such trees, n-gram lookup and suffix decoding chains); "
            "'auto': the most nodes whose verify forward costs at most 10% more than the chain's, measured once "
            "per model, dtype, device, batch size and k (hf_specdec.schedule.tree_size); ngram with tree_width > 1: "
            "the most draft nodes its trie of matched continuations keeps; recycling: the draft nodes of its default "
            f"tree (default {DEFAULT_RECYCLING_NODES}, at most k deep; 'auto' as for dynamic trees, at most "
            "64)"
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
        metadata={"help": "seed of the torch.Generator used for sampling; None uses torch's global RNG. Reproducible "
                          "text from a seed needs schedule='fixed' (the adaptive widths follow measured step times)"},
    )
    schedule: Schedule = field(
        default="adaptive",
        metadata={
            "help": "'adaptive': each step drafts 0..k tokens per row (0: the row decodes plainly), chosen from "
            "measured acceptance and costs to maximise tokens per second; 'fixed': always k"
        },
    )
    draft_confidence: float | None = field(
        default=None,
        metadata={
            "help": "a drafter that drafts a chain position by position (draft model, EAGLE head, MTP layers, early "
            "exit): a row stops drafting at the first position where its running confidence (the product of the "
            "drafter's top probabilities so far) falls below this number in (0, 1), so a confident stretch drafts "
            "all k tokens and an unsure one stops early or drafts nothing; for a fixed k (schedule='fixed'), whose "
            "steps it shortens where the drafter is unsure. None: every position the schedule allows. Lossless: it "
            "sees the drafter's distributions only"
        },
    )
    parallel_drafting: bool = field(
        default=False,
        metadata={
            "help": "method 'draft' (or 'auto' with a draft model) with a parallel draft model (PARD): each step "
            "feeds the committed tokens and k - 1 mask tokens in one draft forward and drafts the k tokens it "
            "predicts there (the mask tokens' keys and values are dropped), instead of k forwards; chains only "
            "(vLLM's name)"
        },
    )
    pard_token: int | None = field(
        default=None,
        metadata={"help": "parallel_drafting: the mask token id the draft fills; None: the draft's config "
                          "`pard_token` (PARD checkpoints) or `mask_token_id`"},
    )
    disable_by_batch_size: int | None = field(
        default=None,
        metadata={"help": "no speculation while this many rows or more are generating (vLLM's name)"},
    )
    num_speculative_tokens_per_batch_size: Any = field(
        default=None,
        metadata={
            "help": "[[start, end, k], ...]: at most k draft tokens while the rows generating are in [start, end] "
            "(sorted, non-overlapping; k = 0 turns speculation off there)"
        },
    )
    # method='suffix' (suffix decoding; vLLM's suffix_decoding_* options, with vLLM's defaults)
    max_tree_depth: int = field(
        default=SUFFIX_DEFAULTS["max_tree_depth"],
        metadata={"help": "suffix: longest token string the suffix trees count (a match of m tokens drafts at most "
                          "max_tree_depth - m)"},
    )
    max_cached_requests: int = field(
        default=SUFFIX_DEFAULTS["max_cached_requests"],
        metadata={"help": "suffix: outputs of earlier requests kept in the global tree, first in first out; 0 keeps "
                          "none (each request drafts from its own prompt and output only)"},
    )
    max_spec_factor: float = field(
        default=SUFFIX_DEFAULTS["max_spec_factor"],
        metadata={"help": "suffix: a match of m tokens drafts at most m * max_spec_factor + max_spec_offset tokens"},
    )
    max_spec_offset: float = field(default=SUFFIX_DEFAULTS["max_spec_offset"],
                                   metadata={"help": "suffix: see max_spec_factor"})
    min_token_prob: float = field(
        default=SUFFIX_DEFAULTS["min_token_prob"],
        metadata={"help": "suffix: a draft token is proposed while its running probability (the product of count "
                          "ratios from the match) is at least this, in (0, 1]"},
    )
    suffix_cache: Any = field(
        default=None,
        metadata={"help": "suffix: a hf_specdec.suffix.SuffixCache to draft from and add outputs to (shared by every "
                          "call given it); None: the process-wide cache for these suffix settings"},
    )
    fallback: Any = field(
        default=None,
        metadata={"help": "suffix: hybrid drafting: a SpeculativeConfig (method 'draft', 'medusa' or "
                          "'eagle') whose drafter proposes for a row in a step where the suffix draft scores below "
                          "fallback_min_score"},
    )
    fallback_min_score: float | None = field(
        default=None,
        metadata={"help": "suffix with a fallback: a row drafts from the suffix trees when its suffix draft's score "
                          "(the expected number of accepted tokens) is at least this, else from the fallback; None: "
                          "the fallback's draft depth (its k), as ArcticInference decides"},
    )
    auto_methods: Any = field(
        default=None,
        metadata={"help": f"auto: the candidates it chooses among, a list of {list(AUTO_METHODS)} (the model "
                          "drafters need their draft_model or heads); None: n-gram lookup, suffix decoding and the "
                          "draft model or heads given"},
    )
    draft_quantization: DraftQuantization | None = field(
        default=None,
        metadata={"help": "'int8': the drafter (a draft model, Medusa heads, an EAGLE head, an MLP speculator; its "
                          "lm_head at a token map too) reads int8 copies of its linear layers' weights in narrow "
                          "calls (at most 4 tokens, 16 in float32) on a CPU: faster drafting, drafts a little "
                          "different, output unchanged (verification is exact); None: the drafter's own weights"},
    )
    # EAGLE's names for the dynamic tree, accepted as aliases: top_k = tree_width, depth = num_speculative_tokens,
    # total_tokens = tree_total_tokens; and LayerSkip's exit_layer = early_exit_layer
    top_k: InitVar[int | None] = None
    depth: InitVar[int | None] = None
    total_tokens: InitVar[int | None] = None
    exit_layer: InitVar[int | None] = None

    def __post_init__(self, top_k: int | None, depth: int | None, total_tokens: int | None,
                      exit_layer: int | None) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        for alias, name, value in (("top_k", "tree_width", top_k), ("depth", "num_speculative_tokens", depth),
                                   ("total_tokens", "tree_total_tokens", total_tokens),
                                   ("exit_layer", "early_exit_layer", exit_layer)):
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
        self._check_suffix()
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = (self.max_tree_depth if self.method == "suffix"
                                           else DEFAULT_SPECULATIVE_TOKENS)
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
        elif self.method == "auto":
            if self.draft_model is not None and (not is_causal_lm(self.draft_model)
                                                 or is_mtp_model(self.draft_model)):
                raise ValueError(
                    "SpeculativeConfig.draft_model: method='auto' takes an optional draft model (a transformers "
                    f"causal LM), got {describe(self.draft_model)}{method_hint(self.draft_model)}"
                )
        elif self.draft_model is not None:
            raise ValueError(
                f"SpeculativeConfig.draft_model: method={self.method!r} does not use a draft model; "
                "drop draft_model or use method='draft'"
            )
        self._check_draft_token_map()
        self._check_draft_quantization()
        if self.method in HEADS_CLASS:
            if not isinstance(self.heads, heads_class(self.method)):
                raise ValueError(
                    f"SpeculativeConfig.heads: method={self.method!r} needs {HEADS_CLASS[self.method]}, got "
                    f"{describe(self.heads)}{method_hint(self.heads)}"
                )
        elif self.method == "auto" and self.heads is not None:
            if self.heads_method is None:
                raise ValueError(
                    f"SpeculativeConfig.heads: method='auto' takes optional heads (MedusaHeads, an EagleHead or an "
                    f"MlpSpeculator) to choose among with n-gram lookup and suffix decoding; got "
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
                f"SpeculativeConfig.heads: only methods {sorted(HEADS_CLASS)}, 'mtp' and 'auto' use heads, got "
                f"method={self.method!r}"
            )
        if self.method == "early_exit":
            if self.early_exit_layer is None:
                raise ValueError("SpeculativeConfig.early_exit_layer: method='early_exit' needs the layer to draft "
                                 "from (early_exit_layer=N: the target's first N layers)")
            _check_int("early_exit_layer", self.early_exit_layer, 1, None)
        elif self.early_exit_layer is not None:
            raise ValueError(f"SpeculativeConfig.early_exit_layer: only method='early_exit' uses it, got "
                             f"method={self.method!r}")
        if self.tree_paths is not None and self.method not in STATIC_TREE_METHODS:
            raise ValueError(
                f"SpeculativeConfig.tree_paths: static trees of rank paths; only methods {list(STATIC_TREE_METHODS)} "
                f"use them, got method={self.method!r}"
            )
        if self.tree_paths == "default" and self.method == "recycling":
            raise ValueError("SpeculativeConfig.tree_paths='default' names Medusa heads' own tree; method='recycling' "
                             "drafts its default tree without tree_paths (sized by tree_total_tokens)")
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
        self._check_recycling()
        self._check_auto_methods()
        if self.tree_total_tokens is not None:
            if self.method not in SIZED_TREE_METHODS:
                raise ValueError(
                    f"SpeculativeConfig.tree_total_tokens: trees of a chosen size need a method of "
                    f"{list(SIZED_TREE_METHODS)}, got {self.method!r}"
                )
            if self.method == "auto" and self.draft_model is None and self.heads_method not in ("eagle",
                                                                                                 "mlp_speculator"):
                raise ValueError(
                    "SpeculativeConfig.tree_total_tokens: method='auto' builds the dynamic tree with its model "
                    "drafter (a draft_model, an EagleHead or an MlpSpeculator as heads), and this config has "
                    f"{'Medusa heads' if self.heads_method == 'medusa' else 'none'}; drop tree_total_tokens (the "
                    "lookups draft chains) or pass such a drafter"
                )
            if self.method == "ngram" and self.tree_width < 2:
                raise ValueError(
                    f"SpeculativeConfig.tree_total_tokens: n-gram lookup drafts a trie of tree_width continuations "
                    f"and tree_width is {self.tree_width}, a chain of k tokens; set tree_width (e.g. 4) or drop "
                    "tree_total_tokens"
                )
            if isinstance(self.tree_total_tokens, str) and self.tree_total_tokens != TREE_SIZE_AUTO:
                raise ValueError(f"SpeculativeConfig.tree_total_tokens: expected an int or '{TREE_SIZE_AUTO}', got "
                                 f"{self.tree_total_tokens!r}")
            if self.tree_total_tokens == TREE_SIZE_AUTO:
                if self.tree_width < 2 and self.method != "recycling":
                    raise ValueError(
                        "SpeculativeConfig.tree_total_tokens='auto' sizes a dynamic tree of tree_width >= 2 "
                        f"branches per node, and tree_width is {self.tree_width}; set tree_width (e.g. 4) or drop "
                        "tree_total_tokens for a chain"
                    )
            else:
                _check_int("tree_total_tokens", self.tree_total_tokens, 1, MAX_TREE_NODES - 1)
                if self.tree_total_tokens > self.max_tree_nodes:
                    offer = (f"rank paths of up to k tokens over its {RECYCLED_CANDIDATES} candidates per token"
                             if self.method == "recycling" else
                             "tree_width continuations of k tokens" if self.method == "ngram" else
                             "the tree_width best nodes of each of k depths, each offering tree_width children")
                    raise ValueError(
                        f"SpeculativeConfig.tree_total_tokens: expected an int in [1, {self.max_tree_nodes}], got "
                        f"{self.tree_total_tokens}: with k = {self.num_speculative_tokens} and tree_width = "
                        f"{self.tree_width}, method={self.method!r} has {self.max_tree_nodes} draft nodes to keep "
                        f"({offer}); lower tree_total_tokens or raise num_speculative_tokens"
                        f"{'' if self.method == 'recycling' else ' / tree_width'}"
                    )
        for name in ("posterior_threshold", "posterior_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"SpeculativeConfig.{name}: expected a number in (0, 1], got {value!r}")
        if not isinstance(self.lossy_typical_acceptance, bool):
            raise ValueError("SpeculativeConfig.lossy_typical_acceptance: expected True or False")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, None)
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"SpeculativeConfig.schedule: unknown schedule {self.schedule!r}; expected one of {list(SCHEDULES)}"
            )
        self._check_draft_confidence()
        self._check_parallel_drafting()
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if self.num_speculative_tokens_per_batch_size is not None:
            from hf_specdec.schedule.rules import check_batch_size_schedule

            self.num_speculative_tokens_per_batch_size = check_batch_size_schedule(
                self.num_speculative_tokens_per_batch_size, self.num_speculative_tokens)

    def _check_recycling(self) -> None:
        if self.method != "recycling":
            return
        if self.tree_width != 1:
            raise ValueError(
                f"SpeculativeConfig.tree_width={self.tree_width}: method='recycling' drafts a tree of rank paths; "
                "size it with tree_total_tokens, or give its paths with tree_paths, and drop tree_width"
            )
        if self.tree_paths is not None:
            if self.tree_total_tokens is not None:
                raise ValueError("SpeculativeConfig.tree_total_tokens: method='recycling' takes its tree from "
                                 "tree_paths or builds one of tree_total_tokens nodes; give one of the two")
            deepest = max(max(path) for path in self.tree_paths)
            if deepest >= RECYCLED_CANDIDATES:
                raise ValueError(
                    f"SpeculativeConfig.tree_paths: rank {deepest} in a path; method='recycling' keeps the "
                    f"{RECYCLED_CANDIDATES} best candidates per token (ranks 0 to {RECYCLED_CANDIDATES - 1})"
                )

    def _check_draft_confidence(self) -> None:
        value = self.draft_confidence
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise ValueError(f"SpeculativeConfig.draft_confidence: expected a number in (0, 1) or None, got {value!r}")
        problem = None
        if self.method not in CONFIDENCE_METHODS:
            problem = f"method={self.method!r} drafts all its positions at once or by lookup"
        elif self.method == "auto" and self.draft_model is None and self.heads_method != "eagle":
            problem = "method='auto' has no draft model or EAGLE head here"
        elif self.draft_tokenizer is not None:
            problem = "a draft with another tokenizer drafts text, not the target's tokens"
        elif self.tree_width > 1 or self.tree_total_tokens is not None:
            problem = "a token tree (tree_width, tree_total_tokens) ranks its nodes by the drafter's confidence already"
        if problem is not None:
            raise ValueError(
                f"SpeculativeConfig.draft_confidence={value!r}: stops chains drafted position by position (methods "
                f"{list(CONFIDENCE_METHODS)}, 'auto' with a draft model or an EAGLE head); {problem}. Drop "
                "draft_confidence"
            )

    def _check_parallel_drafting(self) -> None:
        if not isinstance(self.parallel_drafting, bool):
            raise ValueError(
                f"SpeculativeConfig.parallel_drafting: expected True or False, got {self.parallel_drafting!r}")
        if not self.parallel_drafting:
            if self.pard_token is not None:
                raise ValueError("SpeculativeConfig.pard_token: the mask id of a parallel draft model, used only with "
                                 "parallel_drafting=True; set it or drop pard_token")
            return
        if self.pard_token is not None:
            _check_int("pard_token", self.pard_token, 0, None)
        problem = None
        if self.method not in ("draft", "auto"):
            problem = f"it runs a draft model, which method={self.method!r} does not (use method='draft')"
        elif self.draft_model is None:
            problem = f"method={self.method!r} drafts in parallel with a draft model; pass draft_model"
        elif self.draft_tokenizer is not None:
            problem = "a draft with another tokenizer drafts text, not the target's tokens"
        elif self.tree_width > 1 or self.tree_total_tokens is not None:
            problem = "it drafts one chain: the k tokens the draft predicts after the mask tokens"
        elif self.draft_confidence is not None:
            problem = ("draft_confidence stops a chain drafted position by position, and it drafts every position "
                       "at once")
        if problem is not None:
            raise ValueError(f"SpeculativeConfig.parallel_drafting: {problem}; drop parallel_drafting or that option")

    def _check_draft_quantization(self) -> None:
        if self.draft_quantization is None:
            return
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"SpeculativeConfig.draft_quantization: expected None or one of "
                             f"{list(DRAFT_QUANTIZATIONS)}, got {self.draft_quantization!r}")
        if self.method in QUANTIZABLE_METHODS:
            return
        if self.method == "auto" and (self.draft_model is not None or self.heads is not None):
            return  # its model candidate drafts with int8 copies; the lookups have no weights
        hint = {
            "auto": "method='auto' has no model drafter here (pass a draft_model or heads)",
            "suffix": "suffix decoding has no weights (with a fallback, set it on the fallback's config)",
            "early_exit": "early exit drafts with the target's own layers, whose keys and values verification reuses",
            "mtp": "MTP layers are the target's own",
        }.get(self.method, f"method={self.method!r} drafts without a model")
        raise ValueError(f"SpeculativeConfig.draft_quantization={self.draft_quantization!r}: for a drafter model "
                         f"(methods {list(QUANTIZABLE_METHODS)}, or 'auto' with one); {hint}")

    def _check_draft_token_map(self) -> None:
        if self.draft_token_map is None:
            return
        if self.draft_model is None or self.method not in ("draft", "auto"):
            raise ValueError(
                f"SpeculativeConfig.draft_token_map: the token ids a draft model drafts, for method='draft' (or "
                f"'auto' with a draft_model); got method={self.method!r} without a draft model. Heads that project "
                "with the target's lm_head carry their own map (set_token_map)"
            )
        if self.draft_tokenizer is not None:
            raise ValueError("SpeculativeConfig.draft_token_map: needs a draft that shares the target's tokenizer; "
                             "this draft has its own (draft_tokenizer)")
        self.draft_token_map = check_token_map(self.draft_token_map, None, "SpeculativeConfig.draft_token_map")

    def _check_auto_methods(self) -> None:
        """auto_methods: only for method='auto'; known names, once each, each model drafter's drafter given and each
        drafter given listed (kept as a tuple). None stays None: `auto_candidates` derives the default from the
        drafters given, so a copy with other drafters (`dataclasses.replace`) gets its own."""
        if self.method != "auto" or self.auto_methods is None:
            if self.auto_methods is not None:
                raise ValueError(f"SpeculativeConfig.auto_methods: the candidates of method='auto'; got "
                                 f"method={self.method!r}")
            return
        if isinstance(self.auto_methods, str) or not isinstance(self.auto_methods, (list, tuple)):
            raise ValueError(f"SpeculativeConfig.auto_methods: expected a list of method names from "
                             f"{list(AUTO_METHODS)}, got {self.auto_methods!r}")
        methods = tuple(self.auto_methods)
        unknown = [m for m in methods if m not in AUTO_METHODS]
        if unknown or not methods or len(set(methods)) < len(methods):
            problem = (f"unknown {unknown}" if unknown else "none given" if not methods else "a method given twice")
            raise ValueError(f"SpeculativeConfig.auto_methods: {problem} in {list(methods)}; give each candidate "
                             f"once, from {list(AUTO_METHODS)}")
        for method, given in self._drafters_given().items():
            names = "draft_model" if method == "draft" else f"heads ({HEADS_CLASS[method]})"
            if method in methods and not given:
                raise ValueError(f"SpeculativeConfig.auto_methods: {method!r} drafts with {names}, which this "
                                 f"config does not have; pass them or drop {method!r}")
            if given and method not in methods:
                raise ValueError(f"SpeculativeConfig.auto_methods: leaves out {method!r}, whose {names} this config "
                                 f"is given; add {method!r} or drop the {names.split(' ')[0]}")
        if "suffix" not in methods:
            defaults = {f.name: f.default for f in fields(self)}
            given = [name for name in (*SUFFIX_FIELDS, "suffix_cache") if getattr(self, name) != defaults[name]]
            if given:
                raise ValueError(f"SpeculativeConfig.{given[0]}: a suffix decoding setting, and auto_methods "
                                 f"{list(methods)} leaves out 'suffix'; add it or drop {given[0]}")
        self.auto_methods = methods

    def _check_suffix(self) -> None:
        """The suffix settings: only for method='suffix' (and for 'auto', whose candidates include suffix decoding,
        all but the hybrid's fallback), valid, and agreeing with a `suffix_cache` given (whose settings they then
        take)."""
        defaults = {f.name: f.default for f in fields(self)}
        hybrid = ("fallback", "fallback_min_score")
        names = {"suffix": (), "auto": hybrid}.get(self.method, SUFFIX_FIELDS + ("suffix_cache", *hybrid))
        given = [name for name in names if getattr(self, name) != defaults[name]]
        if given:
            users = "method='suffix'" if given[0] in hybrid else "methods 'suffix' and 'auto'"
            raise ValueError(
                f"SpeculativeConfig.{given[0]}: a suffix decoding setting; only {users} use{'s' if given[0] in hybrid else ''} it, got "
                f"method={self.method!r}"
            )
        if self.method not in ("suffix", "auto"):
            return
        if self.method == "suffix" and (self.tree_width != 1 or self.tree_total_tokens is not None):
            raise ValueError(
                "SpeculativeConfig.tree_width: suffix drafts are token trees already (num_speculative_tokens nodes, "
                "chosen best first by frequency); drop tree_width / tree_total_tokens with method='suffix'"
            )
        if self.suffix_cache is not None:
            if not isinstance(self.suffix_cache, SuffixCache):
                raise ValueError(
                    f"SpeculativeConfig.suffix_cache: expected a hf_specdec.suffix.SuffixCache, got "
                    f"{describe(self.suffix_cache)}"
                )
            own = self.suffix_cache.config
            for name, own_name in zip(SUFFIX_FIELDS, SUFFIX_CONFIG_FIELDS):
                value, cached = getattr(self, name), getattr(own, own_name)
                if value not in (defaults[name], cached):
                    raise ValueError(
                        f"SpeculativeConfig.{name}={value!r} conflicts with the suffix_cache's {cached!r} (a cache "
                        f"keeps its own settings); drop {name} or build the SuffixCache with it"
                    )
                setattr(self, name, cached)
        else:
            try:
                self.suffix_config()
            except ValueError as error:
                message = str(error)
                for name, own in zip(SUFFIX_FIELDS, SUFFIX_CONFIG_FIELDS):
                    message = message.replace(f"SuffixConfig.{own}:", f"SpeculativeConfig.{name}:")
                raise ValueError(message) from None
        fallback = self.fallback
        if fallback is not None:
            if not isinstance(fallback, SpeculativeConfig) or fallback.method not in FALLBACK_METHODS:
                got = f"method={fallback.method!r}" if isinstance(fallback, SpeculativeConfig) else describe(fallback)
                raise ValueError(
                    f"SpeculativeConfig.fallback: expected a SpeculativeConfig with method in {list(FALLBACK_METHODS)} "
                    f"(the drafter used where the suffix draft scores low), got {got}"
                )
            if fallback.seed is not None or fallback.lossy_typical_acceptance:
                raise ValueError(
                    "SpeculativeConfig.fallback: its seed and lossy_typical_acceptance are not used (sampling and "
                    "verification follow the outer config); set them on the outer SpeculativeConfig"
                )
        score = self.fallback_min_score
        if score is not None:
            if fallback is None:
                raise ValueError(
                    "SpeculativeConfig.fallback_min_score: decides when the fallback drafter proposes; pass fallback= "
                    "too, or drop it"
                )
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score < float("inf"):
                raise ValueError(f"SpeculativeConfig.fallback_min_score: expected a finite number >= 0, got {score!r}")

    @property
    def min_suffix_score(self) -> float:
        """Hybrid drafting: the suffix draft's score at which a row drafts from it rather than the fallback."""
        if self.fallback_min_score is not None:
            return float(self.fallback_min_score)
        return float(self.fallback.max_draft_depth)

    def suffix_config(self) -> SuffixConfig:
        """The suffix trees' settings for method='suffix'."""
        return SuffixConfig(**{own: getattr(self, name) for name, own in zip(SUFFIX_FIELDS, SUFFIX_CONFIG_FIELDS)})

    @property
    def heads_method(self) -> str | None:
        """The method `heads` are for (`"medusa"`, `"eagle"` or `"mlp_speculator"`; None without heads or for
        anything else)."""
        return next((method for method in HEADS_CLASS if isinstance(self.heads, heads_class(method))), None)

    def _drafters_given(self) -> dict[str, bool]:
        """For each model candidate of method='auto', whether this config has its drafter."""
        return {"draft": self.draft_model is not None, **{m: self.heads_method == m for m in HEADS_CLASS}}

    @property
    def auto_candidates(self) -> tuple[str, ...]:
        """The candidates method='auto' chooses among: `auto_methods`, or by default the lookups and the drafters
        given; () for other methods."""
        if self.method != "auto":
            return ()
        if self.auto_methods is not None:
            return self.auto_methods
        return (*AUTO_LOOKUPS, *(method for method, given in self._drafters_given().items() if given))

    @property
    def drafting_methods(self) -> tuple[str, ...]:
        """Every method that may draft in a call with this config: its own, under `"auto"` its candidates beside the
        two lookups (the draft model, the heads, token recycling), and its hybrid fallback's."""
        methods = [self.method]
        if self.method == "auto":
            methods += [method for method in self.auto_candidates if method not in AUTO_LOOKUPS]
        if self.fallback is not None:
            methods += self.fallback.drafting_methods
        return tuple(dict.fromkeys(methods))

    @property
    def drafts_trees(self) -> bool:
        """Whether a step may propose a token tree rather than a chain whatever the target: branches (`tree_width`),
        a sized or static tree, token recycling, or a hybrid fallback that does. (Suffix decoding drafts trees, and
        chains for a target that verifies chains only.)"""
        return (self.tree_width > 1 or self.tree_total_tokens is not None or self.tree_paths is not None
                or self.method in TREE_METHODS
                or (self.auto_methods is not None and any(m in TREE_METHODS for m in self.auto_methods))
                or (self.fallback is not None and self.fallback.drafts_trees))

    @property
    def max_tree_nodes(self) -> int:
        """The most draft nodes a sized tree can keep: for a dynamic tree the candidates its expansion offers (the
        tree_width best nodes of each depth after the first each offer tree_width children); for n-gram lookup's trie
        its tree_width continuations of k tokens."""
        if self.method == "ngram":
            return self.tree_width * self.num_speculative_tokens
        if self.method == "recycling":  # rank paths of up to k tokens over RECYCLED_CANDIDATES ranks
            return sum(RECYCLED_CANDIDATES ** depth for depth in range(1, self.num_speculative_tokens + 1))
        return candidate_count(self.tree_width, self.num_speculative_tokens)

    @property
    def max_draft_depth(self) -> int:
        """The deepest draft token a step can propose: k, or the depth of a static tree (`tree_paths`)."""
        if self.tree_paths is None:
            return self.num_speculative_tokens
        return max(self.num_speculative_tokens, TreeTemplate.from_paths(self.tree_paths).max_depth)


# the class each head-based method takes, as users import it
HEADS_CLASS = {"medusa": "hf_specdec.heads.MedusaHeads", "eagle": "hf_specdec.heads.EagleHead",
               "mlp_speculator": "hf_specdec.heads.MlpSpeculator"}
# the methods whose trees take tree_total_tokens: the dynamic (EAGLE-2) trees, and n-gram lookup's trie of matches
SIZED_TREE_METHODS = ("draft", "eagle", "mtp", "mlp_speculator", "early_exit", "auto", "ngram", "recycling")


def heads_class(method: str) -> type:
    from hf_specdec.heads.eagle import EagleHead
    from hf_specdec.heads.medusa import MedusaHeads
    from hf_specdec.heads.mlp_speculator import MlpSpeculator

    return {"medusa": MedusaHeads, "eagle": EagleHead, "mlp_speculator": MlpSpeculator}[method]


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
