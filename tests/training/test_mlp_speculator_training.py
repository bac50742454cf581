"""MLP speculator training: the loss is the sum over stages of cross-entropy against the row's token i + 2 after each
position (teacher-forced), it goes down, the saved folder loads, stage 2 starts from stage 1's folder, the target's
embeddings and lm_head can seed a new speculator or be shared by it (over a token map), bad options are clear errors,
and 2 processes run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from hf_specdec.cli.main import main as cli_main
from hf_specdec.heads import MlpSpeculator
from hf_specdec.heads.token_map import most_frequent_tokens
from hf_specdec.testbed import loading
from hf_specdec.training.config import GENERATED_FILE
from hf_specdec.training.generated import TrainingRows
from hf_specdec.training.mlp_speculator import MlpSpeculatorTrainConfig, make_objective
from hf_specdec.training.target_features import target_batch
from tests.conftest import run_under_accelerate
from tests.training.test_eagle_training import DATA, base  # noqa: F401  (base is a fixture)


def _args(target: Path, out: Path, steps: int, extra: list[str] = ()) -> list[str]:
    return ["train", "mlp_speculator", "--base", str(target), "--tokenizer", str(loading.testbed_dir() / "tokenizer"),
            "--data", *map(str, DATA), "--out", str(out), "--steps", str(steps), "--batch-size", "4", "--seq-len",
            "32", "--learning-rate", "3e-2", "--warmup-steps", "0", "--save-every", "10", "--inner-dim", "24",
            "--top-k-tokens-per-head", "3", "2", "2", *extra]


def _metrics(out: Path) -> dict:
    return json.loads((out / "train_metrics.json").read_text())


@pytest.fixture(scope="module")
def stage1(base, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("stage1")
    assert cli_main(_args(base, out, steps=20, extra=["--data-source", "text"])) == 0
    return out


def test_stage_one_lowers_the_loss_and_saves_a_loadable_speculator(base, stage1):  # noqa: F811
    metrics = _metrics(stage1)
    history = metrics["loss_history"]
    assert len(history) == 20
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - 2.0  # per-step noise is about 0.2
    assert all(len(m["stage_loss"]) == 3 and len(m["stage_accuracy"]) == 3 for m in metrics["metrics_history"])
    assert history[0] == pytest.approx(sum(metrics["metrics_history"][0]["stage_loss"]), rel=1e-5)
    head = MlpSpeculator.from_pretrained(stage1)
    config = head.config
    assert (config.emb_dim, config.vocab_size, config.n_predict, config.inner_dim) == (32, 4096, 3, 24)
    assert config.tie_weights and config.scale_input and config.top_k_tokens_per_head == [3, 2, 2]
    assert config.base_model_name_or_path == str(base)
    assert {t.dtype for t in load_file(stage1 / "adapter_model.safetensors").values()} == {torch.float32}


def test_the_loss_is_each_stages_cross_entropy_on_the_rows_own_tokens(base):  # noqa: F811
    """The objective against the speculator's own per-path logits: at position t the path is x_{t+1..t+3} and stage
    j's label x_{t+2+j}; only trained labels count (here rows 1 and 2 are trained from tokens 5 and 7 on)."""
    target = LlamaForCausalLM.from_pretrained(base).eval()
    config = MlpSpeculatorTrainConfig(base=base, data=DATA, out=base, seq_len=12, prompt_len=4,
                                      inner_dim=16, tie_weights=False)
    torch.manual_seed(0)
    ids = torch.randint(2, 4096, (3, 12))
    rows = TrainingRows(ids, torch.tensor([12, 12, 10]), torch.tensor([0, 5, 7]))
    objective = make_objective(config, target, rows)
    batch = target_batch(target, rows, torch.arange(3), torch.device("cpu"), None, objective.feature_layers)
    with torch.no_grad():
        loss, metrics = objective(batch, target)
        hidden = target.model(ids).last_hidden_state
        expected = []
        for stage in range(3):
            terms = []
            for row in range(3):
                for t in range(12 - 2 - stage):
                    label = 2 + stage + t
                    if not rows.starts[row] <= label < rows.lengths[row]:
                        continue
                    logits = objective.head(hidden[row, t], ids[row, t + 1 : t + 4])[stage]
                    terms.append(torch.nn.functional.cross_entropy(logits[None], ids[row, label][None]))
            expected.append(float(torch.stack(terms).mean()))
    assert metrics["stage_loss"] == pytest.approx(expected, rel=1e-5)
    assert float(loss) == pytest.approx(sum(expected), rel=1e-5)


