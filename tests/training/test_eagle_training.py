"""EAGLE head training: the loss goes down for both versions, generated data is cached, checkpoints resume, the
training-time-test mask is EAGLE-3's, the draft vocabulary keeps the most frequent ids, and 2 processes run."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_specdec.cli.main import main as cli_main
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.testbed import loading
from hf_specdec.training.config import GENERATED_FILE
from hf_specdec.training.eagle import EagleTrainConfig, build_draft_vocab, make_objective, ttt_attention_mask
from hf_specdec.training.generated import TrainingRows
from hf_specdec.training.target_features import target_batch
from tests.conftest import run_under_accelerate

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
    extra = ["--data-source", "text", *(["--draft-vocab-size", "1024"] if version == "eagle3" else
                                       ["--token-map-size", "300"])]
    assert main(_args(base, tmp_path, version, steps=20, extra=extra)) == 0
    history = _history(tmp_path)
    assert len(history) == 20
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - drop
    head = EagleHead.from_pretrained(tmp_path)
    assert head.config.version == version and head.config.vocab_size == 4096
    if version == "eagle3":
        assert head.config.draft_vocab_size == 1024 and int(head.t2d.sum()) == 1024
    else:  # EAGLE-1/2 drafts over the target's lm_head rows of the 300 most frequent trained tokens
        assert head.config.token_map_size == 300 and len(head.token_map) == 300


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


def _rows() -> TrainingRows:
    """Three rows of 12 tokens; rows 1 and 2 are trained from tokens 5 and 7 on, and row 2 ends at 10."""
    torch.manual_seed(0)
    return TrainingRows(torch.randint(2, 4096, (3, 12)), torch.tensor([12, 12, 10]), torch.tensor([0, 5, 7]))


def test_eagle_loss_is_the_heads_soft_cross_entropy_and_regression_on_trained_tokens(base):
    """EAGLE-1/2's objective against the head's own outputs, position by position: at t the head reads f_t and
    x_{t+1}, regresses f_{t+1} and matches the target's distribution after x_{t+1}, where x_{t+1} is trained."""
    target, rows = LlamaForCausalLM.from_pretrained(base).eval(), _rows()
    config = EagleTrainConfig(base=base, data=DATA, out=base, seq_len=12, prompt_len=4, version="eagle")
    objective = make_objective(config, target, rows).eval()  # eval: no noise on the features
    batch = target_batch(target, rows, torch.arange(3), torch.device("cpu"), None, objective.feature_layers)
    head, lm_head = objective.head, target.get_output_embeddings()
    with torch.no_grad():
        _, metrics = objective(batch, target)
        features = target.model(rows.input_ids).last_hidden_state  # [3, 12, H]: EAGLE-1/2's features
        embeds = target.get_input_embeddings()(rows.input_ids)
        hidden = head(embeds[:, 1:], features[:, :-1], torch.arange(1, 12).expand(3, -1), attention_mask=None)
        ce, regression = [], []
        for row in range(3):
            for t in range(11):
                if rows.starts[row] <= t + 1 < rows.lengths[row]:
                    target_probs = torch.softmax(lm_head(features[row, t + 1]).float(), -1)
                    ce.append(-(target_probs * torch.log_softmax(head.logits(hidden[row, t], lm_head), -1)).sum())
                    regression.append(torch.nn.functional.smooth_l1_loss(hidden[row, t], features[row, t + 1]))
    assert metrics["ce"] == pytest.approx(float(torch.stack(ce).mean()), rel=1e-5)
    assert metrics["regression"] == pytest.approx(float(torch.stack(regression).mean()), rel=1e-5)


