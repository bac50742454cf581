"""`hf-specdec train medusa`: train Medusa heads on a frozen target (Medusa-1), on accelerate.

Single process: `hf-specdec train medusa --base PATH --data FILES --out DIR`; several processes or GPUs:
`accelerate launch --multi_gpu --num_processes N -m hf_specdec.cli train medusa ...` (on a machine without CUDA
the processes run on the CPU over gloo). Checkpoints land in DIR/checkpoint and a rerun resumes from them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_specdec.training.medusa import MedusaTrainConfig, train_medusa


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("head", choices=["medusa"], help="which heads to train")
    parser.add_argument("--base", type=Path, required=True, help="target model folder (kept frozen)")
    parser.add_argument("--data", type=Path, nargs="+", required=True, help="text files, or .jsonl with 'text'")
    parser.add_argument("--out", type=Path, required=True, help="output folder for the adapter and checkpoints")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: --base)")
    parser.add_argument("--num-heads", type=int, default=4, help="heads to train (default 4)")
    parser.add_argument("--num-layers", type=int, default=1, help="residual blocks per head (default 1)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per step and process (default 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--decay", type=float, default=0.8, help="loss weight decay per head (default 0.8)")
    parser.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed for initialisation and sampling (default 0)")


def run(args: argparse.Namespace) -> int:
    try:
        config = MedusaTrainConfig(
            base=args.base, data=args.data, out=args.out, tokenizer=args.tokenizer, num_heads=args.num_heads,
            num_layers=args.num_layers, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
            learning_rate=args.learning_rate, decay=args.decay, save_every=args.save_every, seed=args.seed,
        )
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    result = train_medusa(config)
    history = result["loss_history"]
    if history:
        print(f"trained {len(history)} steps: loss {history[0]:.3f} -> {history[-1]:.3f}; heads in {config.out}")
    return 0
