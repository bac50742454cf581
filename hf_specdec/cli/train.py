"""`hf-specdec train medusa`: train Medusa heads on accelerate. Stage 1 (default): heads on a frozen target.
Stage 2 (`--stage 2`): heads plus a peft LoRA on the target (`--self-distillation`: the LoRA model is kept close
to the target by a KL loss instead of the next-token loss); load the result with `hf_specdec.heads.load_medusa2`.

Single process: `hf-specdec train medusa --base PATH --data FILES --out DIR`; several processes or GPUs:
`accelerate launch --multi_gpu --num_processes N -m hf_specdec.cli train medusa ...` (on a machine without CUDA
the processes run on the CPU over gloo). Checkpoints land in DIR/checkpoint and a rerun resumes from them.
"""

from __future__ import annotations

import argparse

from hf_specdec.cli.train_common import add_common_arguments, run_trainer
from hf_specdec.training.medusa import LLAMA_LORA_MODULES, MedusaTrainConfig, train_medusa


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, out_help="output folder for the adapter and checkpoints")
    parser.add_argument("--stage", type=int, default=1, choices=(1, 2),
                        help="1: heads on a frozen target (Medusa-1, default); 2: heads plus a LoRA (Medusa-2)")
    parser.add_argument("--num-heads", type=int, default=4, help="heads to train (default 4)")
    parser.add_argument("--num-layers", type=int, default=1, help="residual blocks per head (default 1)")
    parser.add_argument("--shared-lm-head", action="store_true",
                        help="heads project with the target's lm_head (small files) instead of their own")
    parser.add_argument("--decay", type=float, default=0.8, help="loss weight decay per head (default 0.8)")
    parser.add_argument("--distill-samples", type=int, default=0,
                        help="first let the target continue this many windows of the data greedily and train on "
                             "its own output (default 0: train on the data)")
    parser.add_argument("--distill-new-tokens", type=int, default=128, help="tokens per continuation (default 128)")
    parser.add_argument("--tree-nodes", type=int, default=32,
                        help="fit a static tree of this many nodes to the trained heads (default 32; 0: none)")
    parser.add_argument("--lora-r", type=int, default=8, help="stage 2: LoRA rank (default 8)")
    parser.add_argument("--lora-alpha", type=int, default=16, help="stage 2: LoRA alpha (default 16)")
    parser.add_argument("--lora-dropout", type=float, default=0.05, help="stage 2: LoRA dropout (default 0.05)")
    parser.add_argument("--lora-target-modules", nargs="+", default=list(LLAMA_LORA_MODULES),
                        help="stage 2: modules the LoRA wraps (default: q,k,v,o,gate,up,down projections)")
    parser.add_argument("--self-distillation", action="store_true",
                        help="stage 2: loss_0 = KL from the target with the LoRA disabled, not next-token CE")
    parser.add_argument("--heads-coef", type=float, default=0.2,
                        help="stage 2: weight of the heads' loss (default 0.2)")
    parser.add_argument("--medusa-lr-multiplier", type=float, default=4.0,
                        help="stage 2: heads' learning rate / the LoRA's (default 4)")


def run(args: argparse.Namespace) -> int:
    return run_trainer(MedusaTrainConfig, train_medusa, args, trained="heads in {config.out}")
