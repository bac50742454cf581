"""The token rows drafter training draws from: windows of raw text, or text the frozen target writes itself.

* Stream windows (`prompt_records=False`): `num_samples` prompts of `prompt_len` tokens are cut from the token
  stream of the data files at seeded offsets, and the target continues each one to `seq_len` tokens (EOS held back,
  so every row is full). Every token of a row is trained on.
* Prompt records (`prompt_records=True`): each record of the .jsonl files (`"text"` or `"input_ids"`) is one whole
  prompt, e.g. an instruction already rendered with the chat template. `num_samples` of them (seeded; all when there
  are fewer) are continued by up to `max_new_tokens` tokens, stopping after EOS. A row is the prompt plus its
  continuation (its last `seq_len` tokens when longer), right-padded to the longest row; only the continuation is
  trained on (`TrainingRows.starts`), as a drafter only ever drafts the target's own text. Generation runs in
  left-padded batches of prompts of similar length.

Generated rows are cached in one safetensors file keyed by the settings and a hash of the source tokens, so a resume,
another run on the same data, or another method's trainer (the same `generated_data` file and settings) reuses
them; a cache with any other key is regenerated. A run over more prompts than an earlier one (greedy prompt records)
can take the earlier file's answers for the prompts they share (`reuse_generated`) and generate only the others.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from hf_specdec.training.config import DataError, TrainConfig
from hf_specdec.training.data import records, token_stream, windows

FORMAT_VERSION = 2  # rows carry the first trained position of each row


@dataclass(frozen=True)
class TrainingRows:
    """Token rows, each row's real tokens first and padding after them; a row's tokens from `starts` on are the
    ones a drafter learns to predict."""

    # [N, L]
    input_ids: torch.Tensor
    # [N] real tokens per row
    lengths: torch.Tensor
    # [N] the row's first trained token (0: all of them; a prompt record: its continuation's first token)
    starts: torch.Tensor

    @classmethod
    def full(
        cls,
        # [N, L] rows without padding, every token trained
        input_ids: torch.Tensor,
    ) -> TrainingRows:
        count = len(input_ids)
        return cls(input_ids, torch.full((count,), input_ids.shape[1]), torch.zeros(count, dtype=torch.long))

    @classmethod
    def padded(cls, rows: list[torch.Tensor], pad_token_id: int, starts: list[int] | None = None) -> TrainingRows:
        """Rows of different lengths ([L_i] each), right-padded with `pad_token_id` to the longest."""
        lengths = torch.tensor([len(row) for row in rows])
        input_ids = torch.full((len(rows), int(lengths.max())), pad_token_id)
        for index, row in enumerate(rows):
            input_ids[index, : len(row)] = row
        return cls(input_ids, lengths, torch.tensor(starts if starts is not None else [0] * len(rows)))

    def select(
        self,
        # [B] row indices
        rows: torch.Tensor,
    ) -> TrainingRows:
        """Those rows alone, in that order (their padding kept: every row keeps the width of the others)."""
        return TrainingRows(self.input_ids[rows], self.lengths[rows], self.starts[rows])

    def real(
        self,
        # [B] row indices
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """[B, L] bool: the position holds a real token of the row."""
        return torch.arange(self.input_ids.shape[1]) < self.lengths[rows, None]

    def trained(
        self,
        # [B] row indices
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """[B, L] bool: the position holds a token a drafter learns to predict (real, and from the row's start on)."""
        return self.real(rows) & (torch.arange(self.input_ids.shape[1]) >= self.starts[rows, None])

    def tokens(self) -> torch.Tensor:
        """[M]: every trained token of every row."""
        return self.input_ids[self.trained(torch.arange(len(self.input_ids)))]


def read_prompt_records(tokenizer, paths: list[Path], owner: str) -> list[torch.Tensor]:
    """[P_i] token ids of each record of the .jsonl files (`hf_specdec.training.data.records`)."""
    prompts = []
    for where, ids in records(tokenizer, paths, f"{owner}.data"):
        if not ids:
            raise DataError(f"{where}: the prompt is empty")
        prompts.append(torch.tensor(ids))
    if not prompts:
        raise DataError(f"{owner}.data: no prompt records in {[str(p) for p in paths]}")
    return prompts


def read_source(config: TrainConfig, tokenizer) -> list[torch.Tensor]:
    """The source tokens of `config.data`: the prompt records ([P_i] each), or one token stream [N] of all files."""
    owner = type(config).__name__
    if config.prompt_records:
        return read_prompt_records(tokenizer, config.data, owner)
    return [token_stream(tokenizer, config.data, config.seq_len + 1, f"{owner}.data")]


def eos_token_ids(target: nn.Module) -> list[int]:
    """The ids the target's generation stops at (its generation config's, else its config's)."""
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        eos = target.config.eos_token_id
    return [] if eos is None else [int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos])]


