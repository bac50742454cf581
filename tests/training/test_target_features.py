"""The cached target features are what a target forward gives; stale or damaged shards are rebuilt, matching ones
kept; prompt-record rows stop at EOS and their padding counts in no loss; training from the cache follows the same
loss curve as training that runs the target on every batch."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from hf_specdec.cli.main import main as cli_main
from hf_specdec.testbed import loading
from hf_specdec.training.config import GENERATED_FILE
from hf_specdec.training.generated import TrainingRows
from hf_specdec.training.target_features import (
    FINAL_LAYER,
    build_feature_cache,
    feature_key,
    run_target,
    target_batch,
    target_logits,
)

DATA = [Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, eos_token_id=0, pad_token_id=1,
                         initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target(base):
    return LlamaForCausalLM.from_pretrained(base).eval()


def _rows() -> TrainingRows:
    generator = torch.Generator().manual_seed(1)
    lengths = [9, 5, 7, 9, 3]
    return TrainingRows.padded([torch.randint(2, 4096, (n,), generator=generator) for n in lengths], pad_token_id=1)


@pytest.mark.parametrize("layers", [FINAL_LAYER, (1, 2, 3)])
def test_cached_features_are_the_target_forward(base, target, tmp_path, layers):
    rows = _rows()
    key = feature_key(base, target.dtype, layers, rows)
    # 2 rows per shard: 3 shards, the last one partial
    cache = build_feature_cache(target, rows, layers, tmp_path, key, batch_size=2, accelerator=Accelerator(cpu=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"shard-0000{i}.safetensors" for i in range(3)]
    index = torch.tensor([4, 0, 3])
    batch = target_batch(target, rows, index, torch.device("cpu"), cache, layers)
    direct = target_batch(target, rows, index, torch.device("cpu"), None, layers)
    valid = rows.real(index)
    assert torch.equal(batch.real, valid) and valid.sum(1).tolist() == [3, 9, 9]
    for name in ("features", "hidden"):  # shards run rows of a shard together: equal up to float rounding
        torch.testing.assert_close(getattr(batch, name)[valid], getattr(direct, name)[valid], rtol=1e-5, atol=1e-5)
    assert torch.equal(batch.argmax[valid], direct.argmax[valid])
    with torch.no_grad():  # and the direct batch is the model's own forward, row by row
        for i, row in enumerate(index.tolist()):
            ids = rows.input_ids[row, : rows.lengths[row]][None]
            out = target(ids, output_hidden_states=True)
            logits = target_logits(direct.hidden[i, : ids.shape[1]], target.lm_head)
            torch.testing.assert_close(logits, out.logits[0], rtol=1e-4, atol=1e-4)
            expected = out.hidden_states[-1] if layers == FINAL_LAYER else torch.cat(
                [out.hidden_states[j] for j in layers], -1)
            torch.testing.assert_close(batch.features[i, : ids.shape[1]], expected[0], rtol=1e-4, atol=1e-4)
    if layers == FINAL_LAYER:
        assert batch.hidden is batch.features  # EAGLE-1/2's feature is the hidden state: stored once
    short = target_batch(target, rows, torch.tensor([1, 4]), torch.device("cpu"), cache, layers)  # lengths 5, 3
    assert short.input_ids.shape == (2, 5) and short.features.shape[:2] == (2, 5), "a batch is its longest row"
    assert torch.equal(short.features[1, 3:], torch.zeros_like(short.features[1, 3:]))
    longer = target_batch(target, rows, torch.tensor([1, 4]), torch.device("cpu"), cache, layers, min_length=7)
    assert longer.input_ids.shape == (2, 7) and torch.equal(longer.features[:, :5], short.features)


def test_draft_vocab_logits_are_the_rows_of_the_full_logits(target):
    hidden = torch.randn(2, 3, 32)
    vocab = torch.zeros(4096, dtype=torch.bool)
    vocab[torch.tensor([5, 17, 4000])] = True
    torch.testing.assert_close(target_logits(hidden, target.lm_head, vocab), target_logits(hidden, target.lm_head)
                               [..., vocab])


def test_matching_shards_are_kept_and_damaged_or_stale_ones_rebuilt(base, target, tmp_path):
    rows, accelerator = _rows(), Accelerator(cpu=True)
    key = feature_key(base, target.dtype, FINAL_LAYER, rows)
    build_feature_cache(target, rows, FINAL_LAYER, tmp_path, key, 2, accelerator)
    shards = sorted(tmp_path.iterdir())
    stamps = [p.stat().st_mtime_ns for p in shards]
    shards[1].write_bytes(shards[1].read_bytes()[:100])  # truncated
    (tmp_path / "shard-00007.safetensors").write_bytes(b"left over")
    cache = build_feature_cache(target, rows, FINAL_LAYER, tmp_path, key, 2, accelerator)
    assert [p.stat().st_mtime_ns for p in shards][::2] == stamps[::2], "whole shards were computed again"
    assert not (tmp_path / "shard-00007.safetensors").exists()
    torch.testing.assert_close(cache.read(torch.tensor([2]), 9)[0][0, :7], run_target(
        target, FINAL_LAYER, rows.input_ids[2:3, :7])[0][0], rtol=1e-5, atol=1e-5)
    other = feature_key(base, target.dtype, (1, 2, 3), rows)  # other settings: every shard is stale
    assert other != key
    build_feature_cache(target, rows, (1, 2, 3), tmp_path, other, 2, accelerator)
    assert all(p.stat().st_mtime_ns != s for p, s in zip(shards[::2], stamps[::2]))


def _args(base: Path, out: Path, data: list[Path], extra: list[str]) -> list[str]:
    return ["train", "eagle", "--base", str(base), "--tokenizer", str(loading.testbed_dir() / "tokenizer"),
            "--data", *map(str, data), "--out", str(out), "--steps", "6", "--batch-size", "3", "--seq-len", "24",
            "--learning-rate", "3e-3", "--warmup-steps", "0", "--save-every", "100", *extra]


@pytest.mark.parametrize("version", ["eagle", "eagle3"])
def test_training_from_the_cache_follows_training_on_the_target(base, tmp_path, version):
    extra = ["--version", version, "--num-samples", "4", "--prompt-len", "12", "--ttt-steps", "2"]
    assert cli_main(_args(base, tmp_path / "cached", DATA, extra)) == 0
    assert any((tmp_path / "cached" / "target_features").iterdir())
    assert cli_main(_args(base, tmp_path / "direct", DATA, extra + ["--no-cache-features"])) == 0
    assert not (tmp_path / "direct" / "target_features").exists()
    cached, direct = (json.loads((tmp_path / name / "train_metrics.json").read_text())["loss_history"]
                      for name in ("cached", "direct"))
    assert cached == pytest.approx(direct, rel=1e-4)


def test_prompt_records_stop_at_eos_and_train_on_the_continuation(base, target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": ids}) for ids in ([5, 6, 7], [9, 10], [11, 12, 13, 14]))
                       + "\n")
    out = tmp_path / "out"
    # EOS (id 0) is the target's first choice somewhere in its continuations only by chance; max_new_tokens caps them
    assert cli_main(_args(base, out, [prompts], ["--prompt-records", "--num-samples", "3", "--max-new-tokens",
                                                 "10", "--steps", "2"])) == 0
    from safetensors.torch import load_file

    saved = load_file(out / GENERATED_FILE)
    rows = TrainingRows(**saved)
    assert len(rows.input_ids) == 3
    for row, length, start in zip(rows.input_ids, rows.lengths.tolist(), rows.starts.tolist()):
        prompt_len = next(len(p) for p in ([9, 10], [5, 6, 7], [11, 12, 13, 14]) if row[: len(p)].tolist() == p)
        assert start == prompt_len, "losses must count on the continuation only"
        new = row[prompt_len:length]
        with torch.no_grad():  # the continuation is the target's greedy choice after each real token
            greedy = target(row[None, :length]).logits[0, prompt_len - 1 : length - 1].argmax(-1)
        assert torch.equal(greedy, new)
        eos = (new == 0).nonzero()
        assert len(new) == 10 or (len(eos) == 1 and int(eos[0]) == len(new) - 1), "a row runs past its EOS"
        assert (row[length:] == 1).all()


def test_a_run_takes_the_answers_an_earlier_run_generated(base, target, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([5, 6, 7], [9, 10])))
    second.write_text(json.dumps({"input_ids": [11, 12, 13, 14]}) + "\n")
    options = ["--prompt-records", "--max-new-tokens", "10", "--steps", "1"]
    assert cli_main(_args(base, tmp_path / "a", [first], [*options, "--num-samples", "2"])) == 0
    earlier = tmp_path / "a" / GENERATED_FILE
    # mark the earlier answer to [5, 6, 7] (tokens the target never chose), so taking it shows
    saved = load_file(earlier)
    row = next(i for i, ids in enumerate(saved["input_ids"].tolist()) if ids[:3] == [5, 6, 7])
    saved["input_ids"][row, 3 : int(saved["lengths"][row])] = 77
    with safe_open(str(earlier), framework="pt") as stored:  # the settings the file was written with, kept
        metadata = stored.metadata()
    save_file(saved, str(earlier), metadata=metadata)
    capsys.readouterr()
    assert cli_main(_args(base, tmp_path / "b", [first, second],
                          [*options, "--num-samples", "3", "--reuse-generated", str(earlier)])) == 0
    assert "2 of 3 answers taken from" in capsys.readouterr().out
    rows = TrainingRows(**load_file(tmp_path / "b" / GENERATED_FILE))
    by_prompt = {tuple(r[:s].tolist()): r[s:n] for r, n, s in zip(rows.input_ids, rows.lengths, rows.starts.tolist())}
    assert (by_prompt[(5, 6, 7)] == 77).all(), "the earlier answer is taken"
    new = by_prompt[(11, 12, 13, 14)]
    with torch.no_grad():  # the new prompt's answer is generated: the target's greedy choices
        whole = torch.cat([torch.tensor([11, 12, 13, 14]), new])
        assert torch.equal(target(whole[None]).logits[0, 3:-1].argmax(-1), new)
    # where the answers came from is no setting of the run: it resumes with more (or fewer) files to reuse, as
    # train.sh's second call does once the first wrote its own answers file
    assert cli_main(_args(base, tmp_path / "b", [first, second],
                          [*options, "--num-samples", "3", "--reuse-generated", str(earlier),
                           str(tmp_path / "b" / GENERATED_FILE)])) == 0
    # answers generated with other settings, or sampled, are refused, naming what differs
    with pytest.raises(SystemExit, match=r"reuse_generated: .* other settings \(max_new_tokens=10, not 8\)"):
        cli_main(_args(base, tmp_path / "c", [first], ["--prompt-records", "--max-new-tokens", "8", "--steps", "1",
                                                       "--num-samples", "2", "--reuse-generated", str(earlier)]))
    with pytest.raises(SystemExit, match="reuse_generated: earlier answers are reused for greedy prompt records"):
        cli_main(_args(base, tmp_path / "c", [first], [*options, "--num-samples", "2", "--temperature", "1",
                                                       "--reuse-generated", str(earlier)]))


def _objective(method: str, target, base):
    """A fresh objective of each method for the tiny target."""
    from hf_specdec.training import draft_model, eagle, medusa, mlp_speculator

    torch.manual_seed(0)
    common = dict(base=base, data=DATA, out=base, batch_size=3, seq_len=9, prompt_len=4)
    if method in ("eagle", "eagle3"):
        extra = {"feature_layers": (1, 2, 3)} if method == "eagle3" else {}
        config = eagle.EagleTrainConfig(**common, version=method, noise=0.0, ttt_steps=2, **extra)
        return eagle.make_objective(config, target, _rows())
    if method == "medusa":
        return medusa.make_objective(medusa.MedusaTrainConfig(**common, num_heads=2), target, _rows())
    if method == "mlp_speculator":
        config = mlp_speculator.MlpSpeculatorTrainConfig(**common, n_predict=2)
        return mlp_speculator.make_objective(config, target, _rows())
    return draft_model.make_objective(draft_model.DraftTrainConfig(**common, target_layers=(0, -1)), target, _rows())


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa", "draft", "mlp_speculator"])
def test_padding_and_untrained_predictions_change_no_loss(base, target, method):
    from dataclasses import replace

    objective = _objective(method, target, base)
    rows = replace(_rows(), starts=torch.tensor([0, 2, 3, 4, 0]))
    index = torch.tensor([1, 2, 3])  # lengths 5, 7, 9 in a width of 9; trained from tokens 2, 3, 4 on
    batch = target_batch(target, rows, index, torch.device("cpu"), None, objective.feature_layers)

    def loss(batch) -> float:
        with torch.no_grad():
            return float(objective(batch, target)[0])

    before = loss(batch)
    pad = ~batch.real
    garbage = replace(batch, input_ids=torch.where(pad, 11, batch.input_ids),
                      features=batch.features + 5 * torch.randn_like(batch.features) * pad[..., None],
                      hidden=batch.hidden + 5 * torch.randn_like(batch.hidden) * pad[..., None],
                      argmax=torch.where(pad, 7, batch.argmax))
    if method == "eagle3":  # the target's outputs where the next token is not trained: labels nobody learns
        untrained = ~torch.nn.functional.pad(batch.trained[:, 1:], (0, 1), value=False)
        garbage = replace(garbage, hidden=garbage.hidden + 5 * torch.randn_like(batch.hidden) * untrained[..., None],
                          argmax=torch.where(untrained, 7, garbage.argmax))
    assert abs(loss(garbage) - before) <= 1e-5 * before
    inside = replace(batch, features=batch.features + 5 * torch.randn_like(batch.features) * batch.trained[..., None],
                     hidden=batch.hidden + 5 * torch.randn_like(batch.hidden) * batch.trained[..., None])
    assert abs(loss(inside) - before) > 1e-4 * before  # the control: real positions do count
