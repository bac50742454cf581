"""What every drafter trainer is configured by: the frozen target, the training rows (target-written or raw text),
the cached target features, the optimisation schedule and the machine. Each method's config subclasses
`TrainConfig` with its own fields and checks (`_check`); the CLI builds its options from the fields and their help
metadata, so a field is declared once."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, get_args

import torch

DataSource = Literal["generated", "text"]
TargetDtype = Literal["auto", "float32", "bfloat16", "float16"]
MixedPrecision = Literal["no", "bf16"]
GENERATED_FILE = "generated_data.safetensors"
FEATURES_DIR = "target_features"
CHECKPOINT_DIR = "checkpoint"
METRICS_FILE = "train_metrics.json"


class DataError(ValueError):
    """The data read does not fit the config (found once the rows are known, before any training step)."""


@dataclass
class TrainConfig:
    base: Path = field(metadata={"help": "target model folder (frozen)"})
    data: list[Path] = field(metadata={"help": "text files, or .jsonl with a 'text' or 'input_ids' field"})
    out: Path = field(metadata={"help": "output folder: the trained drafter, generated data, target features and "
                                        "checkpoints"})
    tokenizer: Path | None = field(default=None, metadata={"help": "tokenizer folder (default: the base folder)"})
    data_source: DataSource = field(
        default="generated", metadata={"help": "train on text the target writes from the data ('generated') or on "
                                               "windows of the raw 'text'"})
    generated_data: Path | None = field(
        default=None, metadata={"help": f"cache file of the generated rows (default: OUT/{GENERATED_FILE})"})
    reuse_generated: list[Path] = field(
        default_factory=list, metadata={"help": "generated-row files of earlier runs (the same target, dtype, "
                                                "seq_len and max_new_tokens; greedy prompt records): a prompt they "
                                                "answered whole takes that answer instead of a new generation"})
    num_samples: int = field(default=512, metadata={"help": "rows the target generates"})
    prompt_records: bool = field(
        default=False, metadata={"help": "each record of the .jsonl data files is one whole prompt (e.g. rendered "
                                         "with the chat template), continued to EOS; losses count on the "
                                         "continuation only (default: prompts are windows cut from the text)"})
    prompt_len: int = field(default=64, metadata={"help": "text tokens before each generated continuation (windows "
                                                          "cut from the text; not with prompt_records)"})
    max_new_tokens: int = field(default=128, metadata={"help": "prompt_records: most tokens generated per prompt"})
    temperature: float = field(default=0.0, metadata={"help": "generation temperature (0: greedy)"})
    generate_batch_size: int = field(
        default=32, metadata={"help": "rows per target call when generating data and caching features"})
    cache_features: bool = field(
        default=True, metadata={"help": "run the target once over the rows and train from its cached features "
                                        "(off: run it on every batch, no disk)"})
    feature_cache: Path | None = field(
        default=None, metadata={"help": f"folder of the cached target features (default: OUT/{FEATURES_DIR})"})
    target_dtype: TargetDtype = field(
        default="auto", metadata={"help": "dtype the target runs in when generating data and features ('auto': "
                                          "bfloat16 on CUDA, float32 on the CPU)"})
    mixed_precision: MixedPrecision = field(
        default="no", metadata={"help": "'bf16': the trained module's forward under bfloat16 autocast (weights "
                                        "and optimizer stay float32); fast on GPUs and on CPUs with bf16 matrix "
                                        "units"})
    steps: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=8, metadata={"help": "rows per step and process"})
    seq_len: int = field(default=256, metadata={"help": "tokens per row (longer rows keep their last seq_len)"})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW learning rate"})
    warmup_steps: int = field(default=20, metadata={"help": "linear warm-up steps, then cosine decay to 10%"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient norm clip"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (decoupled)"})
    save_every: int = field(default=100, metadata={"help": "checkpoint every N steps"})
    eval_rows: int = field(
        default=0, metadata={"help": "rows held out of training (a seeded choice), on which the loss and metrics are "
                                     "measured every eval_every steps and after the last (0: none)"})
    eval_every: int | None = field(default=None, metadata={"help": "steps between held-out measurements (default: "
                                                                   "save_every)"})
    seed: int = field(default=0, metadata={"help": "seed for data, initialisation and sampling"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: torch's choice)"})

    def __post_init__(self) -> None:
        owner = type(self).__name__
        self.base, self.out = Path(self.base), Path(self.out)
        self.data = [Path(p) for p in self.data]
        for name in ("tokenizer", "generated_data", "feature_cache"):
            if getattr(self, name) is not None:
                setattr(self, name, Path(getattr(self, name)))
        self.reuse_generated = [Path(p) for p in self.reuse_generated]
        if not (self.base / "config.json").is_file():
            raise ValueError(f"{owner}.base: no model at {self.base} (expected config.json)")
        missing = [str(p) for p in self.data if not p.is_file()]
        if not self.data or missing:
            raise ValueError(f"{owner}.data: expected existing files, missing {missing or 'all'}")
        for name, allowed in (("data_source", DataSource), ("target_dtype", TargetDtype),
                              ("mixed_precision", MixedPrecision)):
            if getattr(self, name) not in get_args(allowed):
                raise ValueError(f"{owner}.{name}: expected one of {get_args(allowed)}, got {getattr(self, name)!r}")
        for name in ("num_samples", "prompt_len", "max_new_tokens", "generate_batch_size", "steps", "batch_size",
                     "seq_len", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{owner}.{name}: expected an int >= 1, got {value!r}")
        if isinstance(self.eval_rows, bool) or not isinstance(self.eval_rows, int) or self.eval_rows < 0:
            raise ValueError(f"{owner}.eval_rows: expected an int >= 0, got {self.eval_rows!r}")
        if self.data_source == "generated" and self.eval_rows >= self.num_samples:
            raise ValueError(f"{owner}.eval_rows: {self.eval_rows} held out of {self.num_samples} rows (num_samples) "
                             f"leaves none to train on; hold out fewer or raise num_samples")
        if self.eval_every is not None and (isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int)
                                            or self.eval_every < 1):
            raise ValueError(f"{owner}.eval_every: expected an int >= 1 or None, got {self.eval_every!r}")
        if self.eval_every is not None and not self.eval_rows:
            raise ValueError(f"{owner}.eval_every: {self.eval_every} given without eval_rows; hold out rows to "
                             f"measure on (eval_rows), or drop eval_every")
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise ValueError(f"{owner}.threads: expected an int >= 1 or None, got {self.threads!r}")
        for name in ("temperature", "warmup_steps", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{owner}.{name}: expected >= 0, got {getattr(self, name)}")
        for name in ("learning_rate", "grad_clip"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{owner}.{name}: expected > 0, got {getattr(self, name)}")
        if self.prompt_records:
            if self.data_source != "generated":
                raise ValueError(f"{owner}.prompt_records: only with data_source 'generated', got data_source "
                                 f"{self.data_source!r}")
            others = [str(p) for p in self.data if p.suffix != ".jsonl"]
            if others:
                raise ValueError(f"{owner}.data: prompt_records reads .jsonl files of prompt records ('text' or "
                                 f"'input_ids'), got {others}")
            if self.max_new_tokens >= self.seq_len:
                raise ValueError(f"{owner}.max_new_tokens: expected less than seq_len {self.seq_len}, got "
                                 f"{self.max_new_tokens}")
        elif self.data_source == "generated" and self.prompt_len >= self.seq_len:
            raise ValueError(f"{owner}.prompt_len: expected less than seq_len {self.seq_len}, got {self.prompt_len}")
        if self.feature_cache is not None and not self.cache_features:
            raise ValueError(f"{owner}.feature_cache: {self.feature_cache} given with cache_features=False; drop one "
                             f"of them")
        if self.reuse_generated:
            if not self.prompt_records or self.temperature != 0:
                raise ValueError(f"{owner}.reuse_generated: earlier answers are reused for greedy prompt records only "
                                 f"(prompt_records with temperature 0), got prompt_records={self.prompt_records}, "
                                 f"temperature={self.temperature}; drop reuse_generated")
            missing = [str(p) for p in self.reuse_generated if not p.is_file()]
            if missing:
                raise ValueError(f"{owner}.reuse_generated: no such files {missing}")
        self._check()

    def _check(self) -> None:
        """The method's own checks (errors name `type(self).__name__` and the field)."""

    @property
    def generated_path(self) -> Path:
        return self.generated_data or self.out / GENERATED_FILE

    @property
    def feature_cache_dir(self) -> Path:
        return self.feature_cache or self.out / FEATURES_DIR

    def values(self) -> dict:
        """Every field as JSON holds it (paths as strings, lists as lists): what `train_metrics.json` records and
        what a checkpoint compares with the run that resumes it."""
        return {name: _json_value(value) for name, value in asdict(self).items()}

    def torch_dtype(self, cuda: bool) -> torch.dtype:
        """The dtype the target runs in."""
        if self.target_dtype == "auto":
            return torch.bfloat16 if cuda else torch.float32
        return getattr(torch, self.target_dtype)


def _json_value(value):
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
