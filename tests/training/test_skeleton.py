"""The shared training loop's held-out rows: a seeded split that training never draws from, measurements that
leave training as it was and see a drafter learning its rows by heart, kept across a resume, and bad options
refused."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_specdec.cli.main import main as cli_main
from hf_specdec.testbed import loading
from hf_specdec.training import skeleton
from hf_specdec.training.config import TrainConfig
from hf_specdec.training.generated import read_source
from hf_specdec.training.skeleton import split_rows
from tests.conftest import run_under_accelerate

DATA = [Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"]
SEQ_LEN = 32


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, eos_token_id=0, pad_token_id=1,
                         initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _argv(base: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "eagle", "--base", str(base), "--tokenizer", str(loading.testbed_dir() / "tokenizer"),
            "--data", *map(str, DATA), "--out", str(out), "--data-source", "text", "--steps", str(steps),
            "--batch-size", "4", "--seq-len", str(SEQ_LEN), "--learning-rate", "3e-3", "--warmup-steps", "0",
            "--save-every", "5", *extra]


def _train(base: Path, out: Path, steps: int, *extra: str) -> dict:
    assert cli_main(_argv(base, out, steps, *extra)) == 0
    return json.loads((out / "train_metrics.json").read_text())


def _rows(base: Path, tmp_path: Path) -> int:
    """The text's windows: the rows of the runs below."""
    config = TrainConfig(base=base, data=DATA, out=tmp_path, data_source="text", seq_len=SEQ_LEN,
                         tokenizer=loading.testbed_dir() / "tokenizer")
    return len(read_source(config, AutoTokenizer.from_pretrained(config.tokenizer))[0]) // SEQ_LEN


def test_the_split_is_seeded_disjoint_and_whole():
    trained, held = split_rows(50, 7, seed=3)
    assert len(held) == 7 and len(trained) == 43
    assert sorted(trained.tolist() + held.tolist()) == list(range(50))
    assert torch.equal(held, split_rows(50, 7, seed=3)[1])
    assert not torch.equal(held, split_rows(50, 7, seed=4)[1])
    trained, held = split_rows(9, 0, seed=3)
    assert torch.equal(trained, torch.arange(9)) and len(held) == 0


def test_training_never_draws_a_held_out_row_and_measuring_changes_no_step(base, tmp_path, monkeypatch):
    drawn = []
    batch = skeleton.target_batch

    def recording(target, rows, index, *args):
        drawn.append(index.tolist())
        return batch(target, rows, index, *args)

    monkeypatch.setattr(skeleton, "target_batch", recording)
    often = _train(base, tmp_path / "often", 10, "--eval-rows", "8", "--eval-every", "2")
    drawn.clear()
    once = _train(base, tmp_path / "once", 10, "--eval-rows", "8", "--eval-every", "100")
    assert [e["step"] for e in often["eval_history"]] == [2, 4, 6, 8, 10]
    assert [e["step"] for e in once["eval_history"]] == [10]
    assert often["loss_history"] == once["loss_history"], "measuring the held-out rows changed training"
    assert often["eval_history"][-1] == {**once["eval_history"][-1]}
    held = set(split_rows(_rows(base, tmp_path), 8, seed=0)[1].tolist())
    trained, measured = drawn[:10], drawn[10:]  # 10 training batches, then the measurement's 2 batches of 4
    assert not held & {row for index in trained for row in index}, "training drew a held-out row"
    assert [row for index in measured for row in index] == sorted(held)


def test_the_objective_reads_the_training_rows_alone(base, tmp_path, monkeypatch):
    """What an objective reads of the rows when it is built (EAGLE-3's draft vocabulary) and when it is saved
    (Medusa's tree) leaves the held-out rows out."""
    from hf_specdec.training import eagle

    seen = {}
    make = eagle.make_objective

    def recording(config, target, rows):
        seen.setdefault("made", []).append(len(rows.input_ids))
        objective = make(config, target, rows)
        save = objective.save

        def saving(out, target, rows, result):
            seen.setdefault("saved", []).append(len(rows.input_ids))
            save(out, target, rows, result)

        objective.save = saving
        return objective

    monkeypatch.setattr(eagle, "make_objective", recording)
    _train(base, tmp_path / "held", 2, "--eval-rows", "8")
    _train(base, tmp_path / "all", 2)
    count = _rows(base, tmp_path)
    assert seen == {"made": [count - 8, count], "saved": [count - 8, count]}


