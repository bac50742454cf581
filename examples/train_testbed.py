"""Recipe that builds the committed test bed in ``examples/testbed``.

Stages: split the stdlib corpus -> train the tokenizer -> build the workloads
-> train the target -> train the draft -> evaluate each on the held-out split
-> write a README per model. With ``--model target`` or ``--model draft`` the
tokenizer already in the output folder is reused and only that model is
(re)trained. Runs on CPU with a fixed number of threads and fixed seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=REPO_ROOT / "examples" / "testbed",
                        help="folder receiving tokenizer/, target/, draft/, workloads.json and corpus_manifest.json")
    parser.add_argument("--model", choices=("target", "draft", "both"), default="both",
                        help="which model to train; 'both' also retrains the tokenizer and rebuilds the workloads")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="only train the tokenizer, write the manifest and build the workloads")
    parser.add_argument("--target-steps", type=int, default=360, help="optimizer steps for the target")
    parser.add_argument("--draft-steps", type=int, default=320, help="optimizer steps for the draft")
    parser.add_argument("--target-lr", type=float, default=2e-3, help="peak learning rate of the target")
    parser.add_argument("--draft-lr", type=float, default=3e-3, help="peak learning rate of the draft")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per optimizer step")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per training and evaluation window")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size, special tokens included")
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows used for the validation loss")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, workloads, init and batches")
    parser.add_argument("--threads", type=int, default=1, help="torch (and tokenizer) CPU threads")
    parser.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="dtype of the saved weights (bfloat16 keeps the committed size under 40 MB)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.threads > 1 else "false"
    sys.path.insert(0, str(REPO_ROOT))

    import torch
    from transformers import AutoTokenizer

    from hf_specdec.testbed.corpus import SplitConfig, split_corpus
    from hf_specdec.testbed.models import SPECS
    from hf_specdec.testbed.readme import write_model_card
    from hf_specdec.testbed.tokenizer import train_tokenizer
    from hf_specdec.testbed.training import TrainConfig, evaluate, token_stream, train
    from hf_specdec.testbed.workloads import WorkloadConfig, build_workloads, write_workloads

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]])
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)

    split = split_corpus(SplitConfig(seed=args.seed))
    manifest = split.manifest()
    tokenizer_dir = out / "tokenizer"
    if args.model == "both" or args.tokenizer_only:
        split.write_manifest(out / "corpus_manifest.json")
        print(f"corpus: {manifest['num_train_files']} train / {manifest['num_heldout_files']} held-out files")
        tokenizer = train_tokenizer(split.texts("train"), vocab_size=args.vocab_size, model_max_length=args.seq_len)
        tokenizer.save_pretrained(tokenizer_dir)
        workloads = build_workloads(
            split.heldout, split.texts("heldout"), tokenizer, WorkloadConfig(seed=args.seed),
            python_version=str(manifest["python_version"]),
        )
        write_workloads(workloads, out / "workloads.json")
        if args.tokenizer_only:
            return
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)

    train_stream = token_stream(tokenizer, split.texts("train"))
    heldout_stream = token_stream(tokenizer, split.texts("heldout"))
    print(f"tokens: {len(train_stream)} train / {len(heldout_stream)} held-out")
    names = ("target", "draft") if args.model == "both" else (args.model,)
    for name in names:
        config = TrainConfig(
            steps=getattr(args, f"{name}_steps"),
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            learning_rate=getattr(args, f"{name}_lr"),
            seed=args.seed,
        )
        torch.manual_seed(args.seed)
        model = SPECS[name].build(
            len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        result = train(model, train_stream, config, desc=name)
        val_loss = evaluate(model, heldout_stream, seq_len=args.seq_len, max_windows=args.eval_windows)
        print(f"{name}: {result.steps} steps, {result.tokens} tokens, {result.seconds:.0f} s, val loss {val_loss:.4f}")
        model_dir = out / name
        model.to(getattr(torch, args.save_dtype)).save_pretrained(
            model_dir, safe_serialization=True, max_shard_size="15MB"
        )
        tokenizer.save_pretrained(model_dir)
        metrics = {
            "name": name,
            "spec": asdict(SPECS[name]),
            "num_parameters": model.num_parameters(),
            "train": {**asdict(config), **asdict(result)},
            "val_loss": val_loss,
            "eval_windows": args.eval_windows,
            "corpus_sha256": manifest["content_sha256"],
            "python_version": manifest["python_version"],
            "torch_version": torch.__version__,
            "platform": platform.platform(),
            "threads": args.threads,
            "save_dtype": args.save_dtype,
            "command": command,
        }
        (model_dir / "train_metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        write_model_card(model_dir / "README.md", metrics)


if __name__ == "__main__":
    main()
