"""`hf-specdec bench`: what its JSON records, that it writes nothing unasked, and how its plot is drawn."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch

from hf_specdec.cli.bench import Measurement, build_figure, summarize
from hf_specdec.cli.main import main
from hf_specdec.testbed.other_tokenizer import permuted

ENVIRONMENT_FIELDS = {"hf_specdec", "git_commit", "git_dirty", "torch", "transformers", "triton", "python", "platform",
                      "cpu", "gpu", "device", "torch_threads", "dtype"}
TINY = ["--batch-size", "1", "-k", "3", "--num-prompts", "1", "--max-new-tokens", "8", "--workload", "completion",
        "--threads", "1"]


def test_json_records_environment_settings_and_every_repeat(tmp_path):
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "ngram", *TINY, "--repeats", "3", "--json", str(out)]) == 0
    text = out.read_text()
    report = json.loads(text)
    assert text == json.dumps(report, indent=2, sort_keys=True) + "\n"  # sorted keys

    env = report["environment"]
    assert set(env) == ENVIRONMENT_FIELDS
    assert env["torch"] == torch.__version__ and env["dtype"] == "float32" and env["torch_threads"] == 1
    assert env["device"] == "cpu" and env["gpu"] is None and env["cpu"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert env["git_commit"] == (head or None)
    assert report["settings"] == {"num_processes": 1, "workload": "completion", "num_prompts": 1, "max_new_tokens": 8,
                                  "repeats": 3, "methods": ["plain", "ngram"], "batch_sizes": [1], "ks": [3],
                                  "tree_widths": [1], "schedules": ["adaptive"], "tree_nodes": None,
                                  "draft_quantizations": ["none"],
                                  "categories": ["completion"], "temperature": 0.0, "ignore_eos": False,
                                  "model": "test bed", "early_exit_layer": None}

    rows = {r["case"]: r for r in report["results"]}
    for row in rows.values():
        repeats = row["seconds_repeats"]
        assert len(repeats) == 3 and all(seconds > 0 for seconds in repeats)
        assert row["seconds_min"] == min(repeats) and row["seconds_median"] == sorted(repeats)[1]
        assert row["tokens_per_second"] == pytest.approx(row["new_tokens"] / row["seconds_median"])
    assert rows["plain"]["tokens_per_target_forward"] == pytest.approx(1.0)
    assert rows["plain"]["mean_acceptance_length"] is None
    ngram = rows["ngram"]
    assert 1.0 <= ngram["tokens_per_target_forward"] <= 4.0  # at most k + 1 = 4 tokens per forward
    # 1 + accepted / drafts, where acceptance per position is accepted at each position / drafts
    assert ngram["mean_acceptance_length"] == pytest.approx(1 + sum(ngram["acceptance_per_position"]))


def test_nothing_is_written_without_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--method", "plain", *TINY]) == 0
    assert list(tmp_path.iterdir()) == []
    assert "written" not in capsys.readouterr().out


def test_plot_needs_a_case_besides_plain(tmp_path):
    with pytest.raises(SystemExit, match="--plot draws speedups over plain"):
        main(["bench", "--method", "plain", "--plot", str(tmp_path / "plot.png")])
    assert not (tmp_path / "plot.png").exists()


def test_too_many_prompts_is_a_clear_error():
    with pytest.raises(SystemExit, match="9 prompts asked .* workload 'long' has 8"):
        main(["bench", "--method", "plain", "--workload", "long", "--num-prompts", "9"])


def row(case: str, batch_size: int, k: int | None, speedup: float, tree_width: int = 1, category: str = "edit",
        length: float | None = None) -> dict:
    return {"case": case, "batch_size": batch_size, "k": k, "tree_width": tree_width, "speedup_vs_plain": speedup,
            "category": category, "mean_acceptance_length": length}


def test_plot_has_integer_ticks_named_panels_and_its_legend_outside_the_axes():
    rows = [row("plain", b, None, 1.0) for b in (2, 4, 8)]
    rows += [row(case, b, k, 1.0 + 0.1 * b + 0.01 * k, w) for case in ("draft", "ngram") for b in (2, 4, 8)
             for k in (3, 4, 6) for w in (1, 2)]
    rows += [row("hf-lookup", 2, k, 1.1) for k in (3, 4, 6)]  # transformers' paths: the smallest batch only
    fig = build_figure(rows)
    fig.draw_without_rendering()  # lays the figure out (constrained layout) and formats the tick labels
    by_batch, by_k = fig.axes
    assert list(by_batch.get_xticks()) == [2, 4, 8] and list(by_k.get_xticks()) == [3, 4, 6]
    assert [t.get_text() for t in by_k.get_xticklabels()] == ["3", "4", "6"]
    assert by_batch.get_title() == "k = 3" and by_k.get_title() == "batch size 2"

    assert by_batch.get_legend() is None and by_k.get_legend() is None
    (legend,) = fig.legends
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels == ["draft", "draft (tree w=2)", "hf-lookup", "ngram", "ngram (tree w=2)", "plain generate"]
    box = legend.get_window_extent()
    for axis in fig.axes:
        assert not box.overlaps(axis.get_window_extent())


def test_plot_per_category_shows_each_case_at_its_best_setting():
    categories = ("qa", "math_reasoning", "overall")
    rows = [row("plain", b, None, 1.0, category=c) for b in (1, 4) for c in categories]
    for c_index, c in enumerate(categories):
        for b in (1, 4):
            rows += [row("ngram", b, k, 1.0 + 0.1 * k + 0.01 * c_index, category=c, length=1.5) for k in (3, 5)]
            rows += [row("eagle", b, 5, 2.0 + 0.1 * c_index, w, category=c, length=3.0 + w) for w in (1, 3)]
    fig = build_figure(rows)
    fig.draw_without_rendering()
    speed, length = fig.subfigs[0].axes
    assert [t.get_text() for t in speed.get_xticklabels()] == ["qa", "math_reasoning", "overall"]
    labels = [text.get_text() for text in fig.subfigs[0].legends[0].get_texts()]
    assert labels == ["eagle k=5", "ngram k=5"]  # each case once, at its best overall speedup (eagle ties: first)
    heights = [patch.get_height() for patch in speed.patches]
    assert heights[:3] == pytest.approx([2.0, 2.1, 2.2]) and heights[3:] == pytest.approx([1.5, 1.51, 1.52])
    assert [patch.get_height() for patch in length.patches] == pytest.approx([4.0] * 3 + [1.5] * 3)
    assert fig.subfigs[1].axes[0].get_title() == "k = 3"  # the sweep panels below read the overall rows


def test_plot_gives_every_case_its_own_colour_and_undrafted_cases_a_line():
    """Eleven cases and more: no two share a colour (matplotlib's default cycle has ten); a case without k (the
    engine drafting nothing) is a dotted line at its speedup, in the same colour as its bar above."""
    cases = [f"case{i:02d}" for i in range(11)]
    categories = ("qa", "math_reasoning", "overall")
    rows = [row("plain", b, None, 1.0, category=c) for b in (1, 4) for c in categories]
    rows += [row(case, b, 5, 1.0 + 0.05 * i, category=c, length=2.0) for i, case in enumerate(cases)
             for b in (1, 4) for c in categories]
    rows += [row("no-drafts", b, None, 1.1, category=c) for b in (1, 4) for c in categories]
    fig = build_figure(rows)
    fig.draw_without_rendering()
    speed = fig.subfigs[0].axes[0]
    colours = {tuple(patch.get_facecolor()) for patch in speed.patches}
    assert len(colours) == len(cases) + 1
    by_batch = fig.subfigs[1].axes[0]
    (line,) = [line for line in by_batch.get_lines() if line.get_label() == "no-drafts"]
    assert line.get_linestyle() == ":" and set(line.get_ydata()) == {1.1}
    (bars,) = [bars for bars in speed.containers if bars.get_label() == "no-drafts"]
    assert tuple(line.get_color()) == pytest.approx(tuple(bars.patches[0].get_facecolor()))


def test_plot_of_one_batch_size_and_k_per_category_has_no_sweep_panels():
    """Spec-Bench at one batch size and one k: the category panels only (a sweep of one point would draw the
    overall bars again as dots)."""
    categories = ("qa", "math_reasoning", "overall")
    rows = [row("plain", 1, None, 1.0, category=c) for c in categories]
    rows += [row(case, 1, 5, 1.2, w, category=c, length=2.0) for case in ("eagle", "ngram") for w in (1, 4)
             for c in categories]
    fig = build_figure(rows)
    fig.draw_without_rendering()
    assert not fig.subfigs and [axis.get_title() for axis in fig.axes] == ["speedup, batch size 1",
                                                                          "mean acceptance length, batch size 1"]
    assert tuple(fig.get_size_inches()) == (12, 4)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--model", "smollm2", "--target", "x"], "--model brings its own tokenizer and replaces --target"),
        (["--temperature", "-1"], "--temperature -1.0: expected 0"),
        (["--early-exit-layer", "0"], "--early-exit-layer 0: expected a layer >= 1"),
        (["--tree-nodes", "4", "0"], "--tree-nodes 4 0: expected node counts >= 1"),
        (["--tree-nodes", "big"], None),
        (["--categories", "qa"], "--categories is for --workload spec-bench, not 'completion'"),
        (["--model", "somewhere", "--method", "draft"], "--method draft with --model needs --draft"),
        (["--model", "somewhere", "--method", "eagle3"], "--method eagle3 with --model needs --eagle3-head"),
        (["--model", "somewhere", "--method", "hf-uag"], "--method hf-uag with --model needs --draft"),
        (["--method", "hf-uag", "--temperature", "0.7"], "--method hf-uag with --temperature 0.7: transformers' "),
        (["--batch-size", "1", "4"], r"--batch-size 4 with --num-prompts 1: each category has 1 prompt\(s\), so no "
                                     r"batch would hold 4 rows \(the row would measure batch 1\); pass --num-prompts 4"),
        (["--workload", "repeat", "--batch-size", "8"], r"--batch-size 8 with --num-prompts 1: the session holds 4 "
                                                        r"prompt\(s\).*pass --num-prompts 2 or more"),
    ],
)
def test_bad_options_are_refused_before_loading(argv, match, capsys):
    with pytest.raises(SystemExit, match=match):
        main(["bench", *TINY, *argv])
    if match is None:  # argparse's own refusal, on stderr
        assert "expected a node count or 'auto', got 'big'" in capsys.readouterr().err


def test_early_exit_and_sampling(tmp_path):
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "ngram", "hf-early-exit", *TINY, "--temperature", "0.7",
                 "--json", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["hf-early-exit"]["tokens_per_target_forward"] is None  # its drafts run the target's own layers
    assert rows["hf-early-exit"]["new_tokens"] > 0
    assert all(r["identical_to_plain"] is None for r in rows.values())  # sampling: not compared
    assert rows["ngram"]["speedup_vs_transformers"] is None  # hf-lookup did not run


def test_suffix_cases_start_every_pass_with_an_empty_cache(tmp_path, monkeypatch):
    """suffix, suffix+eagle and suffix+draft run on the test bed, exact; every pass (the instrumented one and each
    repeat) starts from an empty cache, so the repeats time what the instrumented pass counted."""
    from hf_specdec.suffix import SuffixCache

    cleared = []
    clear = SuffixCache.clear
    monkeypatch.setattr(SuffixCache, "clear", lambda cache: (cleared.append(cache), clear(cache)))
    out = tmp_path / "results.json"
    argv = ["bench", "--method", "suffix", "suffix+eagle", "suffix+draft", *TINY, "--repeats", "2", "--json", str(out)]
    assert main(argv) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"plain", "suffix", "suffix+eagle", "suffix+draft"}
    assert all(row["identical_to_plain"] for row in rows.values())
    assert len(cleared) == 3 * 3 and len(set(map(id, cleared))) == 3  # one cache per case, 1 + 2 passes each


def test_early_exit_beside_transformers_early_exit(tmp_path):
    """Both early-exit cases draft from the same layer and k; ours is compared with transformers' in one run and its
    draft forwards are timed apart from the target's."""
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "early_exit", "hf-early-exit", *TINY, "--early-exit-layer", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["early_exit_layer"] == 1
    rows = {r["case"]: r for r in report["results"]}
    ours = rows["early_exit"]
    assert ours["identical_to_plain"] is True and ours["speedup_vs_transformers"] is not None
    assert ours["draft_forward_ms"] is not None and ours["mean_acceptance_length"] >= 1
    with pytest.raises(SystemExit, match=r"--early-exit-layer 9: expected a layer from 1 to 5 \(the target has 6"):
        main(["bench", "--method", "early_exit", *TINY, "--early-exit-layer", "9"])


