"""`hf-specdec` entry point: subcommands `demo`, `bench` and `train`."""

from __future__ import annotations

import argparse

from hf_specdec.cli import bench, demo, train
from hf_specdec.testbed.real_model import ModelSourceError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-specdec",
        description="Lossless speculative decoding for Hugging Face transformers: demo and benchmarks.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module, summary in (
        ("demo", demo, "a few methods (every one with --methods all) on SmolLM2 or the committed test bed: text, "
                       "acceptance, speedup over plain generate and why it is or is not faster"),
        ("bench", bench, "benchmark every method and transformers' own paths on the same prompts; table, JSON, plot"),
    ):
        _add_command(commands, name, module, summary)
    train.add_subcommands(commands)
    return parser


def _add_command(commands, name: str, module, summary: str) -> None:
    command = commands.add_parser(
        name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    module.add_arguments(command)
    command.set_defaults(run=module.run)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ModelSourceError as error:  # --model / --wheel: what was passed and what to pass instead
        raise SystemExit(f"error: {error}") from error
