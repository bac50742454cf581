"""Medusa-1 training: the target is frozen; head i learns the token i + 2 positions after each hidden state.

Loss = sum_i decay^i * CE(head_i(h_t), x_{t+2+i}) (Medusa-2's decaying weights; Medusa-1 used equal ones). Each
head's projection starts as a copy of the target's lm_head and its residual blocks at zero, so training starts
from "the target's own next-token guess". Runs on accelerate: single process, multi-process CPU (gloo) and
multi-GPU under `accelerate launch`; checkpoints every `save_every` steps and resumes from the last one.
Data: local text files (.txt, .py, ...) or .jsonl with a "text" field, concatenated with EOS between documents;
training windows are drawn with a seeded generator.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_specdec.heads.medusa import MedusaConfig, MedusaHeads

STATE_FILE = "training_state.json"


@dataclass
class MedusaTrainConfig:
    base: Path = field(metadata={"help": "target model folder (frozen)"})
    data: list[Path] = field(metadata={"help": "text files, or .jsonl with a 'text' field"})
    out: Path = field(metadata={"help": "output folder: the adapter, plus checkpoints under checkpoint/"})
    tokenizer: Path | None = field(default=None, metadata={"help": "tokenizer folder (default: the base folder)"})
    num_heads: int = 4
    num_layers: int = 1
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 1e-3
    decay: float = 0.8
    save_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        self.base, self.out = Path(self.base), Path(self.out)
        self.data = [Path(p) for p in self.data]
        self.tokenizer = None if self.tokenizer is None else Path(self.tokenizer)
        if not (self.base / "config.json").is_file():
            raise ValueError(f"MedusaTrainConfig.base: no model at {self.base} (expected config.json)")
        missing = [str(p) for p in self.data if not p.is_file()]
        if not self.data or missing:
            raise ValueError(f"MedusaTrainConfig.data: expected existing files, missing {missing or 'all'}")
        for name in ("num_heads", "num_layers", "steps", "batch_size", "seq_len", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"MedusaTrainConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if not 0 < self.decay <= 1 or self.learning_rate <= 0:
            raise ValueError("MedusaTrainConfig.decay must be in (0, 1] and learning_rate > 0")


def _read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for path in paths:
        if path.suffix == ".jsonl":
            texts += [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
        else:
            texts.append(path.read_text())
    return texts


def _token_stream(tokenizer, texts: list[str], min_length: int) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if len(ids) < min_length:
        raise ValueError(f"MedusaTrainConfig.data: {len(ids)} tokens, need at least {min_length} (seq_len + heads + 1)")
    return torch.tensor(ids)


def medusa_loss(
    # [B, L, K, V]
    head_logits: torch.Tensor,
    # [B, L]
    input_ids: torch.Tensor,
    decay: float,
) -> tuple[torch.Tensor, list[float]]:
    """Weighted sum over heads of the cross-entropy of head i at t against token t + 2 + i; and each head's loss."""
    total, per_head = head_logits.new_zeros(()), []
    for i in range(head_logits.shape[2]):
        shift = 2 + i
        loss = torch.nn.functional.cross_entropy(
            head_logits[:, :-shift, i].reshape(-1, head_logits.shape[-1]).float(), input_ids[:, shift:].reshape(-1)
        )
        total = total + decay**i * loss
        per_head.append(float(loss.detach()))
    return total, per_head


def train_medusa(config: MedusaTrainConfig) -> dict:
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.base, local_files_only=True)
    dtype = torch.bfloat16 if accelerator.device.type == "cuda" else torch.float32  # CPUs are slow in bf16
    base = AutoModelForCausalLM.from_pretrained(config.base, dtype=dtype, use_safetensors=True, local_files_only=True)
    base.requires_grad_(False).eval().to(accelerator.device)
    text = base.config.get_text_config(decoder=True)
    torch.manual_seed(config.seed)
    heads = MedusaHeads(MedusaConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                                     num_heads=config.num_heads, num_layers=config.num_layers,
                                     base_model_name_or_path=str(config.base)))
    with torch.no_grad():
        for head in heads.heads:
            head[-1].weight.copy_(base.get_output_embeddings().weight)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.learning_rate)
    heads, optimizer = accelerator.prepare(heads, optimizer)
    stream = _token_stream(tokenizer, _read_texts(config.data), config.seq_len + config.num_heads + 2)

    checkpoint = config.out / "checkpoint"
    start = 0
    if (checkpoint / STATE_FILE).is_file():
        accelerator.load_state(str(checkpoint))
        start = json.loads((checkpoint / STATE_FILE).read_text())["step"]
    generator = torch.Generator().manual_seed(config.seed * 1000 + accelerator.process_index)
    history = []
    progress = tqdm(range(start, config.steps), desc="medusa heads", disable=not accelerator.is_local_main_process)
    for step in progress:
        generator.manual_seed(config.seed * 1_000_003 + step * 101 + accelerator.process_index)
        starts = torch.randint(0, len(stream) - config.seq_len, (config.batch_size,), generator=generator)
        input_ids = torch.stack([stream[s : s + config.seq_len] for s in starts.tolist()]).to(accelerator.device)
        with torch.no_grad():
            hidden = base(input_ids, output_hidden_states=True).hidden_states[-1]
        loss, per_head = medusa_loss(heads(hidden), input_ids, config.decay)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        history.append(float(loss.detach()))
        progress.set_postfix(loss=f"{history[-1]:.3f}")
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            accelerator.wait_for_everyone()
            accelerator.save_state(str(checkpoint))
            if accelerator.is_main_process:
                (checkpoint / STATE_FILE).write_text(json.dumps({"step": step + 1}, sort_keys=True))
    accelerator.wait_for_everyone()
    result = {"steps": config.steps, "loss_history": history, "config": {k: str(v) for k, v in asdict(config).items()}}
    if accelerator.is_main_process:
        accelerator.unwrap_model(heads).save_pretrained(config.out)
        (config.out / "train_metrics.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    return result
