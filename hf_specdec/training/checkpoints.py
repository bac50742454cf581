"""Checkpoints that resume, for every trainer: accelerate's state (model, optimizer, scheduler, RNG) plus the step."""

from __future__ import annotations

import json
from pathlib import Path

from accelerate import Accelerator

STATE_FILE = "training_state.json"


def resume(accelerator: Accelerator, folder: Path) -> int:
    """Load the checkpoint in `folder` if there is one; the step to go on from (0 for a fresh run)."""
    if not (folder / STATE_FILE).is_file():
        return 0
    accelerator.load_state(str(folder))
    return int(json.loads((folder / STATE_FILE).read_text())["step"])


def save(accelerator: Accelerator, folder: Path, step: int) -> None:
    """Save the state after `step` steps (all processes take part; the main one writes the step)."""
    accelerator.wait_for_everyone()
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        (folder / STATE_FILE).write_text(json.dumps({"step": step}, sort_keys=True))
