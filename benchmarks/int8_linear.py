"""The int8 weight-only linear layer (`hf_specdec.kernels.int8_linear`) against the floating-point matmul it stands
in for, by rows per call, on a drafter's shapes:

    python benchmarks/int8_linear.py --threads 1
    python benchmarks/int8_linear.py --dtype float32 --json int8_linear_fp32.json

Default shapes are those of SmolLM2-135M-Instruct's drafters (hidden 576, MLP 1536, an 8192-token map's lm_head).
Each case: the median of --repeats rounds of --calls calls, the two layers interleaved within a round; the ratio is
float / int8 (above 1: the int8 copy is faster). Activations in --dtype: the kernel computes in bfloat16, and a
float32 call pays for rounding its rows to bfloat16 and its result back, as `Int8Linear` does. Measured on a CPU
only (the kernel serves CPUs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from hf_specdec.cli.environment import write_report
from hf_specdec.kernels.int8_linear import int8_linear, quantize_int8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (inner, outer): attention projections, the MLP's up and down, an 8192-token lm_head
SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 8192))


def time_calls(call, calls: int) -> float:
    """Milliseconds per call over `calls` calls."""
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) * 1e3 / calls


def measure(inner: int, outer: int, rows: int, dtype: torch.dtype, repeats: int, calls: int) -> dict:
    generator = torch.Generator().manual_seed(inner * outer + rows)
    weight = torch.randn(outer, inner, generator=generator).to(dtype)
    qweight, scales = quantize_int8(weight)
    x = torch.randn(rows, inner, generator=generator).to(dtype)
    float_call = lambda: torch.nn.functional.linear(x, weight)  # noqa: E731
    int8_call = lambda: int8_linear(x, qweight, scales)  # noqa: E731
    float_call(), int8_call()  # warm-up
    float_ms, int8_ms = [], []
    for _ in range(repeats):
        float_ms.append(time_calls(float_call, calls))
        int8_ms.append(time_calls(int8_call, calls))
    float_median, int8_median = statistics.median(float_ms), statistics.median(int8_ms)
    return {"inner": inner, "outer": outer, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
            "float_ms": float_median, "int8_ms": int8_median, "ratio": float_median / int8_median}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 6, 16])
    parser.add_argument("--shapes", nargs="+", default=None, metavar="INNERxOUTER",
                        help="layer shapes (default: SmolLM2's drafters', " + " ".join(f"{i}x{o}" for i, o in SHAPES)
                        + "); inner sizes must be multiples of 16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    shapes = SHAPES if args.shapes is None else [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    if any(inner % 16 for inner, _ in shapes):
        parser.error(f"--shapes: inner sizes must be multiples of 16 (the kernel's step), got {args.shapes}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"{'dtype':>8} {'inner':>5} {'outer':>5} {'rows':>4} {'float ms':>9} {'int8 ms':>8} {'ratio':>6}")
    for dtype in args.dtype:
        for inner, outer in shapes:
            for count in args.rows:
                row = measure(inner, outer, count, DTYPES[dtype], args.repeats, args.calls)
                rows.append(row)
                print(f"{dtype:>8} {inner:>5} {outer:>5} {count:>4} {row['float_ms']:>9.4f} {row['int8_ms']:>8.4f} "
                      f"{row['ratio']:>5.2f}x")
    write_report(args, rows, torch.device("cpu"), None)
    return rows


if __name__ == "__main__":
    main()
