"""`hf-specdec train eagle`: train an EAGLE-1/2 or EAGLE-3 head on a frozen target, on accelerate.

Single process: `hf-specdec train eagle --base PATH --data FILES --out DIR [--version eagle3]`;
several processes or GPUs: `accelerate launch --multi_gpu --num_processes N -m hf_specdec.cli train eagle ...` (on
a machine without CUDA the processes run on the CPU over gloo). The target first generates the training rows
(cached in DIR), then runs once over them and its features are cached in DIR/target_features, so training steps
never run it; checkpoints land in DIR/checkpoint, and a rerun resumes from them and reuses both caches.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_specdec.cli.train_common import add_common_arguments, run_trainer
from hf_specdec.training.eagle import EagleTrainConfig, train_eagle


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, out_help="output folder for the head, generated data, target features and "
                                          "checkpoints")
    parser.add_argument("--version", choices=["eagle", "eagle3"], default="eagle",
                        help="eagle: EAGLE-1/2 head (default); eagle3: EAGLE-3 head with training-time test")
    parser.add_argument("--data-source", choices=["generated", "text"], default="generated",
                        help="train on continuations the target generates from text prompts (default) or the raw text")
    parser.add_argument("--generated-data", type=Path, default=None,
                        help="cache file of the generated rows (default: OUT/generated_data.safetensors)")
    parser.add_argument("--num-samples", type=int, default=512, help="rows the target generates (default 512)")
    parser.add_argument("--prompt-records", action="store_true",
                        help="each record of the .jsonl --data files ('text' or 'input_ids') is one whole prompt, "
                             "e.g. rendered with the chat template; the target continues it up to --max-new-tokens "
                             "or EOS (default: prompts are windows cut from the text)")
    parser.add_argument("--prompt-len", type=int, default=64,
                        help="text tokens before each continuation, without --prompt-records (default 64)")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="with --prompt-records: most tokens generated per prompt (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="generation temperature, 0 = greedy (default)")
    parser.add_argument("--generate-batch-size", type=int, default=32,
                        help="rows per target call when generating data and caching features (default 32)")
    parser.add_argument("--feature-cache", type=Path, default=None,
                        help="folder of the cached target features (default: OUT/target_features)")
    parser.add_argument("--no-cache-features", dest="cache_features", action="store_false",
                        help="run the target on every training batch instead of caching its features (no disk, slower)")
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


def run(args: argparse.Namespace) -> int:
    return run_trainer(EagleTrainConfig, train_eagle, args, trained="{config.version} head in {config.out}")
