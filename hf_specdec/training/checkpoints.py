"""Checkpoints that resume, for every trainer: accelerate's state (model, optimizer, scheduler, RNG), the step, the
history so far, and the settings they were trained under.

A rerun resumes only a checkpoint written under the same settings (`run_settings`: everything but where files go,
how fast the machine runs, and `steps`, which a rerun may raise to train on); one written under other settings is
an error that names them, before any work, rather than a silent mix of two runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accelerate import Accelerator

from hf_specdec.training.config import TrainConfig

STATE_FILE = "training_state.json"
# fields that change where files go or how fast a run goes, not what it trains; `steps` may grow on a rerun
NOT_SETTINGS = frozenset({"out", "generated_data", "reuse_generated", "feature_cache", "generate_batch_size",
                          "save_every", "threads", "steps", "eval_every"})


class OtherRunError(ValueError):
    """`config.out` holds a checkpoint written under other settings (raised before any work)."""


@dataclass
class TrainingState:
    """What the loop has done: `step` steps, with their losses and metrics, and the held-out measurements (each a
    dict with "step", "loss" and the metrics)."""

    step: int = 0
    loss_history: list[float] = field(default_factory=list)
    metrics_history: list[dict] = field(default_factory=list)
    eval_history: list[dict] = field(default_factory=list)


def run_settings(config: TrainConfig) -> dict:
    """The settings a checkpoint must share with a run that resumes it: the config's class and fields, as JSON values
    (`TrainConfig.values`)."""
    settings = {k: v for k, v in config.values().items() if k not in NOT_SETTINGS}
    return {"config": type(config).__name__, **settings}


def check_settings(folder: Path, config: TrainConfig) -> None:
    """Raise `OtherRunError` if `folder` holds a checkpoint written under other settings than `config`'s."""
    path = folder / STATE_FILE
    if not path.is_file():
        return
    saved = json.loads(path.read_text()).get("settings")
    current = run_settings(config)
    if saved == current:
        return
    if saved is None:
        differ = "settings not recorded"
    else:
        differ = ", ".join(f"{k}: {saved.get(k)!r} there, {current.get(k)!r} now"
                           for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k))
    raise OtherRunError(f"{type(config).__name__}.out: {folder} holds a checkpoint of another run ({differ}); "
                        "remove that folder to start over, or pass another out")


def resume(accelerator: Accelerator, folder: Path) -> TrainingState:
    """Load the checkpoint in `folder` if there is one (its settings checked by `check_settings`); what it did."""
    path = folder / STATE_FILE
    if not path.is_file():
        return TrainingState()
    accelerator.load_state(str(folder))
    saved = json.loads(path.read_text())
    return TrainingState(saved["step"], saved.get("loss_history", []), saved.get("metrics_history", []),
                         saved.get("eval_history", []))


def save(accelerator: Accelerator, folder: Path, state: TrainingState, config: TrainConfig) -> None:
    """Save the state after `state.step` steps (all processes take part; the main one writes the state file)."""
    accelerator.wait_for_everyone()
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        record = {**asdict(state), "settings": run_settings(config)}
        (folder / STATE_FILE).write_text(json.dumps(record, sort_keys=True))
