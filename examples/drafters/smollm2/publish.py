"""Copy a drafter trained by train.sh into this folder, in bfloat16, with a README that gives its exact training
command and its training curve (from the trainer's train_metrics.json).

    python examples/drafters/smollm2/publish.py WORK/KIND examples/drafters/smollm2/KIND KIND MINUTES [RESUMED_AT]

RESUMED_AT: the step at which a rerun with more --steps resumed the training (train.sh's second phase), if any.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from hf_specdec.testbed import drafters
from hf_specdec.training.skeleton import lr_factor

WINDOW = 10  # steps averaged per point of the curve
DESCRIPTIONS = {
    "draft": "A draft model cut from the target (its layers 0, 1 and 29, `hf_specdec.pruned_draft`), distilled on "
             "the target's answers. Stored without the embeddings and lm_head it shares with the target: "
             "`hf_specdec.pruned_draft.load_pruned_draft(folder, target)` puts them back, the lm_head as its rows at "
             "the 8192 tokens most frequent in the training answers (the draft's token map, saved with it).",
    "medusa": "Four Medusa heads (one residual block each) over the target's final hidden state, sharing the "
              "target's lm_head (its rows at the 8192 tokens most frequent in the training answers: the heads' "
              "token map); the tree fitted to them in training is saved with them (`MedusaHeads.tree()`).",
    "eagle": "An EAGLE-1/2 head (fc over the token embedding and the target's final hidden state, one decoder "
             "layer; the target's embeddings and lm_head reused, the lm_head's rows at the 8192 tokens most "
             "frequent in the training answers only: the head's token map). With a dynamic tree it is EAGLE-2.",
    "eagle3": "An EAGLE-3 head (the residual stream entering three target layers fused by fc, one decoder layer, "
              "its own norm and lm_head over an 8192-token draft vocabulary), trained with 4 steps of "
              "training-time test.",
    "mlp_speculator": "An MLP speculator (IBM's design: one small MLP stage per drafted position over the target's "
                      "final hidden state and the previous token; here 3 untied stages with a 1024-wide state) on "
                      "the target's own vocabulary (`shared_vocab`): each stage embeds with the target's input "
                      "embedding and scores with its lm_head, through learned maps, and drafts over the lm_head's "
                      "rows at the 8192 tokens most frequent in the training answers (its token map); trained on "
                      "the target's cached features. `export_fms_extras(head, folder, target)` writes it in the "
                      "layout vLLM serves, with the vocabulary matrices written out (about 2 x 49152 x 1024 "
                      "parameters per stage).",
}


def copy(source: Path, dest: Path, kind: str) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    if kind == "draft":  # saved in bfloat16 already, without the tensors it shares with the target
        dest.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(source / name, dest / name)
    else:
        drafters.HEAD_CLASSES[kind].from_pretrained(source).to(torch.bfloat16).save_pretrained(dest)


def _mean(values: list) -> float | list[float]:
    if isinstance(values[0], list):  # per head / per unrolled step
        return [sum(v[i] for v in values) / len(values) for i in range(len(values[0]))]
    return sum(values) / len(values)


def _fmt(value) -> str:
    return ", ".join(f"{v:.3f}" for v in value) if isinstance(value, list) else f"{value:.3f}"


def curve(metrics: dict) -> str:
    """A markdown table: loss and every metric, averaged over WINDOW steps at five points of training."""
    losses, history = metrics["loss_history"], metrics["metrics_history"]
    steps = len(losses)
    starts = sorted({0, steps // 4, steps // 2, 3 * steps // 4, max(0, steps - WINDOW)})
    names = [k for k, v in history[0].items() if isinstance(v, (float, list))]
    lines = ["| steps | loss | " + " | ".join(names) + " |", "|---" * (2 + len(names)) + "|"]
    for start in starts:
        window = slice(start, min(steps, start + WINDOW))
        cells = [_fmt(_mean([m[name] for m in history[window]])) for name in names]
        lines.append(f"| {window.start + 1}-{window.stop} | {_fmt(_mean(losses[window]))} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def held_out(metrics: dict) -> str:
    """The held-out rows' measurements (the trainer's `--eval-rows`) as a table, or nothing without them."""
    history = metrics.get("eval_history") or []
    if not history:
        return ""
    names = [k for k, v in history[0].items() if k not in ("step", "loss") and isinstance(v, (float, list))]
    lines = [f"\nOn the {metrics['config']['eval_rows']} rows held out of training:\n",
             "| step | loss | " + " | ".join(names) + " |", "|---" * (2 + len(names)) + "|"]
    lines += [f"| {m['step']} | {_fmt(m['loss'])} | " + " | ".join(_fmt(m[name]) for name in names) + " |"
              for m in history]
    return "\n".join(lines) + "\n"


def _requests(config: dict) -> str:
    """'N requests of FILE[ and FILE]' for the prompt files the trainer read."""
    files = [Path(name) for name in config["data"]]
    count = sum(1 for path in files for line in path.read_text().splitlines() if line.strip())
    return f"{count} requests of " + " and ".join(f"`examples/drafters/smollm2/{path.name}`" for path in files)


def _schedule(config: dict, resumed_at: int | None) -> str:
    """The learning-rate schedule, as the run (and the rerun that resumed it) followed it."""
    rate, warmup, batch = config["learning_rate"], config["warmup_steps"], config["batch_size"]
    steps = int(config["steps"])
    restart = 0.0 if resumed_at is None else lr_factor(resumed_at, steps, int(warmup))
    if resumed_at is None:
        return f"{steps} steps of batch {batch}, learning rate {rate} with {warmup} warm-up steps then cosine decay"
    return (f"{steps} steps of batch {batch}: {resumed_at} steps of learning rate {rate} with {warmup} "
            f"warm-up steps then cosine decay, then a rerun with `--steps {steps}` resumed them, its decay stretched "
            f"to {steps} steps, so the rate rose again (to {rate} x {restart:.2f}) and "
            "decayed again")


def readme(dest: Path, kind: str, metrics: dict, minutes: float, resumed_at: int | None = None) -> str:
    size = sum(p.stat().st_size for p in dest.rglob("*.safetensors")) / 2**20
    config = metrics["config"]
    threads = int(config["threads"] or 0) or "all"
    return f"""# {kind} drafter for SmolLM2-135M-Instruct

