"""hf_specdec/training/data.py: the token stream every trainer reads, and its errors (a `DataError`, which the CLI
prints as one line)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from hf_specdec.testbed import loading
from hf_specdec.training.config import DataError
from hf_specdec.training.data import token_stream


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(loading.testbed_dir() / "tokenizer", local_files_only=True)


def test_text_and_jsonl_records_join_with_eos(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("def f():\n    return 1\n")
    (tmp_path / "b.jsonl").write_text('{"text": "x = 2"}\n\n{"input_ids": [5, 6, 7]}\n')
    stream = token_stream(tokenizer, [tmp_path / "a.txt", tmp_path / "b.jsonl"], 1, "Config.data")
    text = tokenizer("def f():\n    return 1\n", add_special_tokens=False)["input_ids"]
    record = tokenizer("x = 2", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    assert torch.equal(stream, torch.tensor([*text, eos, *record, eos, 5, 6, 7, eos]))


@pytest.mark.parametrize(("content", "name", "match"), [
    ("x", "short.txt", r"Config.data: 2 tokens in \[.*short.txt'\], need at least 50 for one training window"),
    ('{"text": "a"}\n{"txt": 1}\n', "bad.jsonl",
     r"Config.data: .*bad.jsonl line 2: expected a JSON object with a 'text' or an 'input_ids' field"),
    ('{"text": "a"}\n[1, 2]\n', "list.jsonl", r"list.jsonl line 2: expected a JSON object"),
    ('{"text": "a"}\n{oops\n', "broken.jsonl", r"Config.data: .*broken.jsonl line 2 is not JSON"),
])
def test_bad_data_is_a_data_error_naming_the_file_and_line(tokenizer, tmp_path, content, name, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=match):
        token_stream(tokenizer, [tmp_path / name], 50, "Config.data")
