"""`hf-specdec` entry point: subcommands `demo`, `bench` and `train`."""

from __future__ import annotations

import argparse

from hf_specdec.cli import bench, demo, train, train_eagle


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-specdec",
        description="Lossless speculative decoding for Hugging Face transformers: demo and benchmarks.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module, summary in (
        ("demo", demo, "every method on the committed test bed: text, acceptance, speedup over plain generate "
                       "(interleaved repeats) and why it is or is not faster"),
        ("bench", bench, "benchmark every method and transformers' own paths on the same prompts; table, JSON, plot"),
    ):
        _add_command(commands, name, module, summary)
    heads = commands.add_parser("train", help="train draft heads (medusa, eagle) on a target, on accelerate")
    kinds = heads.add_subparsers(dest="head", required=True)
    _add_command(kinds, "medusa", train, "Medusa-1 heads on a frozen target, or Medusa-2 (heads plus a LoRA)")
    _add_command(kinds, "eagle", train_eagle, "an EAGLE-1/2 or EAGLE-3 head on a frozen target")
    return parser


def _add_command(commands, name: str, module, summary: str) -> None:
    command = commands.add_parser(
        name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    module.add_arguments(command)
    command.set_defaults(run=module.run)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
