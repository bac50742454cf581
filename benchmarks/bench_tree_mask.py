"""GPU benchmark of the tree-verify attention mask: the Triton kernel against the torch reference.

For every (batch, tree nodes, cached slots, window) case it builds a ragged cache with left padding and holes and
a random tree per row, checks that the kernel's mask equals the reference's, then times both with
`triton.testing.do_bench` (median of repeated launches, CUDA-synchronised) and prints the speedup. The goal is a
kernel at least 5x faster than the reference on the headline case: batch 16, 64 nodes, 4096 cached slots, fp16.

Without a CUDA device (or without triton) it says so and exits 0: there is nothing to time. `--smoke` runs one
tiny case on the CPU instead (the kernel under the Triton interpreter when TRITON_INTERPRET=1 is set, else the
reference alone), to check that the script runs; its times mean nothing.

Run: PYTHONPATH=. python benchmarks/bench_tree_mask.py [--dtype fp16] [--json results.json] [--smoke]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hf_specdec.cli.environment import write_report
from hf_specdec.kernels.tree_mask import (
    INSTALL_TRITON,
    ancestor_bits_from_parents,
    tree_attention_mask_reference,
    tree_attention_mask_triton,
)

# (batch, nodes, cached slots, window); the first is the headline case.
CASES = [
    (16, 64, 4096, None),
    (16, 64, 4096, 1024),
    (1, 64, 4096, None),
    (16, 64, 512, None),
    (64, 64, 4096, None),
    (16, 256, 4096, None),
    (16, 64, 32768, None),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GOAL_SPEEDUP = 5.0


def make_inputs(
    batch: int, num_nodes: int, num_slots: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """valid [B, S], positions [B, S], query_positions [B, W], ancestor_bits [B, W, words] on `device`."""
    generator = torch.Generator().manual_seed(0)
    padding = torch.randint(0, num_slots // 4 + 1, (batch, 1), generator=generator)
    valid = (torch.arange(num_slots) >= padding) & (torch.rand(batch, num_slots, generator=generator) > 0.1)
    positions = valid.long().cumsum(dim=1) - 1
    parents = torch.full((batch, num_nodes), -1, dtype=torch.long)
    depth = torch.zeros(batch, num_nodes, dtype=torch.long)
    for node in range(1, num_nodes):
        parents[:, node] = torch.randint(0, node, (batch,), generator=generator)
        depth[:, node] = depth.gather(1, parents[:, node : node + 1])[:, 0] + 1
    query_positions = valid.long().sum(dim=1, keepdim=True) + depth
    ancestor_bits = ancestor_bits_from_parents(parents)
    return valid.to(device), positions.to(device), query_positions.to(device), ancestor_bits.to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="mask dtype (default fp16)")
    parser.add_argument("--json", type=Path, help="also write the results here, as JSON")
    parser.add_argument("--smoke", action="store_true", help="one tiny case on the CPU (checks that it runs)")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke(args, DTYPES[args.dtype])

    if not torch.cuda.is_available():
        print("bench_tree_mask: no CUDA device, nothing to time (the kernel targets GPUs); skipping.")
        return 0
    try:
        from triton.testing import do_bench
    except ImportError:
        print(f"bench_tree_mask: triton is not installed ({INSTALL_TRITON}); skipping.")
        return 0

    dtype = DTYPES[args.dtype]
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, {args.dtype}")
    print(f"{'batch':>5} {'nodes':>5} {'slots':>6} {'window':>6} {'reference ms':>12} {'kernel ms':>9} "
          f"{'speedup':>7}")
    results = []
    for batch, num_nodes, num_slots, window in CASES:
        inputs = make_inputs(batch, num_nodes, num_slots, device)
        expected = tree_attention_mask_reference(*inputs, window, dtype)
        torch.testing.assert_close(tree_attention_mask_triton(*inputs, window, dtype), expected, rtol=0, atol=0)
        reference_ms = do_bench(lambda: tree_attention_mask_reference(*inputs, window, dtype))
        kernel_ms = do_bench(lambda: tree_attention_mask_triton(*inputs, window, dtype))
        speedup = reference_ms / kernel_ms
        print(f"{batch:>5} {num_nodes:>5} {num_slots:>6} {str(window):>6} {reference_ms:>12.4f} {kernel_ms:>9.4f} "
              f"{speedup:>6.1f}x")
        results.append({"batch": batch, "nodes": num_nodes, "slots": num_slots, "window": window,
                        "reference_ms": reference_ms, "kernel_ms": kernel_ms, "speedup": speedup})

    headline = results[0]["speedup"]
    verdict = "PASS" if headline >= GOAL_SPEEDUP else "FAIL"
    print(f"{verdict}: headline speedup {headline:.1f}x (goal >= {GOAL_SPEEDUP:.0f}x)")
    write_report(args, results, device, dtype)
    return 0


def smoke(args: argparse.Namespace, dtype: torch.dtype) -> int:
    """One tiny case on the CPU: the kernel (under the Triton interpreter, when on) against the reference."""
    import time

    from hf_specdec.kernels.tree_mask import triton, triton_interpreter_enabled

    device = torch.device("cpu")
    inputs = make_inputs(2, 8, 64, device)
    start = time.perf_counter()
    expected = tree_attention_mask_reference(*inputs, None, dtype)
    result = {"batch": 2, "nodes": 8, "slots": 64, "window": None, "reference_ms": 1000 * (time.perf_counter() - start)}
    if triton is not None and triton_interpreter_enabled():
        start = time.perf_counter()
        torch.testing.assert_close(tree_attention_mask_triton(*inputs, None, dtype), expected, rtol=0, atol=0)
        result["kernel_ms"] = 1000 * (time.perf_counter() - start)
    print(f"bench_tree_mask --smoke: {result}")
    write_report(args, [result], device, dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