def test_mlp_speculator_case_loads_a_given_folder(tmp_path):
    from hf_specdec.heads import MlpSpeculator, MlpSpeculatorConfig
    from hf_specdec.testbed.loading import load_testbed

    _, target, _ = load_testbed()
    text = target.config.get_text_config(decoder=True)
    MlpSpeculator(MlpSpeculatorConfig(emb_dim=text.hidden_size, vocab_size=text.vocab_size, inner_dim=16)
                  ).save_pretrained(tmp_path / "speculator")
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "mlp_speculator", *TINY, "--mlp-speculator",
                 str(tmp_path / "speculator"), "--json", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["mlp_speculator"]["identical_to_plain"] is True
    assert rows["mlp_speculator"]["mean_acceptance_length"] is not None


def test_speedups_are_ratios_of_token_rates_so_a_shorter_output_earns_nothing():
    def measured(case: str, seconds: float, new_tokens: int) -> Measurement:
        return Measurement(case=case, batch_size=1, k=5, seconds=seconds, repeat_seconds=[seconds],
                           instrumented_seconds=seconds, calls=1, new_tokens=new_tokens, rows=1, target_forwards=10,
                           target_forward_seconds=seconds / 2)

    plain = measured("plain", 4.0, 100)  # 25 tokens/s
    # half the time for 60% of the tokens (a sampled or near-tie output that stopped early): 30 tokens/s
    row = summarize(measured("ngram", 2.0, 60), plain, native=measured("hf-lookup", 3.0, 120))
    assert row["tokens_per_second"] == pytest.approx(30.0)
    assert row["speedup_vs_plain"] == pytest.approx(1.2)
    assert row["speedup_vs_transformers"] == pytest.approx(0.75)  # against 40 tokens/s


