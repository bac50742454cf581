"""EAGLE head training: the loss goes down for both versions, generated data is cached, checkpoints resume, the
training-time-test mask is EAGLE-3's, the draft vocabulary keeps the most frequent ids, and 2 processes run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from hf_specdec.cli.main import main as cli_main
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.testbed import loading
from hf_specdec.training.config import GENERATED_FILE
from hf_specdec.training.eagle import build_draft_vocab, ttt_attention_mask

ROOT = Path(__file__).resolve().parents[2]
DATA = [Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    # a wide initialisation gives the random target peaked next-token distributions worth learning
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, eos_token_id=0, pad_token_id=1,
                         initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _args(base: Path, out: Path, version: str, steps: int, extra: list[str] = ()) -> list[str]:
    return ["--base", str(base), "--tokenizer", str(loading.testbed_dir() / "tokenizer"), "--data", *map(str, DATA),
            "--out", str(out), "--version", version, "--steps", str(steps), "--batch-size", "4", "--seq-len", "32",
            "--learning-rate", "3e-3", "--warmup-steps", "0", "--save-every", "5", "--ttt-steps", "3", *extra]


def main(argv: list[str]) -> int:
    return cli_main(["train", "eagle", *argv])


def _history(out: Path) -> list[float]:
    return json.loads((out / "train_metrics.json").read_text())["loss_history"]


@pytest.mark.parametrize("version, drop", [("eagle", 0.1), ("eagle3", 0.3)])
def test_training_lowers_the_loss(base, tmp_path, version, drop):
    extra = ["--data-source", "text"] + (["--draft-vocab-size", "1024"] if version == "eagle3" else [])
    assert main(_args(base, tmp_path, version, steps=20, extra=extra)) == 0
    history = _history(tmp_path)
    assert len(history) == 20
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - drop
    head = EagleHead.from_pretrained(tmp_path)
    assert head.config.version == version and head.config.vocab_size == 4096
    if version == "eagle3":
        assert head.config.draft_vocab_size == 1024 and int(head.t2d.sum()) == 1024


def test_generated_data_is_cached_and_training_resumes(base, tmp_path):
    extra = ["--num-samples", "2", "--prompt-len", "16"]
    main(_args(base, tmp_path, "eagle", steps=5, extra=extra))
    assert json.loads((tmp_path / "checkpoint" / "training_state.json").read_text())["step"] == 5
    first = _history(tmp_path)
    windows = load_file(tmp_path / GENERATED_FILE)["input_ids"]  # [2, 32]: 16 text tokens, 16 generated
    target = LlamaForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        greedy = target(windows).logits[:, 15:-1].argmax(-1)
    assert torch.equal(greedy, windows[:, 16:]), "the continuations are not the target's greedy choices"
    stamp = (tmp_path / GENERATED_FILE).stat().st_mtime_ns
    main(_args(base, tmp_path, "eagle", steps=7, extra=extra))
    assert _history(tmp_path)[:5] == first and len(_history(tmp_path)) == 7, "the rerun did not go on from step 5"
    assert (tmp_path / GENERATED_FILE).stat().st_mtime_ns == stamp, "the rerun generated its data again"


def test_ttt_mask_sees_step_zero_causally_and_its_own_index_in_later_steps():
    mask = ttt_attention_mask(4, 2, torch.float32)
    assert mask.shape == (1, 1, 4, 12)
    seen = (mask[0, 0] == 0).int()
    assert seen.tolist() == [
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
    ]
    assert torch.equal(ttt_attention_mask(3, 0, torch.float32)[0, 0] == 0, torch.ones(3, 3).tril().bool())


def test_draft_vocab_keeps_the_most_frequent_ids_in_order():
    d2t, t2d = build_draft_vocab(torch.tensor([7, 7, 7, 2, 2, 9, 5, 5, 5, 5]), vocab_size=10, draft_vocab_size=3)
    assert t2d.nonzero().flatten().tolist() == [2, 5, 7]
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 7]


def test_bad_training_input(base, tmp_path):
    with pytest.raises(SystemExit, match="EagleTrainConfig.data: expected existing files"):
        main(["--base", str(base), "--data", str(tmp_path / "none.txt"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="EagleTrainConfig.ttt_steps"):
        main(_args(base, tmp_path, "eagle3", steps=1, extra=["--data-source", "text", "--ttt-steps", "40"]))
    with pytest.raises(SystemExit, match="EagleTrainConfig.draft_vocab_size"):
        main(_args(base, tmp_path, "eagle", steps=1, extra=["--data-source", "text", "--draft-vocab-size", "100"]))


def test_two_cpu_processes_under_accelerate(base, tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "hf_specdec.cli", "train", "eagle",
               *_args(base, tmp_path, "eagle3", steps=2, extra=["--num-samples", "3", "--prompt-len", "24"])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_file(tmp_path / GENERATED_FILE)["input_ids"].shape == (3, 32)
    assert EagleHead.from_pretrained(tmp_path).config.version == "eagle3"