def pad_token_id(target: nn.Module) -> int:
    """The id that pads rows: the target's pad token, else its first EOS, else 0."""
    if target.config.pad_token_id is not None:
        return int(target.config.pad_token_id)
    return (eos_token_ids(target) or [0])[0]


@torch.no_grad()
def generate_continuations(
    target: nn.Module,
    # [P_i] each
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int,
    stop_at_eos: bool,
    show_progress: bool = True,
) -> list[tuple[torch.Tensor, int]]:
    """Each prompt followed by the target's continuation ([P_i + T_i] each), with the prompt's length: with
    `stop_at_eos`, up to and including the first EOS, at most `max_new_tokens` tokens; without, exactly
    `max_new_tokens` (EOS held back)."""
    torch.manual_seed(seed)  # generate samples from torch's global generator
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(
        do_sample=False
    )
    length = {} if stop_at_eos else dict(min_new_tokens=max_new_tokens)
    pad, eos = pad_token_id(target), torch.tensor(eos_token_ids(target), dtype=torch.long)
    device = next(target.parameters()).device
    rows = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="generating data", disable=not show_progress):
        batch = prompts[start : start + batch_size]
        width = max(len(prompt) for prompt in batch)
        input_ids = torch.full((len(batch), width), pad)  # [B, P]: left-padded
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for index, prompt in enumerate(batch):
            input_ids[index, width - len(prompt) :] = prompt
            attention_mask[index, width - len(prompt) :] = 1
        output = target.generate(
            input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=max_new_tokens,
            pad_token_id=pad, **length, **sampling,
        ).cpu()
        for index, prompt in enumerate(batch):
            new = output[index, width:]  # [T]; rows that stopped early are padded after their EOS
            ends = torch.isin(new, eos).nonzero() if stop_at_eos else []
            if len(ends):
                new = new[: int(ends[0]) + 1]
            rows.append((torch.cat([prompt, new]), len(prompt)))
    return rows


def _source_sha256(source: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for part in source:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part.to(torch.long).numpy().tobytes())
    return digest.hexdigest()


def _generation_key(config: TrainConfig, source: list[torch.Tensor], num_processes: int, dtype: torch.dtype) -> str:
    """What the cached rows depend on, as sorted JSON."""
    settings = {
        "base": str(config.base.resolve()), "dtype": str(dtype), "format": FORMAT_VERSION,
        "num_processes": num_processes, "num_samples": config.num_samples,
        "prompt_records": config.prompt_records, "seed": config.seed, "seq_len": config.seq_len,
        "source_sha256": _source_sha256(source), "temperature": config.temperature,
    }
    if config.prompt_records:
        settings["max_new_tokens"] = config.max_new_tokens
    else:
        settings["prompt_len"] = config.prompt_len
    return json.dumps(settings, sort_keys=True)


def _prompts(config: TrainConfig, source: list[torch.Tensor]) -> list[torch.Tensor]:
    """The prompts to continue ([P_i] each): seeded stream windows, or seeded prompt records sorted by length."""
    generator = torch.Generator().manual_seed(config.seed)
    if not config.prompt_records:
        return list(windows(source[0], config.num_samples, config.prompt_len, generator))
    if len(source) < config.num_samples:
        warnings.warn(f"{type(config).__name__}.num_samples: {config.num_samples} prompts asked for, the data holds "
                      f"{len(source)} records; using all of them", stacklevel=3)
    chosen = [source[i] for i in torch.randperm(len(source), generator=generator)[: config.num_samples].tolist()]
    return sorted(chosen, key=len)  # similar lengths batch together: less left padding