def test_speedups_pair_the_rounds_so_a_slow_stretch_hits_both_sides():
    def measured(case: str, rounds: list[float]) -> Measurement:
        return Measurement(case=case, batch_size=1, k=5, seconds=sorted(rounds)[1], repeat_seconds=rounds,
                           instrumented_seconds=1.0, calls=1, new_tokens=100, rows=1, target_forwards=10,
                           target_forward_seconds=0.5)

    # round 2 ran on a slow stretch for plain and the method alike: twice as fast in rounds 1 and 3, 2.5x in
    # round 2 (the medians of each side alone, 2.0 s against 5.0 s, would read 0.4x)
    row = summarize(measured("ngram", [0.5, 4.0, 5.0]), measured("plain", [1.0, 10.0, 2.0]))
    assert row["speedup_vs_plain"] == pytest.approx(2.0)


def test_draft_under_another_tokenizer_beside_universal_assisted_generation(tmp_path, monkeypatch):
    """draft-xtok and hf-uag draft with the same permuted draft (built once), are exact, and ours is compared with
    transformers' in the vs-hf column."""
    from transformers.generation.candidate_generator import AssistedCandidateGeneratorDifferentTokenizers as Uag

    from hf_specdec.cli import bench
    from hf_specdec.proposers.cross_tokenizer import CrossTokenizerProposer

    built, calls = [], {"ours": 0, "transformers": 0}
    monkeypatch.setattr(bench, "permuted", lambda *a: built.append(a) or permuted(*a))

    def count(name: str, cls: type, method: str) -> None:
        original = getattr(cls, method)

        def counted(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, counted)

    count("ours", CrossTokenizerProposer, "propose")
    count("transformers", Uag, "get_candidates")
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "draft-xtok", "hf-uag", *TINY, "--json", str(out)]) == 0
    assert len(built) == 1 and calls["ours"] > 0 and calls["transformers"] > 0  # both re-tokenise across vocabularies
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"plain", "draft-xtok", "hf-uag"}
    assert all(row["identical_to_plain"] is True and row["new_tokens"] > 0 for row in rows.values())
    ours, theirs = rows["draft-xtok"], rows["hf-uag"]
    assert ours["speedup_vs_transformers"] == pytest.approx(ours["tokens_per_second"] / theirs["tokens_per_second"])
    assert ours["mean_acceptance_length"] >= 1 and ours["draft_forward_ms"] is not None
    assert theirs["draft_forward_ms"] is not None  # its assistant is the same draft, timed
    assert theirs["speedup_vs_transformers"] is None