def test_the_held_out_loss_sees_a_drafter_learn_its_few_rows_by_heart(base, tmp_path):
    held_out = _rows(base, tmp_path) - 4  # 4 rows to train on
    result = _train(base, tmp_path / "run", 150, "--eval-rows", str(held_out), "--eval-every", "150",
                    "--noise", "0")
    trained_loss = sum(result["loss_history"][-5:]) / 5
    (measured,) = result["eval_history"]
    assert measured["loss"] > 1.5 * trained_loss, (measured, trained_loss)
    assert set(measured) == {"step", "loss", "regression", "ce", "accuracy"}
    assert measured["accuracy"] < sum(m["accuracy"] for m in result["metrics_history"][-5:]) / 5


def test_a_resumed_run_keeps_its_measurements(base, tmp_path):
    first = _train(base, tmp_path, 5, "--eval-rows", "8", "--eval-every", "5")
    again = _train(base, tmp_path, 10, "--eval-rows", "8", "--eval-every", "5")
    assert again["eval_history"][0] == first["eval_history"][0]
    assert [e["step"] for e in again["eval_history"]] == [5, 10]


def test_bad_held_out_options_are_refused_before_training(base, tmp_path):
    with pytest.raises(SystemExit, match="eval_rows: expected an int >= 0, got -1"):
        cli_main(_argv(base, tmp_path, 1, "--eval-rows", "-1"))
    with pytest.raises(SystemExit, match="eval_every: 3 given without eval_rows"):
        cli_main(_argv(base, tmp_path, 1, "--eval-every", "3"))
    with pytest.raises(SystemExit, match="eval_rows: 16 held out of 16 rows"):
        cli_main(_argv(base, tmp_path, 1, "--data-source", "generated", "--num-samples", "16", "--eval-rows", "16"))
    rows = _rows(base, tmp_path)
    with pytest.raises(SystemExit, match=f"eval_rows: {rows} held out of the data's {rows} rows"):
        cli_main(_argv(base, tmp_path, 1, "--eval-rows", str(rows)))
    assert not (tmp_path / "train_metrics.json").exists()


def test_data_too_short_or_malformed_is_one_error_line(base, tmp_path):
    """The CLI prints a data file's fault as `error: ...` (no traceback) and trains nothing."""
    short, broken = tmp_path / "short.txt", tmp_path / "broken.jsonl"
    short.write_text("x")
    broken.write_text('{"text": "a"}\n{oops\n')
    for data, match in ((short, "need at least"), (broken, "broken.jsonl line 2 is not JSON")):
        argv = _argv(base, tmp_path / data.stem, 1)
        argv[argv.index("--data") + 1: argv.index("--out")] = [str(data)]
        with pytest.raises(SystemExit, match=f"error: EagleTrainConfig.data: .*{match}"):
            cli_main(argv)
        assert not (tmp_path / data.stem / "train_metrics.json").exists()


def test_weight_decay_is_applied_and_a_negative_one_refused_before_training(base, tmp_path):
    with pytest.raises(SystemExit, match="weight_decay: expected >= 0, got -0.1"):
        cli_main(_argv(base, tmp_path / "refused", 1, "--weight-decay", "-0.1"))
    assert not (tmp_path / "refused" / "train_metrics.json").exists()
    losses = {}
    for decay in ("0.01", "0.5"):
        assert cli_main(_argv(base, tmp_path / decay, 4, "--weight-decay", decay)) == 0
        metrics = json.loads((tmp_path / decay / "train_metrics.json").read_text())
        assert metrics["config"]["weight_decay"] == float(decay)
        assert metrics["config"]["data"] == [str(path) for path in DATA]  # as JSON lists paths
        losses[decay] = metrics["loss_history"]
    assert losses["0.01"][0] == losses["0.5"][0]  # the same first batch, before any update
    assert losses["0.01"][-1] != pytest.approx(losses["0.5"][-1], rel=1e-6)  # the decay moved the weights


def test_two_cpu_processes_measure_once_and_keep_in_step(base, tmp_path):
    """Under accelerate with 2 processes the main one measures the held-out rows while the other waits at the next
    step's gradient exchange; the run ends with every measurement."""
    result = run_under_accelerate(_argv(base, tmp_path, 4, "--eval-rows", "8", "--eval-every", "2"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads((tmp_path / "train_metrics.json").read_text())["eval_history"]
    assert [m["step"] for m in measured] == [2, 4]