def test_eagle_loss_with_a_token_map_is_over_the_map_where_the_target_top_token_is_in_it(base):
    """With a token map the head drafts over the map's ids only, and learns so: the soft cross-entropy is against the
    target's distribution restricted to the map, at positions whose target top token is in it; accuracy counts the
    other positions as missed; the regression still covers every trained position."""
    target, rows = LlamaForCausalLM.from_pretrained(base).eval(), _rows()
    config = EagleTrainConfig(base=base, data=DATA, out=base, seq_len=12, prompt_len=4, version="eagle")
    objective = make_objective(config, target, rows).eval()
    batch = target_batch(target, rows, torch.arange(3), torch.device("cpu"), None, objective.feature_layers)
    head, lm_head = objective.head, target.get_output_embeddings()
    top = batch.argmax  # [3, 12]: the target's top token after each position
    # a map holding the top tokens of half the trained positions, and 200 other ids
    trained_tops = sorted({int(top[row, t + 1]) for row in range(3) for t in range(11)
                           if rows.starts[row] <= t + 1 < rows.lengths[row]})
    kept = set(trained_tops[::2]) | set(range(2000, 2200))
    head.set_token_map(torch.tensor(sorted(kept)))
    with torch.no_grad():
        _, metrics = objective(batch, target)
        features = target.model(rows.input_ids).last_hidden_state
        embeds = target.get_input_embeddings()(rows.input_ids)
        hidden = head(embeds[:, 1:], features[:, :-1], torch.arange(1, 12).expand(3, -1), attention_mask=None)
        ids = head.token_map
        ce, hits, positions, outside = [], 0, 0, 0
        for row in range(3):
            for t in range(11):
                if not rows.starts[row] <= t + 1 < rows.lengths[row]:
                    continue
                positions += 1
                if int(top[row, t + 1]) not in kept:
                    outside += 1
                    continue
                target_probs = torch.softmax(lm_head(features[row, t + 1]).float()[ids], -1)
                draft_logits = lm_head(hidden[row, t]).float()[ids]
                ce.append(-(target_probs * torch.log_softmax(draft_logits, -1)).sum())
                hits += int(ids[draft_logits.argmax()] == top[row, t + 1])
    assert outside > 0 and len(ce) > 0, "the map should leave some trained positions' top tokens out"
    assert metrics["ce"] == pytest.approx(float(torch.stack(ce).mean()), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(hits / positions)


def test_eagle3_first_step_loss_is_the_soft_cross_entropy_over_the_draft_vocabulary(base):
    """EAGLE-3's first unrolled step against the head's own outputs, position by position: the target's distribution
    over the draft vocabulary after x_{t+1}, where x_{t+1} is trained and the target's top token is draftable."""
    target, rows = LlamaForCausalLM.from_pretrained(base).eval(), _rows()
    config = EagleTrainConfig(base=base, data=DATA, out=base, seq_len=12, prompt_len=4, version="eagle3",
                              ttt_steps=3, draft_vocab_size=64)
    objective = make_objective(config, target, rows).eval()
    batch = target_batch(target, rows, torch.arange(3), torch.device("cpu"), None, objective.feature_layers)
    head, width = objective.head, 12 - 3
    with torch.no_grad():
        out = target(rows.input_ids, output_hidden_states=True)
        # a draft vocabulary holding some of the target's top tokens here, not all: both kinds of position occur
        d2t, t2d = build_draft_vocab(out.logits.argmax(-1)[:, ::3].flatten(), 4096, 64)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        _, metrics = objective(batch, target)
        embeds = target.get_input_embeddings()(rows.input_ids)
        hidden = head(embeds[:, 1 : 1 + width], batch.features[:, :width], torch.arange(1, 1 + width).expand(3, -1),
                      ttt_attention_mask(width, 0, head.dtype).expand(3, -1, -1, -1), cache=DynamicCache())
        terms = []
        for row in range(3):
            for t in range(1, 1 + width):  # the head's output at index t - 1 guesses the token after x_t
                if rows.starts[row] <= t + 1 < rows.lengths[row] and head.t2d[out.logits[row, t].argmax()]:
                    target_probs = torch.softmax(out.logits[row, t][head.t2d].float(), -1)
                    logits = head.lm_head(head.norm(hidden[row, t - 1])).float()
                    terms.append(-(target_probs * torch.log_softmax(logits, -1)).sum())
    assert 5 < len(terms) < 18  # of the 18 positions with a trained token after them
    assert metrics["ce_steps"][0] == pytest.approx(float(torch.stack(terms).mean()), rel=1e-4)


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
    with pytest.raises(SystemExit, match="EagleTrainConfig.token_map_size: only for version 'eagle'"):
        main(_args(base, tmp_path, "eagle3", steps=1, extra=["--data-source", "text", "--token-map-size", "100"]))


def test_two_cpu_processes_under_accelerate(base, tmp_path):
    result = run_under_accelerate(["train", "eagle", *_args(base, tmp_path, "eagle3", steps=2,
                                                            extra=["--num-samples", "3", "--prompt-len", "24"])],
                                  tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_file(tmp_path / GENERATED_FILE)["input_ids"].shape == (3, 32)
    assert EagleHead.from_pretrained(tmp_path).config.version == "eagle3"
