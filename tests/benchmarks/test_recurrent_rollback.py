"""benchmarks/recurrent_rollback.py: a smoke run on a tiny hybrid writes a row per batch size and setting, and puts
the rollback's methods back (no speed is asserted)."""

from __future__ import annotations

import json

from hf_specdec.cache import recurrent


def test_smoke_run_writes_every_setting_and_restores_the_rollback(benchmark_script, tmp_path):
    begin, commit = recurrent.RecurrentRollback.begin, recurrent.RecurrentRollback.commit
    out = tmp_path / "rollback.json"
    benchmark_script("recurrent_rollback").main([
        "--smoke", "--batch-sizes", "1", "2", "--max-pending", "0", "8", "--calls", "1", "--max-new-tokens", "6",
        "--repeats", "1", "--dtype", "float32", "--output", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch_size"], row["max_pending_tokens"]) for row in rows] == [(1, 0), (1, 8), (2, 0), (2, 8)]
    # a random draft is rejected at every step: every step that drafted rolled back
    assert all(row["steps_with_draft"] > 0 and row["rollback_at_commit_s_median"] > 0 for row in rows)
    assert recurrent.RecurrentRollback.begin is begin and recurrent.RecurrentRollback.commit is commit
    assert recurrent.MAX_PENDING_TOKENS == 8
