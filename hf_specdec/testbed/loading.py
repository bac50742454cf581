"""Locating and loading the committed test bed (tokenizer, target, draft)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

TESTBED_ENV_VAR = "HF_SPECDEC_TESTBED"


def testbed_dir() -> Path:
    """The test-bed folder: ``$HF_SPECDEC_TESTBED`` if set, else the repo's ``examples/testbed``."""
    override = os.environ.get(TESTBED_ENV_VAR)
    path = Path(override) if override else Path(__file__).resolve().parents[2] / "examples" / "testbed"
    if not path.is_dir():
        raise FileNotFoundError(
            f"test bed folder not found: {path}. Run from a checkout of the hf_specdec repository, "
            f"set {TESTBED_ENV_VAR} to a folder holding tokenizer/, target/ and draft/, "
            "or rebuild it with `python examples/train_testbed.py`."
        )
    return path


def _model_dir(name: str) -> Path:
    path = testbed_dir() / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no model config at {path / 'config.json'}; rebuild with `python examples/train_testbed.py`"
        )
    return path


def load_testbed(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedTokenizerBase, LlamaForCausalLM, LlamaForCausalLM]:
    """Load ``(tokenizer, target, draft)`` offline from safetensors, in eval mode."""
    tokenizer = AutoTokenizer.from_pretrained(testbed_dir() / "tokenizer", local_files_only=True)
    models = []
    for name in ("target", "draft"):
        model = LlamaForCausalLM.from_pretrained(
            _model_dir(name), dtype=dtype, use_safetensors=True, local_files_only=True
        )
        models.append(model.to(device).eval())
    return tokenizer, models[0], models[1]


# each kind of heads for the test-bed target, and the `hf-specdec train` method that trains it (the repository
# commits Medusa, EAGLE-1/2 and EAGLE-3 heads)
HEAD_TRAINERS = {"medusa": "medusa", "eagle": "eagle", "eagle3": "eagle", "mlp_speculator": "mlp_speculator"}


def heads_dir(kind: str) -> Path:
    """The test-bed target's heads of one kind (Medusa, EAGLE-1/2, EAGLE-3, MLP speculator): ``heads/<kind>``
    beside the test-bed folder; a clear error when that folder holds none."""
    if kind not in HEAD_TRAINERS:
        raise ValueError(f"kind: expected one of {tuple(HEAD_TRAINERS)}, got {kind!r}")
    path = testbed_dir().parent / "heads" / kind
    if not (path / "adapter_config.json").is_file():
        readme = path / "README.md"
        raise FileNotFoundError(
            f"no {kind} heads at {path} (expected adapter_config.json); train them with "
            f"`hf-specdec train {HEAD_TRAINERS[kind]}`" + (f" (see {readme})" if readme.is_file() else "")
        )
    return path
