"""`hf-specdec` entry point: subcommands `demo` and `bench`."""

from __future__ import annotations

import argparse

from hf_specdec.cli import bench, demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-specdec",
        description="Lossless speculative decoding for Hugging Face transformers: demo and benchmarks.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo",
        help="generate on the committed test bed with every method; show text, acceptance and speedup",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)
    bench_parser = commands.add_parser(
        "bench",
        help="benchmark every method and transformers' own paths on the same prompts; table, JSON, plot",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=bench.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