def training_rows(
    config: TrainConfig, accelerator: Accelerator, target: nn.Module, source: list[torch.Tensor]
) -> TrainingRows:
    """The rows training draws from: windows of the raw text, or generated (cached in `config.generated_path`).

    The processes split the prompts between them; the main process writes the gathered rows to the cache.
    """
    if config.data_source == "text":
        return TrainingRows.full(source[0].unfold(0, config.seq_len, config.seq_len))
    key, path = _generation_key(config, source, accelerator.num_processes, target.dtype), config.generated_path
    if not path.is_file() or _read_generation_key(path) != key:
        new_tokens = config.max_new_tokens if config.prompt_records else config.seq_len - config.prompt_len
        prompts = _prompts(config, source)
        known = reusable_answers(config, target.dtype)
        missing = [prompt for prompt in prompts if _digest(prompt) not in known]
        if config.reuse_generated:
            accelerator.print(f"{len(prompts) - len(missing)} of {len(prompts)} answers taken from "
                              f"{[str(p) for p in config.reuse_generated]}")
        with accelerator.split_between_processes(missing) as mine:
            rows = generate_continuations(
                target, mine, new_tokens, config.temperature, config.seed * 1000 + accelerator.process_index,
                config.generate_batch_size, stop_at_eos=config.prompt_records,
                show_progress=accelerator.is_local_main_process,
            )
        gathered = gather_object([(row.tolist(), prompt_length) for row, prompt_length in rows])  # in prompt order
        cut = sum(len(row) > config.seq_len for row, _ in gathered)
        if cut:
            accelerator.print(f"{cut} of {len(gathered)} generated rows are longer than seq_len {config.seq_len}; "
                              f"training reads their last {config.seq_len} tokens")
        generated = iter([(row[-config.seq_len :], max(0, prompt_length - max(0, len(row) - config.seq_len))
                           if config.prompt_records else 0) for row, prompt_length in gathered])
        rows_in_order = [known.get(_digest(prompt)) or next(generated) for prompt in prompts]
        data = TrainingRows.padded([torch.tensor(row) for row, _ in rows_in_order], pad_token_id(target),
                                   [start for _, start in rows_in_order])
        if accelerator.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"input_ids": data.input_ids, "lengths": data.lengths, "starts": data.starts}, str(path),
                      metadata={"key": key})
        accelerator.wait_for_everyone()
    return TrainingRows(**load_file(str(path)))


def _digest(
    # [P] a prompt's token ids
    prompt: torch.Tensor,
) -> bytes:
    return hashlib.sha256(prompt.to(torch.long).numpy().tobytes()).digest()


# the settings a reused answer must share with the run that takes it (the rest, e.g. the prompt set, may differ)
REUSE_SETTINGS = ("base", "dtype", "format", "max_new_tokens", "prompt_records", "seq_len", "temperature")


def reusable_answers(config: TrainConfig, dtype: torch.dtype) -> dict[bytes, tuple[list[int], int]]:
    """The rows of `config.reuse_generated` a run can take as they are, by the digest of their prompt: each a row's
    tokens and its first trained position, for every row held whole (shorter than seq_len, so its prompt is all
    its tokens before its start). Greedy answers depend on the batch a prompt was generated in only at near-ties
    of low-precision logits. A file whose settings differ from this run's is refused, naming the setting."""
    wanted = json.loads(_generation_key(config, [], 1, dtype))
    known: dict[bytes, tuple[list[int], int]] = {}
    for path in config.reuse_generated:
        stored = json.loads(_read_generation_key(path) or "{}")
        differing = [name for name in REUSE_SETTINGS if stored.get(name) != wanted[name]]
        if differing:
            raise DataError(f"{type(config).__name__}.reuse_generated: {path} was generated with other settings "
                            f"({', '.join(f'{n}={stored.get(n)!r}, not {wanted[n]!r}' for n in differing)}); "
                            f"drop it or match them")
        rows = TrainingRows(**load_file(str(path)))
        for row, length, start in zip(rows.input_ids, rows.lengths.tolist(), rows.starts.tolist()):
            if 0 < start and length < config.seq_len:
                known.setdefault(_digest(row[:start]), (row[:length].tolist(), start))
    return known


def _read_generation_key(path: Path) -> str | None:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("key")
    except (SafetensorError, OSError):  # a damaged file is regenerated like a stale one
        return None
