"""`hf-specdec train eagle`: train an EAGLE-1/2 or EAGLE-3 head on a frozen target, on accelerate.

Single process: `hf-specdec train eagle --base PATH --data FILES --out DIR [--version eagle3]`;
several processes or GPUs: `accelerate launch --multi_gpu --num_processes N -m hf_specdec.cli train eagle ...` (on
a machine without CUDA the processes run on the CPU over gloo). The target first generates the training windows
(cached in DIR), checkpoints land in DIR/checkpoint, and a rerun resumes from them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_specdec.training.eagle import EagleTrainConfig, train_eagle


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", type=Path, required=True, help="target model folder (kept frozen)")
    parser.add_argument("--data", type=Path, nargs="+", required=True, help="text files, or .jsonl with 'text'")
    parser.add_argument("--out", type=Path, required=True, help="output folder for the head, data and checkpoints")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: --base)")
    parser.add_argument("--version", choices=["eagle", "eagle3"], default="eagle",
                        help="eagle: EAGLE-1/2 head (default); eagle3: EAGLE-3 head with training-time test")
    parser.add_argument("--data-source", choices=["generated", "text"], default="generated",
                        help="train on continuations the target generates from text prompts (default) or the raw text")
    parser.add_argument("--generated-data", type=Path, default=None,
                        help="cache file of the generated windows (default: OUT/generated_data.safetensors)")
    parser.add_argument("--num-samples", type=int, default=512, help="windows the target generates (default 512)")
    parser.add_argument("--prompt-len", type=int, default=64, help="text tokens before each continuation (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="generation temperature, 0 = greedy (default)")
    parser.add_argument("--generate-batch-size", type=int, default=32, help="prompts per generate call (default 32)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per step and process (default 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW peak learning rate (default 1e-3)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps, then cosine (default 20)")
    parser.add_argument("--grad-clip", type=float, default=0.5, help="gradient norm clip (default 0.5)")
    parser.add_argument("--noise", type=float, default=0.2, help="eagle: uniform feature noise width (default 0.2)")
    parser.add_argument("--ce-weight", type=float, default=0.1, help="eagle: cross-entropy weight (default 0.1)")
    parser.add_argument("--ttt-steps", type=int, default=7, help="eagle3: unrolled test steps (default 7)")
    parser.add_argument("--decay", type=float, default=0.8, help="eagle3: loss weight decay per step (default 0.8)")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="eagle3: keep the N most frequent tokens of the training data (default: all)")
    parser.add_argument("--feature-layers", type=int, nargs="+", default=None,
                        help="eagle3: fused target layers (default 2, L//2, L-3)")
    parser.add_argument("--intermediate-size", type=int, default=None, help="head MLP width (default: the target's)")
    parser.add_argument("--no-init-from-target", dest="init_from_target", action="store_false",
                        help="start from random weights instead of the target's last layer")
    parser.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and sampling (default 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def run(args: argparse.Namespace) -> int:
    try:
        config = EagleTrainConfig(
            base=args.base, data=args.data, out=args.out, tokenizer=args.tokenizer, version=args.version,
            data_source=args.data_source, generated_data=args.generated_data, num_samples=args.num_samples,
            prompt_len=args.prompt_len, temperature=args.temperature, generate_batch_size=args.generate_batch_size,
            steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, learning_rate=args.learning_rate,
            warmup_steps=args.warmup_steps, grad_clip=args.grad_clip, noise=args.noise, ce_weight=args.ce_weight,
            ttt_steps=args.ttt_steps, decay=args.decay, draft_vocab_size=args.draft_vocab_size,
            feature_layers=args.feature_layers, intermediate_size=args.intermediate_size,
            init_from_target=args.init_from_target, save_every=args.save_every, seed=args.seed,
            threads=args.threads,
        )
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    result = train_eagle(config)
    history = result["loss_history"]
    if history:
        print(f"trained {len(history)} steps: loss {history[0]:.3f} -> {history[-1]:.3f}; "
              f"{config.version} head in {config.out}")
    return 0
