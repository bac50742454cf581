"""The `hf-specdec` command line: arguments, clear errors on bad paths, bench output, and 2-process accelerate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_specdec.cli.main import build_parser, main
from tests.conftest import run_under_accelerate


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> Path:
    """A tiny target and draft with the test bed's vocabulary, saved as model folders."""
    folder = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    for name, hidden, layers in (("target", 32, 2), ("draft", 16, 1)):
        config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, pad_token_id=1,
                             eos_token_id=0, bos_token_id=0)
        LlamaForCausalLM(config).save_pretrained(folder / name)
    return folder


def test_help_explains_every_option(capsys):
    for command in ("demo", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        for action in build_parser()._subparsers._group_actions[0].choices[command]._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{command} {action.option_strings} has no help"
                assert action.option_strings[0] in text


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no model at .*nowhere"):
        main(["bench", "--target", str(tmp_path / "nowhere"), "--method", "plain", "--json", str(tmp_path / "r.json")])


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_a_model_name_that_is_neither_folder_nor_hub_id_is_one_error_line(tmp_path, command):
    with pytest.raises(SystemExit, match=r"^error: name='.*nowhere': no such folder, and not a Hub id"):
        main([command, "--model", str(tmp_path / "nowhere")])


def test_bad_numbers_are_clear_errors(tmp_path, tiny_models):
    with pytest.raises(SystemExit, match="--batch-size values must be >= 1"):
        main(["bench", "--target", str(tiny_models / "target"), "--batch-size", "0"])
    with pytest.raises(SystemExit, match="--tree-width values must be >= 1"):
        main(["bench", "--target", str(tiny_models / "target"), "--tree-width", "0"])
    with pytest.raises(SystemExit, match=r"--threads 0: expected 1 or more"):
        main(["bench", "--target", str(tiny_models / "target"), "--threads", "0"])
    with pytest.raises(SystemExit):
        main(["bench", "--method", "lookahead"])  # argparse: invalid choice
    with pytest.raises(SystemExit, match="no medusa heads at"):
        main(["bench", "--target", str(tiny_models / "target"), "--method", "medusa", "--heads", str(tmp_path)])
    with pytest.raises(SystemExit, match="--method medusa with --target needs --heads"):
        main(["bench", "--target", str(tiny_models / "target"), "--method", "medusa"])
    with pytest.raises(SystemExit, match="--method eagle3 with --target needs --eagle3-head"):
        main(["bench", "--target", str(tiny_models / "target"), "--method", "eagle3"])


def test_bench_medusa_uses_the_committed_heads_on_the_test_bed(tmp_path):
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "medusa", "--batch-size", "1", "-k", "3", "--tree-width", "1", "2",
                 "--num-prompts", "1", "--max-new-tokens", "8", "--workload", "completion", "--json", str(out)]) == 0
    rows = {(r["case"], r["tree_width"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("plain", 1), ("medusa", 1), ("medusa", 2)}
    assert all(r["identical_to_plain"] for r in rows.values())


def test_bench_eagle_uses_the_committed_heads_on_the_test_bed(tmp_path):
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "eagle", "eagle3", "auto+eagle", "auto+medusa", "--batch-size", "1",
                 "-k", "3", "--tree-width", "1", "2", "--num-prompts", "1", "--max-new-tokens", "8", "--workload",
                 "completion", "--json", str(out)]) == 0
    rows = {(r["case"], r["tree_width"]): r for r in json.loads(out.read_text())["results"]}
    # auto with an EAGLE head drafts the head's dynamic tree too; Medusa heads under auto draft chains
    assert set(rows) == {("plain", 1), ("eagle", 1), ("eagle", 2), ("eagle3", 1), ("eagle3", 2), ("auto+eagle", 1),
                         ("auto+eagle", 2), ("auto+medusa", 1)}
    assert all(r["identical_to_plain"] for r in rows.values())


def test_bench_writes_table_json_and_plot(tmp_path, tiny_models, capsys):
    from hf_specdec.heads import MedusaConfig, MedusaHeads

    MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=4096, num_heads=4)).save_pretrained(tmp_path / "heads")
    out = tmp_path / "results.json"
    code = main(["bench", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--heads", str(tmp_path / "heads"),
                 "--batch-size", "1", "2", "-k", "2", "3", "--tree-width", "1", "2", "--num-prompts", "2",
                 "--max-new-tokens", "6",
                 "--json", str(out), "--plot", str(tmp_path / "plot.png")])
    assert code == 0
    report = json.loads(out.read_text())
    cases = {(r["case"], r["batch_size"], r["k"], r["tree_width"]) for r in report["results"]}
    assert ("plain", 2, None, 1) in cases and ("draft", 2, 3, 2) in cases and ("hf-lookup", 1, 2, 1) in cases
    assert ("ngram", 1, 2, 2) in cases and ("hf-lookup", 1, 2, 2) not in cases
    assert ("medusa", 2, 3, 1) in cases and ("medusa", 1, 2, 2) in cases
    assert ("hf-assistant", 2, 2, 1) not in cases  # transformers' own paths only run at batch 1
    assert all(r["identical_to_plain"] for r in report["results"])
    assert (tmp_path / "plot.png").stat().st_size > 1000
    assert "acceptance per position" in capsys.readouterr().out


def test_bench_times_every_case_in_each_round(tmp_path, tiny_models, monkeypatch):
    from hf_specdec.cli import bench

    calls = []
    interleaved = bench.time_interleaved

    def spy(runs, repeats):
        calls.append((list(runs), repeats))
        return interleaved(runs, repeats)

    monkeypatch.setattr(bench, "time_interleaved", spy)
    out = tmp_path / "results.json"
    assert main(["bench", "--target", str(tiny_models / "target"), "--method", "plain", "ngram", "--batch-size", "1",
                 "2", "-k", "2", "3", "--num-prompts", "2", "--max-new-tokens", "4", "--repeats", "3",
                 "--json", str(out)]) == 0
    assert [len(runs) for runs, _ in calls] == [3, 3] and all(repeats == 3 for _, repeats in calls)
    assert all(len(r["seconds_repeats"]) == 3 for r in json.loads(out.read_text())["results"])


def test_accelerate_two_cpu_processes_split_and_gather(tmp_path, tiny_models):
    out = tmp_path / "results.json"
    result = run_under_accelerate(["bench", "--target", str(tiny_models / "target"), "--draft",
                                   str(tiny_models / "draft"), "--method", "plain", "draft", "ngram", "--batch-size",
                                   "1", "--num-prompts", "4", "--max-new-tokens", "4", "--json", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["num_processes"] == 2
    plain = next(r for r in report["results"] if r["case"] == "plain")
    assert plain["new_tokens"] == 4 * 4  # both processes' prompts were gathered
    assert all(r["identical_to_plain"] for r in report["results"])


def test_demo_runs_on_the_committed_test_bed(capsys):
    torch.set_num_threads(2)
    assert main(["demo", "--testbed", "--num-prompts", "2", "--max-new-tokens", "6", "-k", "3", "--repeats", "2",
                 "--methods", "all"]) == 0
    assert torch.get_num_threads() == 1  # pinned by default
    text = capsys.readouterr().out
    for method in ("plain", "draft", "draft-tree", "ngram", "ngram-tree", "suffix", "medusa", "medusa-tree", "eagle",
                   "eagle-tree", "eagle3"):
        assert f"  {method} " in text
    assert "How to read the tables" in text and "mean acceptance length" in text
    assert text.count("why: speculation") == 2  # one per workload
    assert "All outputs identical to plain generate." in text