{DESCRIPTIONS[kind]} bfloat16, {size:.1f} MB. `hf-specdec bench --model smollm2` and `hf-specdec demo --methods all`
use it by default; `hf_specdec.testbed.drafters.load_drafter("smollm2", "{kind}", target)` loads it.

Trained on this repository's CPU ({threads} torch thread{"s" if threads != 1 else ""} on a shared 2-core machine;
`train.sh` ran {minutes:.0f} min for it,
the target's answers and feature cache included where it built them) by
self-distillation: the target (bfloat16) answered {config['num_samples']} of the {_requests(config)}
(a sample drawn with seed {config['seed']}) greedily (at most {config['max_new_tokens']} new tokens each; the
requests share no 8-word run with Spec-Bench or the code workload), and the drafter learned the target's answers
from the target's cached features, with bf16 autocast:

```bash
{"" if threads == 2 else f"THREADS={threads} "}bash examples/drafters/smollm2/train.sh {kind}
```

({_schedule(config, resumed_at)}; the full trainer options are in `train.sh`.)

Training curve (mean over {WINDOW} steps at five points; accuracy = top-1 agreement with the target on the
training rows; lists are per head or per unrolled step{_over_the_map(config, metrics)}):

{curve(metrics)}
{held_out(metrics)}"""


def _over_the_map(config: dict, metrics: dict) -> str:
    """How the curve reads for a drafter trained with a token map (its losses are over the map's ids)."""
    if config.get("token_map_size") in (None, "None"):
        return ""
    regression = " (a regression is not)" if "regression" in metrics["metrics_history"][0] else ""
    return (f"; the drafter learned over its {config['token_map_size']}-token map, so its vocabulary losses are "
            f"over the map's ids at positions whose target token lies in it{regression}, and accuracy counts "
            "a target token outside the map as missed")


def main(argv: list[str]) -> None:
    source, dest, kind, minutes = Path(argv[0]), Path(argv[1]), argv[2], float(argv[3])
    resumed_at = int(argv[4]) if len(argv) > 4 else None
    copy(source, dest, kind)
    metrics = json.loads((source / "train_metrics.json").read_text())
    (dest / "README.md").write_text(readme(dest, kind, metrics, minutes, resumed_at))
    print(f"{kind}: copied to {dest}")


if __name__ == "__main__":
    main(sys.argv[1:])
