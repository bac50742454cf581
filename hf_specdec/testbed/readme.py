"""Model cards (README.md) for the trained test-bed models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROLES = {
    "target": "the target model of the hf_specdec test bed",
    "draft": "the draft model of the hf_specdec test bed (same tokenizer as the target)",
}


def model_card(metrics: dict[str, Any]) -> str:
    """Markdown describing architecture, training and validation loss of one model."""
    spec, train = metrics["spec"], metrics["train"]
    return f"""# hf_specdec test bed: {metrics["name"]}

This is {ROLES[metrics["name"]]}: a small `LlamaForCausalLM` trained from scratch on the
Python {metrics["python_version"]} standard library sources (test suites excluded), for
exercising speculative decoding on CPU. It is a test fixture, not a useful code model.

## Architecture

| field | value |
|---|---|
| hidden size | {spec["hidden_size"]} |
| layers | {spec["num_hidden_layers"]} |
| attention heads (= key/value heads) | {spec["num_attention_heads"]} |
| MLP intermediate size | {spec["intermediate_size"]} |
| context length | {spec["max_position_embeddings"]} |
| embeddings | tied input/output |
| parameters | {metrics["num_parameters"]:,} |
| saved weights | safetensors, {metrics["save_dtype"]} |

Tokenizer: byte-level BPE (see `tokenizer.json`), eos = bos = `<|endoftext|>`, pad = `<|pad|>`.

## Training

| field | value |
|---|---|
| optimizer | AdamW (betas 0.9/0.95, weight decay {train["weight_decay"]}), fp32 |
| schedule | {train["warmup_steps"]} warm-up steps, cosine to {train["min_lr_ratio"]} x peak |
| peak learning rate | {train["learning_rate"]} |
| steps | {train["steps"]} |
| batch | {train["batch_size"]} random windows x {train["seq_len"]} tokens |
| tokens seen | {train["tokens"]:,} |
| wall time | {train["seconds"]:.0f} s on {metrics["threads"]} CPU thread(s), torch {metrics["torch_version"]} |
| seed | {train["seed"]} |
| corpus split sha256 | `{metrics["corpus_sha256"]}` |

## Evaluation

Validation loss (mean token cross-entropy over {metrics["eval_windows"]} evenly spaced
{train["seq_len"]}-token windows of the held-out files): **{metrics["val_loss"]:.4f} nats**.
Final smoothed training loss: {train["final_train_loss"]:.4f} nats.

## Reproduce

From the repository root:

```
{metrics["command"]}
```

Bit-identical weights need the same Python (its stdlib is the corpus), torch version and thread count.
"""


def write_model_card(path: Path, metrics: dict[str, Any]) -> None:
    """Write :func:`model_card` to ``path``."""
    path.write_text(model_card(metrics))
