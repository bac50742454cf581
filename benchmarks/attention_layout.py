"""One attention layer of a decode step, transformers' "sdpa" function against the packed layout the engine runs on a
CPU (`hf_specdec.cache.attention`), by cached tokens and new tokens per row:

    python benchmarks/attention_layout.py --dtype bfloat16 float32 --threads 1
    python benchmarks/attention_layout.py --device cuda --dtype bfloat16 float16 --json attention_layout_gpu.json

The engine packs only on a CPU; `--device cuda` measures the same layout (`hf_specdec.cache.attention.packed_sdpa`)
against transformers' path on a GPU, which is what would decide whether the engine should pack there too. The
default shapes are SmolLM2-135M-Instruct's (9 query heads, 3 key/value heads, head size 64), batch 1. A step
of W new tokens: the mask the engine passes (each new token sees the cached slots and the new ones up to itself)
for W > 1; for W = 1 no mask, as at batch 1 without padding (transformers then asks SDPA for `enable_gqa`), and an
additive mask as in a padded batch. Each case: the median of --repeats rounds of --calls calls, the cases
interleaved within a round; the ratio is sdpa / packed (above 1: packed is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_specdec.cache.attention import packed_sdpa
from hf_specdec.cli.environment import write_report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def step_inputs(heads: int, kv_heads: int, head_dim: int, context: int, width: int, masked: bool,
                dtype: torch.dtype, device: str = "cpu", batch: int = 1):
    """(module, query, key, value, mask) of one layer's attention over `context` cached tokens and `width` new
    ones."""
    generator = torch.Generator().manual_seed(0)
    slots = context + width
    query = torch.randn(batch, heads, width, head_dim, generator=generator).to(device, dtype)
    key = torch.randn(batch, kv_heads, slots, head_dim, generator=generator).to(device, dtype)
    value = torch.randn(batch, kv_heads, slots, head_dim, generator=generator).to(device, dtype)
    mask = None
    if masked or width > 1:
        mask = torch.zeros(batch, 1, width, slots, dtype=dtype, device=device)
        mask[..., context:] = torch.full((width, width), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True), query, key, value, mask


def _packed(module, query, key, value, mask):
    return packed_sdpa(query, key, value, mask)


def measure(args: argparse.Namespace) -> list[dict]:
    """Rows of (dtype, context, width, masked, sdpa ms, packed ms, ratio)."""
    torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for dtype_name in args.dtype:
        for context in args.context:
            cases = [(w, w > 1 or masked) for w in args.widths for masked in ((False, True) if w == 1 else (True,))]
            inputs = {case: step_inputs(args.heads, args.kv_heads, args.head_dim, context, case[0], case[1],
                                        DTYPES[dtype_name], args.device) for case in cases}
            times = {(case, name): [] for case in cases for name in ("sdpa", "packed")}
            for _ in range(args.repeats):
                for case in cases:
                    for name, function in (("sdpa", sdpa_attention_forward), ("packed", _packed)):
                        sync()
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            function(*inputs[case])
                        sync()
                        times[(case, name)].append((time.perf_counter() - start) / args.calls)
            for case in cases:
                sdpa, packed = (statistics.median(times[(case, name)]) * 1e3 for name in ("sdpa", "packed"))
                rows.append({"dtype": dtype_name, "context": context, "width": case[0], "masked": case[1],
                             "sdpa_ms": sdpa, "packed_ms": packed, "ratio": sdpa / packed})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPES))
    parser.add_argument("--context", nargs="+", type=int, default=[256, 768, 2048])
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 2, 6, 17])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows there (sorted keys)")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    rows = measure(args)
    write_report(args, rows, torch.device(args.device), None)
    for row in rows:
        mask = "mask" if row["masked"] else "no mask"
        print(f"{row['dtype']:9s} {row['context']:6d} cached, {row['width']:3d} new ({mask:7s}): sdpa "
              f"{row['sdpa_ms']:.3f} ms, packed {row['packed_ms']:.3f} ms, {row['ratio']:.2f}x")
    return rows


if __name__ == "__main__":
    main()
