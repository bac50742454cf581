"""The stdlib corpus split: deterministic, disjoint, tests excluded."""

import json
import sys
from pathlib import Path

import pytest

from hf_specdec.testbed.corpus import SplitConfig, list_source_files, split_corpus
from hf_specdec.testbed.loading import testbed_dir as find_testbed


def _touch(root: Path, relative: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x = 1\n")


def test_test_files_and_site_packages_are_excluded(tmp_path: Path) -> None:
    kept = ["os.py", "json/decoder.py", "lib2to3/fixes/fix_exec.py", "idlelib/editor.py"]
    dropped = [
        "test/test_os.py",
        "unittest/test/test_case.py",
        "lib2to3/tests/test_parser.py",
        "idlelib/idle_test/test_editor.py",
        "tkinter/test/support.py",
        "site-packages/pkg/mod.py",
        "json/__pycache__/decoder.py",
    ]
    for relative in kept + dropped:
        _touch(tmp_path, relative)
    (tmp_path / "README.txt").write_text("not python\n")
    assert list_source_files(tmp_path) == sorted(kept)


def test_split_is_deterministic_and_disjoint() -> None:
    first, second = split_corpus(), split_corpus()
    assert first.train == second.train and first.heldout == second.heldout
    assert not set(first.train) & set(first.heldout)
    assert sorted(first.train + first.heldout) == list_source_files(first.root)
    assert 0.03 < len(first.heldout) / (len(first.train) + len(first.heldout)) < 0.07
    assert all("test" not in Path(p).parts and "tests" not in Path(p).parts for p in first.train + first.heldout)


def test_seed_changes_the_split() -> None:
    assert split_corpus(SplitConfig(seed=0)).heldout != split_corpus(SplitConfig(seed=1)).heldout


def test_invalid_fraction_is_rejected() -> None:
    with pytest.raises(ValueError):
        SplitConfig(heldout_fraction=1.5)


def test_committed_manifest_matches_this_python() -> None:
    committed = json.loads((find_testbed() / "corpus_manifest.json").read_text())
    if committed["python_version"] != ".".join(map(str, sys.version_info[:3])):
        pytest.skip(f"manifest was written by Python {committed['python_version']}")
    assert split_corpus(SplitConfig(seed=committed["seed"])).manifest() == committed