def test_the_other_tokenizer_is_built_only_for_its_cases(monkeypatch):
    from hf_specdec.cli import bench

    monkeypatch.setattr(bench, "permuted", lambda *a: pytest.fail("built without a case that drafts with it"))
    assert main(["bench", "--method", "plain", "draft", *TINY]) == 0


def test_no_drafts_runs_the_engine_with_every_step_plain(tmp_path):
    """The engine's own speed beside plain generate's: no k of its own, no drafts, the same output."""
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "no-drafts", *TINY, "-k", "2", "3", "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r["case"] == "no-drafts"]
    assert len(rows) == 1 and rows[0]["k"] is None
    assert rows[0]["identical_to_plain"] and rows[0]["new_tokens"] > 0
    assert rows[0]["tokens_per_target_forward"] <= 1.0


def test_outputs_that_part_from_plain_are_near_ties_or_faults(tmp_path, monkeypatch, capsys):
    """An output that differs from plain generate's is looked into with plain's scores: where the token it took
    scored within `TIE_SPACINGS` of plain's best it is a near-tie ('tie', exit 0), else a fault ('NO', exit 1)."""
    import math

    import hf_specdec
    from hf_specdec import lossless as ties

    generate = hf_specdec.generate

    def last_token_changed(*args, **kwargs):  # the method's last token replaced by another
        out = generate(*args, **kwargs)
        out.sequences[:, -1] = (out.sequences[:, -1] + 1) % 100
        return out

    monkeypatch.setattr(hf_specdec, "generate", last_token_changed)
    out = tmp_path / "results.json"
    argv = ["bench", "--method", "plain", "ngram", *TINY, "--json", str(out)]
    assert main(argv) == 1
    row = {r["case"]: r for r in json.loads(out.read_text())["results"]}["ngram"]
    assert row["identical_to_plain"] is False and (row["faults"], row["near_ties"]) == (1, 0)
    printed = capsys.readouterr().out
    assert " NO " in printed and "MISMATCH: output rows that part from plain generate's where rounding does not " \
        "explain it: ngram 1" in printed
    monkeypatch.setattr(ties, "TIE_SPACINGS", math.inf)  # any gap is a near-tie now
    assert main(argv) == 0
    row = {r["case"]: r for r in json.loads(out.read_text())["results"]}["ngram"]
    assert row["identical_to_plain"] is False and (row["faults"], row["near_ties"]) == (0, 1)
    printed = capsys.readouterr().out
    assert " tie " in printed and "note: 1 output row parted from plain generate's, each at a near-tie" in printed



