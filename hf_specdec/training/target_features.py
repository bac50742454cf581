"""What drafter training reads from the frozen target, computed once and read back from disk.

Per token of a training row an objective needs some of:
* the features a head reads (`layers`: entries of the target's `hidden_states`, concatenated): EAGLE-1/2 and
  Medusa the final normed hidden state (`FINAL_LAYER`), EAGLE-3 the residual stream entering its fused layers;
* the final normed hidden state: the target's logits are `lm_head(hidden)`, recomputed per batch (`target_logits`)
  through the whole lm_head, or through a draft vocabulary's rows only, so no vocabulary-sized tensor is ever
  stored (with `FINAL_LAYER` it is the feature itself and is stored once);
* the target's top token after each position.

Objectives project onto a vocabulary only at the positions whose label is trained (`TargetBatch.ahead`): a batch
is as wide as its longest row, and a prompt record's prompt and the padding after shorter rows are most of it.

`build_feature_cache` runs the target once over every row (no grad, in its dtype) and writes one safetensors shard
per batch of `batch_size` rows (fewer when they would pass `shard_bytes`) into a folder: bf16 when the target is
bf16, else fp32 (top tokens int32). Each shard's
metadata holds the cache key (the target's folder and files, dtype, fused layers, and a hash of the rows) and its
row range: a rerun keeps the shards that match and recomputes any other, so an interrupted build goes on where it
stopped. With several processes, process p computes shards p, p + P, ... and then every process reads all of them
(the folder must be shared). `FeatureCache` memory-maps the shards (safetensors `safe_open`) and reads only the rows
of each batch.

Memory: building holds one shard (at most `shard_bytes`, 256 MiB by default, or one row if larger) plus the target
forward over its rows with their hidden states; training holds one batch, the rest stays on disk (the OS page
cache may keep what was read, and gives it back under pressure). Disk: tokens x (F + H for EAGLE-3, H for EAGLE-1/2)
x 4 bytes (2 in bf16) + 4 bytes per token; 200k tokens of EAGLE-3 features of SmolLM2-135M (H = 576, F = 3 x 576) in
fp32: 200k x 2304 x 4 ≈ 1.8 GB.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from hf_specdec.training.generated import TrainingRows

SHARD_BYTES = 256 * 2**20
FORMAT_VERSION = 2  # a shard stores its rows up to the longest of them
FINAL_LAYER = (-1,)  # EAGLE-1/2 reads the final normed hidden state: its features are the hidden states


@dataclass(frozen=True)
class TargetBatch:
    """One training batch with everything the objective reads from the target (`features`, `hidden` and `argmax`
    are None for an objective that runs the target itself)."""

    # [B, L] token ids
    input_ids: torch.Tensor
    # [B, L] bool: the position holds a real token (padding follows a row's end)
    real: torch.Tensor
    # [B, L] bool: the position holds a token the drafter learns to predict (real, from the row's start on)
    trained: torch.Tensor
    # [B, L, F] the features the drafter reads
    features: torch.Tensor | None = None
    # [B, L, H] the target's final normed hidden state (its logits are lm_head(hidden))
    hidden: torch.Tensor | None = None
    # [B, L] the target's top token after each position
    argmax: torch.Tensor | None = None

    def ahead(self, distance: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The label of a guess `distance` tokens ahead of each position: ([B, L] the token `distance` positions
        after it, 0 past the batch's width; [B, L] bool: that token is a trained one, False past the width)."""
        size, cut = self.input_ids.shape[0], min(distance, self.input_ids.shape[1])
        labels = torch.cat([self.input_ids[:, cut:], self.input_ids.new_zeros(size, cut)], dim=1)
        trained = torch.cat([self.trained[:, cut:], self.trained.new_zeros(size, cut)], dim=1)
        return labels, trained


