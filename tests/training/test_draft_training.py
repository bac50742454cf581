"""Draft-model training: a draft cut from the target learns to imitate it (the KL goes down), its folder holds only
its own tensors (and its token map), it loads sharing the target's embeddings and lm_head (its rows at the map), and
speculation with it is lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.main import main
from hf_specdec.heads.token_map import TokenMapLMHead
from hf_specdec.proposers.draft_model import DraftModelProposer
from hf_specdec.pruned_draft import load_pruned_draft, save_pruned_draft
from hf_specdec.testbed import loading
from hf_specdec.training.draft_model import DraftTrainConfig, make_objective
from hf_specdec.training.generated import TrainingRows
from hf_specdec.training.target_features import target_batch
from tests.conftest import record_proposed_tokens
from tests.training.test_target_features import DATA, base  # noqa: F401  (base is a fixture)


def _train(base: Path, out: Path, steps: int, extra: list[str] = ()) -> Path:  # noqa: F811
    assert main(["train", "draft", "--base", str(base), "--tokenizer", str(loading.testbed_dir() / "tokenizer"),
                 "--data", *map(str, DATA), "--out", str(out), "--steps", str(steps), "--batch-size", "4", "--seq-len",
                 "32", "--num-samples", "8", "--prompt-len", "16", "--learning-rate", "3e-3", "--warmup-steps", "0",
                 "--target-layers", "0", "-1", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):  # noqa: F811
    return _train(base, tmp_path_factory.mktemp("draft"), steps=25)


def _objective(base: Path, **options):  # noqa: F811
    """The test bed's target, three rows of 12 random tokens trained from tokens 0, 5 and 7 on (row 2 ends at 10), and
    the draft objective of its layers 0 and -1 with `options`."""
    target = LlamaForCausalLM.from_pretrained(base).eval()
    config = DraftTrainConfig(base=base, data=DATA, out=base, seq_len=12, prompt_len=4, target_layers=[0, -1],
                              **options)
    torch.manual_seed(0)
    rows = TrainingRows(torch.randint(2, 4096, (3, 12)), torch.tensor([12, 12, 10]), torch.tensor([0, 5, 7]))
    return target, rows, make_objective(config, target, rows)


def _batch(target, rows: TrainingRows, objective):
    return target_batch(target, rows, torch.arange(3), torch.device("cpu"), None, objective.feature_layers)


def test_the_loss_is_the_kl_from_the_target_after_each_trained_token(base):  # noqa: F811
    """The objective against the draft's own logits, position by position: KL(target || draft) of the next-token
    distributions at t where x_{t+1} is trained (rows 1 and 2 are trained from tokens 5 and 7 on; row 2 ends at 10)."""
    target, rows, objective = _objective(base)
    batch = _batch(target, rows, objective)
    with torch.no_grad():
        loss, _ = objective(batch, target)
        log_target = torch.log_softmax(target(rows.input_ids).logits.float(), -1)
        log_draft = torch.log_softmax(objective.draft(rows.input_ids).logits.float(), -1)
        terms = [(log_target[row, t].exp() * (log_target[row, t] - log_draft[row, t])).sum()
                 for row in range(3) for t in range(11) if rows.starts[row] <= t + 1 < rows.lengths[row]]
    assert float(loss) > 0.01 and float(loss) == pytest.approx(float(torch.stack(terms).mean()), rel=1e-4)


@pytest.fixture(scope="module")
def trained_with_map(base, tmp_path_factory):  # noqa: F811
    return _train(base, tmp_path_factory.mktemp("draft_map"), steps=3, extra=["--token-map-size", "64"])


def test_with_a_token_map_the_kl_is_over_the_map_where_the_target_top_token_is_in_it(base):  # noqa: F811
    """KL(target || draft) of both next-token distributions restricted to the map (each renormalised over it), at
    positions whose next token is trained and whose target top token is in the map; accuracy counts the others as
    missed."""
    target, rows, objective = _objective(base)
    with torch.no_grad():
        top = target(rows.input_ids).logits.argmax(-1)  # [3, 12]
    trained = [(row, t) for row in range(3) for t in range(11) if rows.starts[row] <= t + 1 < rows.lengths[row]]
    tops = sorted({int(top[row, t]) for row, t in trained})
    kept = sorted(set(tops[::2]) | set(range(2000, 2100)))  # half the trained positions' top tokens, and others
    objective.token_map = torch.tensor(kept)
    batch = _batch(target, rows, objective)
    with torch.no_grad():
        loss, metrics = objective(batch, target)
        log_target = torch.log_softmax(target(rows.input_ids).logits.float()[..., kept], -1)
        log_draft = torch.log_softmax(objective.draft(rows.input_ids).logits.float()[..., kept], -1)
        inside = [(row, t) for row, t in trained if int(top[row, t]) in kept]
        terms = [(log_target[row, t].exp() * (log_target[row, t] - log_draft[row, t])).sum() for row, t in inside]
        hits = sum(kept[int(log_draft[row, t].argmax())] == int(top[row, t]) for row, t in inside)
    assert 0 < len(inside) < len(trained)
    assert float(loss) > 0.01 and float(loss) == pytest.approx(float(torch.stack(terms).mean()), rel=1e-4)
    assert metrics["accuracy"] == pytest.approx(hits / len(trained))


def test_a_draft_trained_with_a_token_map_saves_it_drafts_over_it_and_is_lossless(
        base, trained_with_map, tmp_path, monkeypatch):  # noqa: F811
    saved = load_file(trained_with_map / "model.safetensors")
    token_map = saved["token_map"]
    assert token_map.shape == (64,) and torch.equal(token_map, token_map.sort().values)
    assert json.loads((trained_with_map / "config.json").read_text())["pruned_draft"]["token_map_size"] == 64
    target = LlamaForCausalLM.from_pretrained(base).eval()
    draft = load_pruned_draft(trained_with_map, target)
    lm_head = draft.get_output_embeddings()
    assert isinstance(lm_head, TokenMapLMHead) and torch.equal(lm_head.ids, token_map)
    torch.testing.assert_close(lm_head.weight, target.get_output_embeddings().weight[token_map])
    ids = torch.tensor([[1, 1, 5, 9, 17, 5, 9], [3, 3, 8, 3, 3, 8, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=1)
    reference = target.generate(ids, **kwargs)
    proposals = record_proposed_tokens(monkeypatch, DraftModelProposer)
    for width in (1, 2):
        config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=3, tree_width=width,
                                   schedule="fixed")
        assert torch.equal(hf_specdec.generate(target, ids, speculative=config, **kwargs), reference)
    drafted = torch.cat(proposals)
    assert len(drafted) > 0 and bool(torch.isin(drafted, token_map).all()), "a token outside the map was drafted"
    with pytest.raises(ValueError, match="already drafts over a token map of its own"):
        hf_specdec.generate(target, ids, speculative=SpeculativeConfig(
            method="draft", draft_model=draft, draft_token_map=token_map[:8]), **kwargs)
    save_pruned_draft(draft, tmp_path)  # a loaded draft saves with its map
    assert torch.equal(load_file(tmp_path / "model.safetensors")["token_map"], token_map)
    assert isinstance(load_pruned_draft(tmp_path, target).get_output_embeddings(), TokenMapLMHead)


def test_the_kl_goes_down_and_the_folder_holds_only_the_drafts_own_tensors(trained):
    history = json.loads((trained / "train_metrics.json").read_text())["loss_history"]
    assert len(history) == 25 and sum(history[-5:]) / 5 < 0.8 * sum(history[:5]) / 5
    names = set(load_file(trained / "model.safetensors"))
    assert names and not names & {"model.embed_tokens.weight", "lm_head.weight"}
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"0", "1"}
    config = json.loads((trained / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["pruned_draft"]["target_layers"] == [0, 3]


def test_the_draft_loads_sharing_the_targets_modules_and_is_lossless(base, trained):  # noqa: F811
    target = LlamaForCausalLM.from_pretrained(base).eval()
    draft = load_pruned_draft(trained, target)
    assert draft.get_input_embeddings() is target.get_input_embeddings()
    assert draft.get_output_embeddings() is target.get_output_embeddings()
    saved = load_file(trained / "model.safetensors")
    torch.testing.assert_close(draft.model.layers[1].mlp.up_proj.weight.bfloat16(),
                               saved["model.layers.1.mlp.up_proj.weight"])
    # the fine-tuned layers differ from the target's own
    assert not torch.equal(draft.model.layers[1].mlp.up_proj.weight.bfloat16(),
                           target.model.layers[3].mlp.up_proj.weight.bfloat16())
    ids = torch.tensor([[1, 1, 5, 9, 17, 5, 9], [3, 3, 8, 3, 3, 8, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=1)
    reference = target.generate(ids, **kwargs)
    for width in (1, 2):
        config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=3, tree_width=width)
        assert torch.equal(hf_specdec.generate(target, ids, speculative=config, **kwargs), reference)


def test_a_draft_for_another_model_or_a_damaged_folder_is_refused(base, trained, tmp_path):  # noqa: F811
    from transformers import LlamaConfig

    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4))
    with pytest.raises(ValueError, match="trained for another model"):
        load_pruned_draft(trained, other)
    target = LlamaForCausalLM.from_pretrained(base)
    with pytest.raises(ValueError, match="no such folder"):
        load_pruned_draft(tmp_path / "nowhere", target)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((trained / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((trained / "model.safetensors").read_bytes()[:64])
    with pytest.raises(ValueError, match="model.safetensors is missing or damaged"):
        load_pruned_draft(broken, target)
    bad_map = tmp_path / "bad_map"
    bad_map.mkdir()
    (bad_map / "config.json").write_text((trained / "config.json").read_text())
    weights = load_file(trained / "model.safetensors")
    from safetensors.torch import save_file
    save_file({**weights, "token_map": torch.tensor([3, 3, 9000])}, str(bad_map / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: token_map: token ids must lie in \[0, 4096\)"):
        load_pruned_draft(bad_map, target)
    with pytest.raises(SystemExit, match="DraftTrainConfig.token_map_size: expected >= 1, got 0"):
        main(["train", "draft", "--base", str(base), "--data", *map(str, DATA), "--out", str(tmp_path / "x"),
              "--token-map-size", "0", "--steps", "1"])
    with pytest.raises(SystemExit, match="target_layers: expected distinct increasing layer indices"):
        main(["train", "draft", "--base", str(base), "--data", *map(str, DATA), "--out", str(tmp_path / "x"),
              "--target-layers", "2", "1", "--steps", "1"])


def test_the_parallel_loss_is_the_kl_after_the_text_and_masks_a_drafting_step_feeds(base):  # noqa: F811
    """With parallel_tokens N, the loss is the mean of KL(target at j || draft after x_0 .. x_{j-i} and i mask
    tokens) over offsets i < N and trained positions j >= i: what one forward over the text and its mask copies
    computes equals fresh forwards over each chain, as parallel drafting feeds it."""
    pard = 3
    target, rows, objective = _objective(base, parallel_tokens=3, pard_token=pard)
    batch = _batch(target, rows, objective)
    with torch.no_grad():
        loss, metrics = objective(batch, target)
        log_target = torch.log_softmax(target(rows.input_ids).logits.float(), -1)
        terms = []
        for row in range(3):
            for j in range(11):
                if not rows.starts[row] <= j + 1 < rows.lengths[row]:
                    continue
                for ahead in range(3):
                    if j - ahead < 0:
                        continue
                    chain = torch.cat([rows.input_ids[row, : j - ahead + 1], torch.full((ahead,), pard)])[None]
                    log_draft = torch.log_softmax(objective.draft(chain).logits[0, -1].float(), -1)
                    terms.append((log_target[row, j].exp() * (log_target[row, j] - log_draft)).sum())
    assert float(loss) > 0.01 and float(loss) == pytest.approx(float(torch.stack(terms).mean()), rel=1e-4)
    assert {"accuracy", "accuracy_2", "accuracy_3"} <= set(metrics)


def test_a_draft_adapted_to_parallel_drafting_saves_its_mask_token_and_drafts_losslessly(
        base, trained, tmp_path):  # noqa: F811
    adapted = _train(base, tmp_path / "pard", steps=3,
                     extra=["--parallel-tokens", "3", "--pard-token", "3", "--init-draft", str(trained)])
    assert json.loads((adapted / "config.json").read_text())["pard_token"] == 3
    target = LlamaForCausalLM.from_pretrained(base).eval()
    draft = load_pruned_draft(adapted, target)
    ids = torch.tensor([[1, 1, 5, 9, 17, 5, 9], [3, 3, 8, 3, 3, 8, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=1)
    config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=3, parallel_drafting=True)
    assert torch.equal(hf_specdec.generate(target, ids, speculative=config, **kwargs), target.generate(ids, **kwargs))
    with pytest.raises(ValueError, match="pard_token: the mask token id parallel drafting feeds; give it exactly"):
        DraftTrainConfig(base=base, data=DATA, out=base, parallel_tokens=3)
    with pytest.raises(ValueError, match=r"init_draft: the draft in .* was cut from the target's layers \[0, 3\], not "
                                         r"target_layers \[0, 1\]; pass those layers"):
        make_objective(DraftTrainConfig(base=base, data=DATA, out=base, target_layers=[0, 1], init_draft=str(trained)),
                       target, None)
