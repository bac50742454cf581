"""benchmarks/int8_linear.py: every shape, row count and dtype measured; bad shapes refused."""

from __future__ import annotations

import json

import pytest

from hf_specdec.kernels.int8_linear import int8_kernel_available

pytestmark = pytest.mark.skipif(not int8_kernel_available(), reason="this torch has no _weight_int8pack_mm")


def test_rows_cover_every_case(benchmark_script, tmp_path):
    out = tmp_path / "int8.json"
    rows = benchmark_script("int8_linear").main(["--dtype", "bfloat16", "float32", "--shapes", "32x8", "48x5",
                                                 "--rows", "1", "3", "--repeats", "1", "--calls", "1", "--json",
                                                 str(out)])
    assert [(r["dtype"], r["inner"], r["outer"], r["rows"]) for r in rows] == [
        (dtype, inner, outer, count) for dtype in ("bfloat16", "float32") for inner, outer in ((32, 8), (48, 5))
        for count in (1, 3)]
    assert all(r["float_ms"] > 0 and r["int8_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert json.loads(out.read_text())["results"] == rows


def test_an_inner_size_the_kernel_cannot_take_is_refused(benchmark_script):
    with pytest.raises(SystemExit):
        benchmark_script("int8_linear").main(["--shapes", "24x8"])