@torch.no_grad()
def run_target(
    target: nn.Module,
    layers: tuple[int, ...],
    # [B, L]
    input_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward of the target: features [B, L, F] (its `hidden_states[i]` for i in `layers`, concatenated), final
    normed hidden state [B, L, H] and top token [B, L] (logits built one row at a time, never for the whole batch)."""
    output = target.model(input_ids, output_hidden_states=layers != FINAL_LAYER)
    hidden = output.last_hidden_state
    features = hidden if layers == FINAL_LAYER else torch.cat([output.hidden_states[i] for i in layers], dim=-1)
    lm_head = target.get_output_embeddings()
    argmax = torch.stack([lm_head(row).argmax(-1) for row in hidden])
    return features, hidden, argmax


def target_logits(
    # [..., H] the target's final normed hidden state
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    # [V] bool: the ids to score (EAGLE-3's draft vocabulary), None for all
    vocab: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float logits of the target, [..., V] or, over `vocab`, [..., D] in ascending id order."""
    weight, bias = lm_head.weight, lm_head.bias
    if vocab is not None:
        weight, bias = weight[vocab], None if bias is None else bias[vocab]
    return nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()


def feature_key(base: Path, dtype: torch.dtype, layers: tuple[int, ...], rows: TrainingRows) -> str:
    """What cached features depend on, as sorted JSON: the target (folder, its weight and config files' sizes and
    times), the stored dtype, the fused layers, a hash of the rows and the shard layout's version."""
    base = Path(base).resolve()
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(base.iterdir())
             if p.suffix in (".safetensors", ".bin") or p.name == "config.json"}
    digest = hashlib.sha256(rows.input_ids.to(torch.long).numpy().tobytes())
    digest.update(rows.lengths.to(torch.long).numpy().tobytes())
    return json.dumps({"base": str(base), "dtype": str(cache_dtype(dtype)), "files": files, "format": FORMAT_VERSION,
                       "layers": list(layers), "rows_sha256": digest.hexdigest()}, sort_keys=True)


def cache_dtype(target_dtype: torch.dtype) -> torch.dtype:
    """bf16 features for a bf16 target, fp32 otherwise."""
    return torch.bfloat16 if target_dtype == torch.bfloat16 else torch.float32


def _shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.safetensors"


