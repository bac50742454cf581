"""Medusa-1 training: the loss goes down on CPU, checkpoints resume, the result loads, and 2 processes run (both
stages)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from hf_specdec.cli.main import main
from hf_specdec.heads import MedusaHeads
from hf_specdec.testbed import loading
from hf_specdec.training.config import GENERATED_FILE
from hf_specdec.training.generated import TrainingRows
from hf_specdec.training.medusa import MedusaTrainConfig, make_objective
from hf_specdec.training.target_features import target_batch
from tests.conftest import run_under_accelerate


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, eos_token_id=0, pad_token_id=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


DATA = [Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"]


def _args(base: Path, out: Path, steps: int, extra: list[str] = ()) -> list[str]:
    return ["train", "medusa", "--base", str(base), "--tokenizer", str(loading.testbed_dir() / "tokenizer"),
            "--data", *map(str, DATA), "--out", str(out), "--steps", str(steps), "--batch-size", "4",
            "--seq-len", "64", "--num-heads", "2", "--learning-rate", "6e-3", "--save-every", "10",
            "--warmup-steps", "0", *extra]


def test_training_lowers_the_loss_and_saves_loadable_heads(base, tmp_path):
    assert main(_args(base, tmp_path, steps=30, extra=["--data-source", "text"])) == 0
    history = json.loads((tmp_path / "train_metrics.json").read_text())["loss_history"]
    assert len(history) == 30
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - 0.5  # per-step noise is about 0.1
    heads = MedusaHeads.from_pretrained(tmp_path)
    assert heads.config.num_heads == 2 and heads.config.vocab_size == 4096


def test_shared_heads_keep_the_most_frequent_trained_tokens_as_their_token_map(base, tmp_path):
    extra = ["--data-source", "text", "--shared-lm-head", "--token-map-size", "256", "--tree-nodes", "0"]
    assert main(_args(base, tmp_path, steps=2, extra=extra)) == 0
    heads = MedusaHeads.from_pretrained(tmp_path)
    assert heads.config.token_map_size == 256 and heads.token_map.tolist() == sorted(heads.token_map.tolist())


@pytest.mark.parametrize("shared_lm_head, token_map", [(True, False), (False, False), (True, True)])
def test_the_loss_is_each_heads_cross_entropy_on_its_trained_labels(base, shared_lm_head, token_map):
    """The objective against the heads' own logits, position by position: head i's label at t is x_{t+2+i}, and only
    trained labels count (rows 1 and 2 are trained from tokens 5 and 7 on and end early; heads see no padding). With a
    token map the heads learn over the map's ids: the cross-entropy over its rows, on labels inside it."""
    target = LlamaForCausalLM.from_pretrained(base).eval()
    config = MedusaTrainConfig(base=base, data=DATA, out=base, seq_len=12, prompt_len=4, num_heads=3,
                               shared_lm_head=shared_lm_head)
    torch.manual_seed(0)
    ids = torch.randint(2, 4096, (3, 12))
    rows = TrainingRows(ids, torch.tensor([12, 12, 10]), torch.tensor([0, 5, 7]))
    objective = make_objective(config, target, rows)
    kept = sorted(set(ids.flatten().tolist()[::2]) | set(range(3000, 3100)))  # half the rows' ids, and others
    if token_map:
        objective.heads.set_token_map(torch.tensor(kept))
    with torch.no_grad():  # heads that differ from one another and from the target's own guess
        for parameter in objective.heads.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    batch = target_batch(target, rows, torch.arange(3), torch.device("cpu"), None, objective.feature_layers)
    with torch.no_grad():
        loss, metrics = objective(batch, target)
        hidden = target.model(ids).last_hidden_state
        lm_head = target.get_output_embeddings()
        expected = []
        for head in range(3):
            terms = []
            for row in range(3):
                for t in range(12 - 2 - head):
                    label = t + 2 + head
                    if not rows.starts[row] <= label < rows.lengths[row]:
                        continue
                    logits = objective.heads(hidden[row, t], lm_head)[head]
                    if not token_map:
                        terms.append(torch.nn.functional.cross_entropy(logits[None].float(), ids[row, label][None]))
                    elif int(ids[row, label]) in kept:
                        index = torch.tensor([kept.index(int(ids[row, label]))])
                        terms.append(torch.nn.functional.cross_entropy(logits[None, kept].float(), index))
            assert terms, "every label of this head lies outside the map"
            expected.append(float(torch.stack(terms).mean()))
    assert metrics["head_loss"] == pytest.approx(expected, rel=1e-5)
    assert float(loss) == pytest.approx(sum(config.decay**i * term for i, term in enumerate(expected)), rel=1e-5)