def test_json_is_written_after_each_group_so_a_stopped_run_keeps_what_it_measured(tmp_path, monkeypatch):
    out = tmp_path / "results.json"
    argv = ["bench", "--method", "plain", "ngram", *TINY, "--batch-size", "1", "2", "--num-prompts", "2",
            "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["complete"] is True and {r["batch_size"] for r in report["results"]} == {1, 2}
    assert not list(tmp_path.glob("*.tmp"))
    import hf_specdec.cli.bench as bench

    measure, calls = bench._measure, []

    def stops_in_the_second_group(case, category, batch_size, *rest):
        calls.append(batch_size)
        if batch_size == 2:
            raise KeyboardInterrupt  # the run is stopped there
        return measure(case, category, batch_size, *rest)

    monkeypatch.setattr(bench, "_measure", stops_in_the_second_group)
    out.unlink()
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    report = json.loads(out.read_text())
    assert report["complete"] is False and 2 in calls
    assert {(r["case"], r["batch_size"]) for r in report["results"]} == {("plain", 1), ("ngram", 1)}


def test_int8_drafters_run_beside_their_own_weights(tmp_path, capsys):
    """--draft-quantization none int8: each case drafting with a model twice, its int8 row named '@int8'; lookups
    once; in bfloat16 both match plain generate's output (up to near-ties)."""
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "ngram", "draft", "eagle", *TINY, "--dtype", "bfloat16",
                 "--draft-quantization", "none", "int8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["draft_quantizations"] == ["none", "int8"]
    rows = {(r["case"], r["draft_quantization"]): r for r in report["results"]}
    assert set(rows) == {("plain", None), ("ngram", None), ("draft", None), ("draft", "int8"), ("eagle", None),
                         ("eagle", "int8")}
    assert all(r["faults"] == 0 for r in rows.values())
    assert "draft@int8 (adaptive)" in capsys.readouterr().out


def test_tree_sizes_compare_in_one_run(tmp_path, capsys, monkeypatch):
    """--tree-nodes 3 6: each tree case once per size (a row each, named ' nN'), Medusa its fitted tree's first N
    paths, the draft an EAGLE-2 tree of N nodes, n-gram lookup its trie's best N; chains once; every output exact."""
    from hf_specdec import integration

    configs = []
    generate = integration.generate
    monkeypatch.setattr("hf_specdec.cli.bench.hf_specdec.generate",
                        lambda *args, speculative, **kw: (configs.append(speculative),
                                                          generate(*args, speculative=speculative, **kw))[1])
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "ngram", "draft", "medusa", *TINY, "--tree-width", "1", "2",
                 "--tree-nodes", "3", "6", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["tree_nodes"] == [3, 6]
    rows = {(r["case"], r["tree_width"], r["tree_nodes"]): r for r in report["results"]}
    assert set(rows) == {("plain", 1, None), ("ngram", 1, None), ("ngram", 2, 3), ("ngram", 2, 6), ("draft", 1, None),
                         ("draft", 2, 3), ("draft", 2, 6), ("medusa", 1, None), ("medusa", 2, 3), ("medusa", 2, 6)}
    assert all(r["identical_to_plain"] for r in rows.values())
    for method in ("draft", "ngram"):
        assert {c.tree_total_tokens for c in configs if c.method == method and c.tree_width > 1} == {3, 6}
    medusa_trees = {len(c.tree_paths) for c in configs if c.method == "medusa" and c.tree_paths is not None}
    assert medusa_trees == {3, 6}
    printed = capsys.readouterr().out
    assert "draft n=3 (adaptive)" in printed and "medusa n=6 (adaptive)" in printed
    assert rows[("draft", 2, 6)]["tree_nodes_used"] == 6 and rows[("draft", 1, None)]["tree_nodes_used"] is None


def test_auto_tree_size_runs_beside_fixed_sizes(tmp_path, capsys):
    """--tree-nodes 3 auto: the draft's tree sized from measured costs, its row naming the size it used; Medusa's
    static tree takes the count only."""
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "draft", "medusa", *TINY, "--tree-width", "2", "--tree-nodes", "3",
                 "auto", "--json", str(out)]) == 0
    rows = {(r["case"], r["tree_nodes"]): r for r in json.loads(out.read_text())["results"]
            if r["category"] != "overall"}
    assert set(rows) == {("plain", None), ("draft", 3), ("draft", "auto"), ("medusa", 3)}
    assert 3 <= rows[("draft", "auto")]["tree_nodes_used"] <= 2 + 2 * 4
    assert f"draft n=auto:{rows[('draft', 'auto')]['tree_nodes_used']} (adaptive)" in capsys.readouterr().out
    assert all(r["identical_to_plain"] for r in rows.values())


