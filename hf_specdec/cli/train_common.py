"""What every `hf-specdec train <head>` command shares: the data, output, schedule and machine options, and turning
the parsed options into the trainer's config dataclass (a bad value is a clear error before any work)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path


def add_common_arguments(parser: argparse.ArgumentParser, out_help: str) -> None:
    parser.add_argument("--base", type=Path, required=True, help="target model folder")
    parser.add_argument("--data", type=Path, nargs="+", required=True,
                        help="text files, or .jsonl with a 'text' or 'input_ids' field")
    parser.add_argument("--out", type=Path, required=True, help=out_help)
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: --base)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per step and process (default 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and sampling (default 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def run_trainer(config_class: type, train: Callable[..., dict], args: argparse.Namespace, trained: str) -> int:
    """Build `config_class` from the options of the same names, train, and print the loss from first to last step;
    `trained` says what was written (formatted with the config)."""
    try:
        config = config_class(**{f.name: getattr(args, f.name) for f in fields(config_class)})
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    history = train(config)["loss_history"]
    if history:
        print(f"trained {len(history)} steps: loss {history[0]:.3f} -> {history[-1]:.3f}; "
              f"{trained.format(config=config)}")
    return 0