class FeatureCache:
    """The shards of a built cache, memory-mapped; `read` gathers rows from them."""

    def __init__(self, folder: Path, key: str, num_rows: int, rows_per_shard: int) -> None:
        self.rows_per_shard = rows_per_shard
        self.handles = []
        for index in range(-(-num_rows // rows_per_shard)):
            stop = min(num_rows, (index + 1) * rows_per_shard)
            handle = _open_shard(_shard_path(folder, index), key, index * rows_per_shard, stop)
            if handle is None:
                raise ValueError(f"feature_cache: {_shard_path(folder, index)} is missing or was made with other "
                                 f"settings while training started; run again to rebuild it")
            self.handles.append(handle)
        self.separate_hidden = "hidden" in self.handles[0].keys()

    def read(
        self,
        # [B] row indices
        rows: torch.Tensor,
        width: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features [B, W, F], final normed hidden state [B, W, H] and top token [B, W] of the rows' first `width`
        positions (zeros past what a shard stores: padding)."""
        names = ("features", "hidden", "argmax") if self.separate_hidden else ("features", "argmax")
        read = {name: [] for name in names}
        for row in rows.tolist():
            shard, offset = divmod(row, self.rows_per_shard)
            for name in names:
                part = self.handles[shard].get_slice(name)[offset : offset + 1, :width]
                read[name].append(_padded(part, width, part.dtype))
        read = {name: torch.cat(parts) for name, parts in read.items()}
        return read["features"], read.get("hidden", read["features"]), read["argmax"].long()


def _open_shard(path: Path, key: str, start: int, stop: int):
    """The shard's handle when it holds rows [start, stop) made under `key`, else None."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError):
        return None
    metadata = handle.metadata() or {}
    if metadata.get("key") != key or metadata.get("rows") != f"{start}:{stop}":
        return None
    return handle


def build_feature_cache(
    target: nn.Module,
    rows: TrainingRows,
    layers: tuple[int, ...],
    folder: Path,
    key: str,
    batch_size: int,
    accelerator: Accelerator,
    shard_bytes: int = SHARD_BYTES,
) -> FeatureCache:
    """Compute the shards of `folder` that are missing or stale (this process's share), then open them all."""
    folder = Path(folder)
    num_rows, width = rows.input_ids.shape
    hidden_size = target.config.get_text_config(decoder=True).hidden_size
    feature_size = hidden_size * (1 if layers == FINAL_LAYER else len(layers))
    dtype = cache_dtype(target.dtype)
    row_bytes = width * ((feature_size + (0 if layers == FINAL_LAYER else hidden_size)) * dtype.itemsize + 4)
    rows_per_shard = max(1, min(batch_size, shard_bytes // row_bytes))  # one target forward per shard
    shards = [(i, i * rows_per_shard, min(num_rows, (i + 1) * rows_per_shard))
              for i in range(-(-num_rows // rows_per_shard))]
    stale = [(i, start, stop) for i, start, stop in shards[accelerator.process_index :: accelerator.num_processes]
             if _open_shard(_shard_path(folder, i), key, start, stop) is None]
    if stale:
        folder.mkdir(parents=True, exist_ok=True)
        accelerator.print(f"caching target features in {folder}: {len(shards)} shards, "
                          f"{num_rows} rows x {width} tokens, {dtype}")
    progress = tqdm(total=sum(stop - start for _, start, stop in stale), desc="caching target features",
                    disable=not (stale and accelerator.is_local_main_process))
    device = next(target.parameters()).device
    for index, start, stop in stale:
        length = int(rows.lengths[start:stop].max())  # padding after every row's end is left at zero
        features, hidden, argmax = run_target(target, layers, rows.input_ids[start:stop, :length].to(device))
        tensors = {"features": features, "argmax": argmax} | ({} if layers == FINAL_LAYER else {"hidden": hidden})
        tensors = {name: _padded(tensor, length, torch.int32 if name == "argmax" else dtype)
                   for name, tensor in tensors.items()}
        progress.update(stop - start)
        partial = _shard_path(folder, index).with_suffix(".partial")
        save_file(tensors, str(partial), metadata={"key": key, "rows": f"{start}:{stop}"})
        os.replace(partial, _shard_path(folder, index))  # a shard is either whole or absent
    progress.close()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for path in folder.glob("shard-*.safetensors"):
            if int(path.stem.split("-")[1]) >= len(shards):
                path.unlink()  # left over from a larger cache
    accelerator.wait_for_everyone()
    return FeatureCache(folder, key, num_rows, rows_per_shard)


def _padded(
    # [n, length, ...]
    tensor: torch.Tensor,
    width: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[n, width, ...] on the CPU in `dtype`: the tensor's positions, then zeros."""
    out = torch.zeros((tensor.shape[0], width, *tensor.shape[2:]), dtype=dtype)
    out[:, : tensor.shape[1]] = tensor.to(dtype).cpu()
    return out


def target_batch(
    target: nn.Module,
    rows: TrainingRows,
    # [B] row indices
    index: torch.Tensor,
    device: torch.device,
    cache: FeatureCache | None,
    layers: tuple[int, ...] | None,
    min_length: int = 1,
) -> TargetBatch:
    """The batch of rows `index`, as long as its longest row (at least `min_length`, at most the rows' width):
    target outputs read from `cache`, or (without one) from a target forward; none with `layers=None`."""
    width = min(rows.input_ids.shape[1], max(min_length, int(rows.lengths[index].max())))
    input_ids = rows.input_ids[index, :width].to(device)  # [B, W]
    batch = TargetBatch(input_ids, rows.real(index)[:, :width].to(device), rows.trained(index)[:, :width].to(device))
    if layers is None:
        return batch
    if cache is None:
        features, hidden, argmax = run_target(target, layers, input_ids)
    else:
        features, hidden, argmax = (tensor.to(device) for tensor in cache.read(index, width))
    return replace(batch, features=features, hidden=hidden, argmax=argmax)
