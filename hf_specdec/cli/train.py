"""`hf-specdec train <method>`: train a drafter for a target, on accelerate.

Single process: `hf-specdec train METHOD --base PATH --data FILES --out DIR`; several processes or GPUs:
`accelerate launch --multi_gpu --num_processes N -m hf_specdec.cli train METHOD ...` (on a machine without CUDA the
processes run on the CPU over gloo). By default the target first writes the training text itself from the data
(cached in DIR, or in --generated-data, where every method's trainer can share it), then runs once over it and its
features are cached (DIR/target_features, or --feature-cache), so training steps never run it; checkpoints land in
DIR/checkpoint, and a rerun resumes from them and reuses both caches. The options are the fields of the method's
training config (`hf_specdec.training.*.{Medusa,Eagle,Draft,MlpSpeculator}TrainConfig`).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path

from hf_specdec.training.checkpoints import OtherRunError
from hf_specdec.training.config import DataError
from hf_specdec.training.draft_model import DraftTrainConfig, train_draft
from hf_specdec.training.eagle import EagleTrainConfig, train_eagle
from hf_specdec.training.medusa import MedusaTrainConfig, train_medusa
from hf_specdec.training.mlp_speculator import MlpSpeculatorTrainConfig, train_mlp_speculator

# method: (config class, trainer, what the command trains, what it writes)
METHODS: dict[str, tuple[type, Callable[..., dict], str, str]] = {
    "medusa": (MedusaTrainConfig, train_medusa, "Medusa-1 heads on a frozen target, or Medusa-2 (heads plus a LoRA; "
               "load with hf_specdec.heads.load_medusa2)", "heads in {config.out}"),
    "eagle": (EagleTrainConfig, train_eagle, "an EAGLE-1/2 or EAGLE-3 head on a frozen target",
              "{config.version} head in {config.out}"),
    "draft": (DraftTrainConfig, train_draft, "a draft model cut from the target (some of its layers, fine-tuned to "
              "imitate it; load with hf_specdec.pruned_draft.load_pruned_draft)", "draft model in {config.out}"),
    "mlp_speculator": (MlpSpeculatorTrainConfig, train_mlp_speculator, "an MLP speculator (fms-extras / vLLM "
                       "mlp_speculator) on a frozen target: stage 1 on text, stage 2 on the target's own output",
                       "MLP speculator in {config.out}"),
}


def add_config_arguments(parser: argparse.ArgumentParser, config_class: type) -> None:
    """One option per field of the config dataclass: --field-name, typed from its annotation, its help from the
    field's metadata; booleans that default to True are turned off with --no-field-name."""
    hints = typing.get_type_hints(config_class)
    for item in fields(config_class):
        kind, flag = hints[item.name], "--" + item.name.replace("_", "-")
        default = item.default if item.default is not MISSING else (
            item.default_factory() if item.default_factory is not MISSING else None)
        required = item.default is MISSING and item.default_factory is MISSING
        text = item.metadata.get("help", item.name.replace("_", " ")).replace("%", "%%")
        if kind is bool:
            if default:
                parser.add_argument("--no-" + item.name.replace("_", "-"), dest=item.name, action="store_false",
                                    help=f"{text} (on by default; this turns it off)")
            else:
                parser.add_argument(flag, dest=item.name, action="store_true", help=text)
            continue
        options: dict = {"dest": item.name, "required": required, "default": default,
                         "help": text if required or "default" in text else f"{text} (default: {default})"}
        base = _without_none(kind)
        if typing.get_origin(base) in (list, tuple):
            options["nargs"], base = "+", typing.get_args(base)[0]
        if typing.get_origin(base) is typing.Literal:
            options["choices"], base = list(typing.get_args(base)), type(typing.get_args(base)[0])
        options["type"] = base if base in (int, float, str, Path) else str
        parser.add_argument(flag, **options)


def _without_none(kind):
    """`X` for an annotation `X | None`, else the annotation itself."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return kind


def add_subcommands(commands) -> None:
    """`train` with one subcommand per method."""
    train = commands.add_parser("train", help="train a drafter (medusa, eagle, draft, mlp_speculator) for a target, "
                                "on accelerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    methods = train.add_subparsers(dest="method", required=True)
    for name, (config_class, trainer, summary, written) in METHODS.items():
        parser = methods.add_parser(name, help=summary, description=sys.modules[trainer.__module__].__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_config_arguments(parser, config_class)
        parser.set_defaults(run=lambda args, c=config_class, t=trainer, w=written: run(c, t, args, w))


def run(config_class: type, trainer: Callable[..., dict], args: argparse.Namespace, written: str) -> int:
    """Build the config from the options of the same names (a bad value is a clear error before any work), train,
    and print the loss from first to last step."""
    try:
        config = config_class(**{f.name: getattr(args, f.name) for f in fields(config_class)})
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    try:
        history = trainer(config)["loss_history"]
    except (OtherRunError, DataError) as error:  # the checkpoint in `out`, the rows: checked before training
        raise SystemExit(f"error: {error}") from error
    if history:
        print(f"trained {len(history)} steps: loss {history[0]:.3f} -> {history[-1]:.3f}; "
              f"{written.format(config=config)}")
    return 0