def test_ignore_eos_writes_every_prompt_to_its_length(tmp_path, monkeypatch):
    """With an EOS the target emits within the first tokens, sampled outputs stop early; --ignore-eos generates
    --max-new-tokens for every prompt and case, so token rates compare equal lengths."""
    from hf_specdec.cli import bench

    load = bench.load_models

    def early_eos(args, dtype, device):
        models = load(args, dtype, device)
        ids = models.tokenizer("def f(", return_tensors="pt").input_ids
        first = models.target.generate(ids, max_new_tokens=2, do_sample=False)[0, ids.shape[1]:]
        models.target.generation_config.eos_token_id = [int(token) for token in first]  # any of its first two
        return models

    monkeypatch.setattr(bench, "load_models", early_eos)
    new_tokens = {}
    for flag in ([], ["--ignore-eos"]):
        out = tmp_path / f"results{len(flag)}.json"
        argv = ["bench", "--method", "plain", "ngram", *TINY, "--max-new-tokens", "12", "--num-prompts", "3",
                "--temperature", "0.7", *flag, "--json", str(out)]
        assert main(argv) == 0
        report = json.loads(out.read_text())
        assert report["settings"]["ignore_eos"] == bool(flag)
        new_tokens[bool(flag)] = {r["case"]: r["new_tokens"] for r in report["results"]}
    assert new_tokens[True] == {"plain": 3 * 12, "ngram": 3 * 12}
    assert all(count < 3 * 12 for count in new_tokens[False].values())