def test_on_the_targets_vocabulary_the_loss_is_over_the_token_map(base):  # noqa: F811
    """shared_vocab with a token map of the rows' 16 most frequent tokens: each stage's cross-entropy over the map's
    ids, at the labels inside it; accuracy counts a label outside the map as missed."""
    target = LlamaForCausalLM.from_pretrained(base).eval()
    config = MlpSpeculatorTrainConfig(base=base, data=DATA, out=base, seq_len=12, prompt_len=4, inner_dim=16,
                                      shared_vocab=True, token_map_size=16)
    torch.manual_seed(0)
    ids = torch.randint(2, 200, (3, 12))  # about 30 distinct ids: some labels fall outside the map
    rows = TrainingRows.full(ids)
    objective = make_objective(config, target, rows)
    token_map = objective.head.token_map
    assert torch.equal(token_map, most_frequent_tokens(ids, 4096, 16))
    batch = target_batch(target, rows, torch.arange(3), torch.device("cpu"), None, objective.feature_layers)
    with torch.no_grad():
        loss, metrics = objective(batch, target)
        hidden = target.model(ids).last_hidden_state
        vocab = objective.head.target_vocab(target)
        expected, hits, count = [], 0, 0
        for stage in range(3):
            terms = []
            for row in range(3):
                for t in range(12 - 2 - stage):
                    label = ids[row, 2 + stage + t]
                    logits = objective.head(hidden[row, t], ids[row, t + 1 : t + 4], vocab)[stage]  # [V]
                    if stage == 0:
                        hits, count = hits + int(logits.argmax() == label), count + 1
                    if label in token_map:
                        terms.append(torch.nn.functional.cross_entropy(logits[token_map][None],
                                                                       (token_map == label).nonzero()[0]))
            expected.append(float(torch.stack(terms).mean()))
    assert 0 < len(terms) < 3 * 8
    assert metrics["stage_loss"] == pytest.approx(expected, rel=1e-5)
    assert float(loss) == pytest.approx(sum(expected), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(hits / count)


def test_on_the_targets_vocabulary_training_lowers_the_loss_and_saves_small_files(base, tmp_path):  # noqa: F811
    # on the target's own continuations, which its lm_head scores well (the random target's embeddings know no text)
    extra = ["--num-samples", "8", "--prompt-len", "16", "--shared-vocab", "--token-map-size", "512", "--inner-dim",
             "0"]
    assert cli_main(_args(base, tmp_path, steps=20, extra=extra)) == 0
    history = _metrics(tmp_path)["loss_history"]
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - 2.0  # 18.1 -> 14.3 when written
    stored = load_file(tmp_path / "adapter_model.safetensors")
    assert max(t.numel() for t in stored.values()) == 32 * 32 and stored["token_map"].shape == (512,)
    head = MlpSpeculator.from_pretrained(tmp_path)
    assert head.config.shared_vocab and head.config.token_map_size == 512 and head.config.inner_size == 32


def test_on_the_targets_vocabulary_a_narrower_speculator_starts_from_top_directions(base, tmp_path):  # noqa: F811
    target = LlamaForCausalLM.from_pretrained(base).eval()
    common = {"base": base, "data": DATA, "out": tmp_path, "seq_len": 12, "prompt_len": 4, "shared_vocab": True}
    rows = TrainingRows.full(torch.randint(2, 4096, (2, 12)))
    head = make_objective(MlpSpeculatorTrainConfig(**common, inner_dim=8, init_from_target=True), target, rows).head
    basis = torch.linalg.svd(target.get_output_embeddings().weight.detach().float(), full_matrices=False)[2][:8].T
    torch.testing.assert_close(head.emb_map[0].weight, basis.T)
    torch.testing.assert_close(head.head_map[0].weight, basis)
    wide = make_objective(MlpSpeculatorTrainConfig(**common), target, rows).head
    assert torch.equal(wide.emb_map[0].weight, torch.eye(32)) and torch.equal(wide.head_map[0].weight, torch.eye(32))


def test_stage_two_starts_from_stage_ones_folder_on_generated_rows(base, stage1, tmp_path):  # noqa: F811
    # a learning rate too small to move the weights: what is saved is what was loaded
    extra = ["--init-from", str(stage1), "--num-samples", "3", "--prompt-len", "16", "--temperature", "1",
             "--learning-rate", "1e-12"]
    assert cli_main(_args(base, tmp_path, steps=2, extra=extra)) == 0
    assert load_file(tmp_path / GENERATED_FILE)["input_ids"].shape == (3, 32)
    before, after = MlpSpeculator.from_pretrained(stage1), MlpSpeculator.from_pretrained(tmp_path)
    assert after.config == before.config
    for (name, a), b in zip(after.state_dict().items(), before.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_a_new_speculator_can_start_from_the_targets_embeddings_and_lm_head(base, tmp_path):  # noqa: F811
    target = LlamaForCausalLM.from_pretrained(base).eval()
    common = {"base": base, "data": DATA, "out": tmp_path, "seq_len": 12, "prompt_len": 4}
    rows = TrainingRows.full(torch.randint(2, 4096, (2, 12)))
    config = MlpSpeculatorTrainConfig(**common, init_from_target=True, tie_weights=False)
    head = make_objective(config, target, rows).head
    for stage in range(3):
        assert torch.equal(head.emb[stage].weight, target.get_input_embeddings().weight)
        assert torch.equal(head.head[stage].weight, target.get_output_embeddings().weight)
    fresh = make_objective(MlpSpeculatorTrainConfig(**common), target, rows).head
    assert not torch.equal(fresh.emb[0].weight, target.get_input_embeddings().weight)


def test_a_narrower_speculator_starts_from_the_targets_top_singular_directions(base, tmp_path):  # noqa: F811
    target = LlamaForCausalLM.from_pretrained(base).eval()
    common = {"base": base, "data": DATA, "out": tmp_path, "seq_len": 12, "prompt_len": 4}
    rows = TrainingRows.full(torch.randint(2, 4096, (2, 12)))
    head = make_objective(MlpSpeculatorTrainConfig(**common, inner_dim=8, init_from_target=True), target, rows).head
    lm_head = target.get_output_embeddings().weight.detach().float()  # [V, H]
    basis = torch.linalg.svd(lm_head, full_matrices=False)[2][:8].T  # [H, 8]

    def at_init_scale(matrix):  # entries of mean square 1 / inner, as the random initialisation's
        return matrix / (matrix.pow(2).mean() * 8).sqrt()

    torch.testing.assert_close(head.head[0].weight, at_init_scale(lm_head @ basis))
    embeddings = target.get_input_embeddings().weight.detach().float()
    torch.testing.assert_close(head.emb[0].weight, at_init_scale(embeddings @ basis))
    assert head.emb[0].weight.pow(2).mean().item() == pytest.approx(1 / 8, rel=1e-4)
    # the projection keeps the logits' largest directions: the rank-8 logits correlate with the target's
    hidden = torch.randn(64, lm_head.shape[1])
    full, low = hidden @ lm_head.T, (hidden @ basis) @ head.head[0].weight.T
    assert torch.corrcoef(torch.stack([full.flatten(), low.flatten()]))[0, 1] > 0.3


def test_bad_options_are_clear_errors(base, stage1, tmp_path):  # noqa: F811
    def refused(extra: list[str], message: str) -> None:
        with pytest.raises(SystemExit, match=message):
            cli_main(_args(base, tmp_path / "x", steps=1, extra=["--data-source", "text", *extra]))

    refused(["--n-predict", "0"], "MlpSpeculatorTrainConfig.n_predict: expected an int >= 1, got 0")
    refused(["--n-predict", "1"], "MlpSpeculatorTrainConfig.tie_weights: ties the weights of several stages; "
                                  "n_predict is 1")
    refused(["--n-predict", "2"], r"MlpSpeculatorTrainConfig.top_k_tokens_per_head: expected 2 ints >= 1 .*got "
                                  r"\[3, 2, 2\]")
    refused(["--inner-dim", "-3"], "MlpSpeculatorTrainConfig.inner_dim: expected an int >= 0, got -3")
    refused(["--seq-len", "4"], "MlpSpeculatorTrainConfig.seq_len: .*expected at least n_predict \\+ 2 = 5 tokens")
    refused(["--n-candidates", "13"], "MlpSpeculatorTrainConfig.n_candidates: expected at most the tree's 12 paths")
    refused(["--inner-dim", "40", "--init-from-target"],
            "MlpSpeculatorTrainConfig.init_from_target: .*\\(32 wide\\), which cannot fill inner_dim 40")
    refused(["--init-from", str(tmp_path / "nowhere")], "MlpSpeculatorTrainConfig.init_from: no such folder")
    refused(["--token-map-size", "64"], r"MlpSpeculatorTrainConfig.token_map_size: expected an int >= 1 with "
                                        r"shared_vocab, got 64 \(shared_vocab=False\)")
    refused(["--shared-vocab", "--token-map-size", "5000"], "MlpSpeculatorTrainConfig.token_map_size: expected at "
                                                           "most the target's vocabulary, 4096, got 5000")
    refused(["--init-from", str(stage1), "--no-tie-weights"],
            "init_from: .* holds a speculator with tie_weights True, this run asks for False; pass the options it "
            "was trained with")
    refused(["--init-from", str(stage1), "--inner-dim", "0"], "holds a speculator with inner_dim 24, this run asks "
                                                              "for 32")
    refused(["--init-from", str(stage1), "--inner-dim", "0", "--init-from-target"],
            "init_from_target: starts a new speculator from the target's embeddings, and init_from")
    other = tmp_path / "other"
    MlpSpeculator(replace(MlpSpeculator.from_pretrained(stage1).config, vocab_size=50)).save_pretrained(other)
    refused(["--init-from", str(other)], "MlpSpeculatorTrainConfig.init_from: the MLP speculator's vocab_size 50 "
                                         "does not match the target's vocab_size 4096")


def test_two_cpu_processes_under_accelerate(base, tmp_path):  # noqa: F811
    result = run_under_accelerate(_args(base, tmp_path, steps=2, extra=["--num-samples", "3", "--prompt-len", "24"]),
                                  tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_file(tmp_path / GENERATED_FILE)["input_ids"].shape == (3, 32)
    assert len(_metrics(tmp_path)["loss_history"]) == 2
    assert MlpSpeculator.from_pretrained(tmp_path).config.n_predict == 3