def test_the_tree_is_fitted_to_the_ranks_the_heads_draft_with_over_their_token_map(base):
    """Rank accuracies for the fitted tree come from the logits the heads draft with: over a map that holds the rows'
    own ids, their labels rank near the top; over the whole vocabulary of a random target they do not."""
    target = LlamaForCausalLM.from_pretrained(base).eval()
    config = MedusaTrainConfig(base=base, data=DATA, out=base, seq_len=12, prompt_len=4, num_heads=2,
                               shared_lm_head=True, batch_size=3)
    torch.manual_seed(0)
    ids = torch.randint(2, 4096, (3, 12))
    rows = TrainingRows(ids, torch.tensor([12, 12, 12]), torch.tensor([0, 0, 0]))
    objective = make_objective(config, target, rows)
    lm_head = target.get_output_embeddings()
    whole = objective._rank_accuracy(target, lm_head, rows)  # [K, R]
    objective.heads.set_token_map(torch.unique(ids))
    mapped = objective._rank_accuracy(target, lm_head, rows)
    assert float(mapped.sum()) > 0.3 and float(whole.sum()) < float(mapped.sum()) / 4, (whole, mapped)


def test_training_resumes_from_its_checkpoint(base, tmp_path):
    main(_args(base, tmp_path, steps=10, extra=["--data-source", "text"]))
    state = json.loads((tmp_path / "checkpoint" / "training_state.json").read_text())
    first = json.loads((tmp_path / "train_metrics.json").read_text())["loss_history"]
    assert state["step"] == 10 and state["loss_history"] == first and len(first) == 10
    config = json.loads((tmp_path / "train_metrics.json").read_text())["config"]
    settings = {k: v for k, v in state["settings"].items() if k != "config"}
    assert settings == {k: config[k] for k in settings} and settings["data"] == config["data"], \
        "the checkpoint's settings and the metrics' config are one serialization"
    assert settings["learning_rate"] == 0.006 and isinstance(settings["data"], list)
    main(_args(base, tmp_path, steps=12, extra=["--data-source", "text"]))
    history = json.loads((tmp_path / "train_metrics.json").read_text())["loss_history"]
    assert len(history) == 12 and history[:10] == first, "the rerun did not go on from step 10 with its history"
    with pytest.raises(SystemExit, match=r"MedusaTrainConfig.out: .* holds a checkpoint of another run \(learning_rate: "
                                         r"0.006 there, 0.001 now\); remove that folder"):
        main([*_args(base, tmp_path, steps=14, extra=["--data-source", "text"]), "--learning-rate", "1e-3"])
    assert json.loads((tmp_path / "checkpoint" / "training_state.json").read_text())["step"] == 12


def test_bad_training_input(base, tmp_path):
    with pytest.raises(SystemExit, match="MedusaTrainConfig.token_map_size: expected >= 1 with shared_lm_head"):
        main(_args(base, tmp_path, steps=1, extra=["--data-source", "text", "--token-map-size", "256"]))
    with pytest.raises(SystemExit, match="MedusaTrainConfig.data: expected existing files"):
        main(["train", "medusa", "--base", str(base), "--data", str(tmp_path / "none.txt"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="MedusaTrainConfig.base: no model at"):
        main(["train", "medusa", "--base", str(tmp_path), "--data", *map(str, DATA), "--out", str(tmp_path)])


@pytest.mark.parametrize("stage", [["--stage", "1", "--num-samples", "4", "--prompt-len", "60"],
                                   ["--stage", "2", "--self-distillation", "--lora-r", "2", "--data-source", "text"]])
def test_two_cpu_processes_under_accelerate(base, tmp_path, stage):
    result = run_under_accelerate(_args(base, tmp_path, steps=2, extra=[*stage, "--tree-nodes", "4"]), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "adapter_model.safetensors").is_file()
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file() == ("2" in stage)
    assert len(MedusaHeads.from_pretrained(tmp_path).config.tree_paths) == 4
    if "--num-samples" in stage:  # both processes' continuations were gathered
        assert load_file(tmp_path / GENERATED_FILE)["input_ids"].shape == (4, 64)


def test_self_distillation_data_is_the_targets_greedy_output(base, tmp_path):
    assert main(_args(base, tmp_path, steps=1, extra=["--num-samples", "3", "--prompt-len", "58"])) == 0
    rows = load_file(tmp_path / GENERATED_FILE)["input_ids"]  # [3, 64]: 58 text tokens, 6 generated
    assert rows.shape == (3, 64)
    target = LlamaForCausalLM.from_pretrained(base)
    for row in rows:
        prompt = row[None, :58]
        expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                   min_new_tokens=6, do_sample=False, pad_token_id=1)
        assert torch.equal(expected[0], row)
