"""`hf-specdec` entry point: subcommands `demo`, `bench` and `train`."""

from __future__ import annotations

import argparse

from hf_specdec.cli import bench, demo, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-specdec",
        description="Lossless speculative decoding for Hugging Face transformers: demo and benchmarks.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module, summary in (
        ("demo", demo, "generate on the committed test bed with every method; show text, acceptance and speedup"),
        ("bench", bench, "benchmark every method and transformers' own paths on the same prompts; table, JSON, plot"),
        ("train", train, "train draft heads (medusa) on a frozen target, on accelerate"),
    ):
        command = commands.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
