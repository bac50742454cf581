"""The test-bed corpus: the Python standard library's own source, split by file.

Test suites and third-party packages are excluded. The split assigns whole
files to ``train`` or ``heldout`` with a seeded shuffle of the sorted relative
paths, so it is deterministic for a given Python version. A manifest records
the Python version, the file counts and a content hash of the split.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_COMPONENTS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


def stdlib_root() -> Path:
    """Return the directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(relative_path: Path) -> bool:
    """Whether a path (relative to the stdlib root) belongs to tests or site-packages."""
    return any(part in EXCLUDED_COMPONENTS for part in relative_path.parts)


def list_source_files(root: Path) -> list[str]:
    """Sorted POSIX-style relative paths of the non-test ``.py`` files under ``root``."""
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in EXCLUDED_COMPONENTS]
        for name in files:
            relative = (Path(directory) / name).relative_to(root)
            if name.endswith(".py") and not is_excluded(relative):
                found.append(relative.as_posix())
    return sorted(found)


def read_source(root: Path, relative_path: str) -> str:
    """Read one source file as UTF-8 (undecodable bytes replaced, newlines kept)."""
    return (root / relative_path).read_bytes().decode("utf-8", errors="replace")


@dataclass(frozen=True)
class SplitConfig:
    """How to split the corpus: the shuffle seed and the held-out fraction."""

    seed: int = 0
    heldout_fraction: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


@dataclass(frozen=True)
class CorpusSplit:
    """Relative paths of the train and held-out files under ``root``."""

    root: Path
    train: tuple[str, ...]
    heldout: tuple[str, ...]
    config: SplitConfig

    def texts(self, part: str) -> list[str]:
        """The file contents of ``part`` (``"train"`` or ``"heldout"``), in split order."""
        if part not in ("train", "heldout"):
            raise ValueError(f"part must be 'train' or 'heldout', got {part!r}")
        return [read_source(self.root, p) for p in getattr(self, part)]

    def content_hash(self) -> str:
        """SHA-256 over each file's part, path and content hash."""
        digest = hashlib.sha256()
        for part in ("train", "heldout"):
            for path in getattr(self, part):
                file_hash = hashlib.sha256((self.root / path).read_bytes()).hexdigest()
                digest.update(f"{part}\t{path}\t{file_hash}\n".encode())
        return digest.hexdigest()

    def manifest(self) -> dict[str, object]:
        """A JSON-ready description of the split."""
        return {
            "python_version": ".".join(map(str, sys.version_info[:3])),
            "seed": self.config.seed,
            "heldout_fraction": self.config.heldout_fraction,
            "num_train_files": len(self.train),
            "num_heldout_files": len(self.heldout),
            "content_sha256": self.content_hash(),
            "heldout_files": list(self.heldout),
        }

    def write_manifest(self, path: Path) -> None:
        """Write :meth:`manifest` as sorted-key JSON."""
        path.write_text(json.dumps(self.manifest(), indent=2, sort_keys=True) + "\n")


def split_corpus(config: SplitConfig = SplitConfig(), root: Path | None = None) -> CorpusSplit:
    """Split the stdlib source files into train and held-out parts, deterministically."""
    root = stdlib_root() if root is None else root
    files = list_source_files(root)
    if len(files) < 2:
        raise FileNotFoundError(f"fewer than two source files found under {root}")
    shuffled = list(files)
    random.Random(config.seed).shuffle(shuffled)
    num_heldout = max(1, round(len(files) * config.heldout_fraction))
    heldout = set(shuffled[:num_heldout])
    return CorpusSplit(
        root=root,
        train=tuple(p for p in files if p not in heldout),
        heldout=tuple(p for p in files if p in heldout),
        config=config,
    )