def test_draft_parallel_drafts_with_the_parallel_draft_given(tmp_path, monkeypatch):
    """draft-parallel runs --parallel-draft with parallel_drafting (one draft forward per step), exactly, and
    auto+draft-parallel as auto's draft candidate; without the option both are refused with what to pass."""
    import shutil

    from hf_specdec.proposers.draft_model import DraftModelProposer
    from hf_specdec.testbed.loading import testbed_dir

    folder = tmp_path / "pard"
    shutil.copytree(testbed_dir() / "draft", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pard_token": 3}))
    parallel = []
    propose = DraftModelProposer._propose_parallel
    monkeypatch.setattr(DraftModelProposer, "_propose_parallel",
                        lambda self, *args: parallel.append(self.mask_token) or propose(self, *args))
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "draft-parallel", "auto+draft-parallel", "--parallel-draft",
                 str(folder), *TINY, "--json", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    for case in ("draft-parallel", "auto+draft-parallel"):
        assert rows[case]["identical_to_plain"] is True, case
        assert rows[case]["draft_forward_ms"] is not None, case  # its draft's forwards are timed
    assert parallel and set(parallel) == {3}
    for case in ("draft-parallel", "auto+draft-parallel"):
        with pytest.raises(SystemExit, match=re.escape(f"--method {case} needs --parallel-draft")):
            main(["bench", "--method", "plain", case, *TINY])


def test_recycling_cases_forget_the_table_before_every_pass(tmp_path, monkeypatch):
    """recycling (a tree of 3 nodes and one sized from the measured verify costs), auto+recycling and
    auto+eagle+recycling run on the test bed, exact; their configs
    list token recycling among auto's candidates (beside the EAGLE head's), and every pass of each (the
    instrumented one and each repeat) starts from an empty table of recycled tokens."""
    from hf_specdec import integration
    from hf_specdec.cli import runs

    configs, forgotten = [], []
    generate, forget = integration.generate, runs.forget_recycled_tokens
    monkeypatch.setattr("hf_specdec.cli.bench.hf_specdec.generate",
                        lambda *args, speculative, **kw: (configs.append(speculative),
                                                          generate(*args, speculative=speculative, **kw))[1])
    monkeypatch.setattr(runs, "forget_recycled_tokens", lambda target: (forgotten.append(1), forget(target)))
    out = tmp_path / "results.json"
    assert main(["bench", "--method", "plain", "recycling", "auto+recycling", "auto+eagle+recycling", *TINY,
                 "--tree-nodes", "3", "auto", "--repeats", "2", "--json", str(out)]) == 0
    rows = {(r["case"], r["tree_nodes"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("plain", None), ("recycling", 3), ("recycling", "auto"), ("auto+recycling", None),
                         ("auto+eagle+recycling", None)}
    assert rows[("recycling", 3)]["tree_nodes_used"] == 3 and rows[("recycling", "auto")]["tree_nodes_used"] >= 3
    assert all(row["identical_to_plain"] for row in rows.values())
    assert {c.auto_methods for c in configs if c.method == "auto"} == {("ngram", "suffix", "recycling"),
                                                                         ("ngram", "suffix", "recycling", "eagle")}
    assert len(forgotten) == 4 * 3  # four cases, 1 + 2 passes each


@pytest.mark.parametrize("methods, widths, match", [
    (["plain", "hf-lookup"], [1], "hf-lookup: transformers' assisted generation does not run"),
    (["ngram", "recycling"], [1], "drop --method recycling"),
    (["auto+recycling"], [1], "drop --method auto\\+recycling"),
    (["draft"], [1, 2], "--tree-width above 1"),
])
def test_cases_a_hybrid_target_cannot_take_are_refused_before_any_run(methods, widths, match):
    import argparse

    from hf_specdec.cli.bench import _check_cases_for
    from tests.cache.test_recurrent import make_hybrid

    target = make_hybrid("qwen3_next")
    with pytest.raises(SystemExit, match=match):
        _check_cases_for(argparse.Namespace(methods=methods, tree_widths=widths), target)
    _check_cases_for(argparse.Namespace(methods=["plain", "ngram", "suffix", "auto", "early_exit", "draft"],
                                        tree_widths=[1]), target)
