"""What a benchmark ran on: library versions, the git commit of this checkout, Python, platform, CPU and GPU,
torch threads and dtype, recorded next to its numbers so that they can be compared and reproduced."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
import transformers

import hf_specdec

CHECKOUT = Path(hf_specdec.__file__).resolve().parents[1]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options a benchmark script over Spec-Bench questions on the real model shares: how many questions of which
    categories, how long, how many rounds, threads, dtype, device, and where the JSON goes (`report_results`)."""
    parser.add_argument("--num-prompts", type=int, default=1, help="Spec-Bench questions per category")
    parser.add_argument("--categories", nargs="+", default=None, help="Spec-Bench categories (default: all six)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", help="where the target and drafters run (cuda on a GPU)")
    parser.add_argument("--json", type=Path)


def report_results(args: argparse.Namespace, results: list[dict[str, Any]], device: torch.device, dtype: torch.dtype,
                   **extra: Any) -> None:
    """A benchmark script's results, each printed as a JSON line, then written (`write_report`)."""
    for result in results:
        print(json.dumps(result, sort_keys=True))
    write_report(args, results, device, dtype, **extra)


def write_report(args: argparse.Namespace, results: list[dict[str, Any]], device: torch.device,
                 dtype: torch.dtype | None, **extra: Any) -> None:
    """With `--json` (`args.json`), a benchmark script's JSON: its settings (the parsed arguments), its results, the
    `environment` it ran in (`dtype` None: the script ran several) and any `extra` sections, keys sorted."""
    if args.json is None:
        return
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    report = {"settings": settings, "results": results, "environment": environment(device, dtype), **extra}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


def environment(device: torch.device, dtype: torch.dtype | None) -> dict[str, Any]:
    """The run's environment as JSON-ready values; None where a fact is unknown (no git checkout, no GPU, no single
    dtype)."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit is not None else None
    return {
        "hf_specdec": hf_specdec.__version__,
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),  # tracked files changed since the commit
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": _installed_version("triton"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
    }


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*arguments: str) -> str | None:
    """git's output in the checkout hf_specdec runs from; None outside a git checkout or without git."""
    if not (CHECKOUT / ".git").exists():
        return None
    try:
        result = subprocess.run(["git", "-C", str(CHECKOUT), *arguments], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None
