"""Head adapter folders, PEFT-style: what every draft head shares, for any head, without importing one.

Our folder: `adapter_config.json` (the head's config values plus `method`, its adapter type, `task_type` and
`library_version`; sorted keys) and `adapter_model.safetensors` (the head's state dict). Loading warns about
unknown config keys and drops them, so a folder written by a newer version still loads; a missing or damaged file is
named in the error. A head is found by a local folder or a Hub repo id (downloaded, or read from the cache when
offline); a path that looks local never reaches the Hub.

`AdapterMixin` gives a head class `save_pretrained`, `from_pretrained`, `push_to_hub` and `model_card` once it declares
its config class, adapter type names and card template. Published layouts of a head (other projects' checkpoints)
are read by the converter it names (`read_published`), which returns the same `HeadFiles` as our folder does:
a head is always built in one place (`from_files`), where every parameter must be present and none unrecognised.
Each head registers its adapter types on import (`register_head`); a type belongs to one class.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from huggingface_hub import HfApi, ModelCard, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import hf_specdec

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
TASK_TYPE = "CAUSAL_LM"
# keys our adapter_config.json holds beside the head's config values
_ADAPTER_KEYS = ("method", "task_type", "library_version")
LIBRARY_TAG = "hf-specdec"

_HEADS: dict[str, type] = {}


def register_head(cls: type) -> type:
    """Record `cls` as the head that loads folders of its `adapter_types`; a type another class holds is refused."""
    for adapter_type in cls.adapter_types:
        owner = _HEADS.get(adapter_type)
        if owner is not None and owner is not cls:
            raise ValueError(f"register_head: adapter type {adapter_type!r} is already registered by {owner.__name__}")
    _HEADS.update(dict.fromkeys(cls.adapter_types, cls))
    return cls


def registered_head(adapter_type: str) -> type | None:
    """The head class registered for `adapter_type`, or None."""
    return _HEADS.get(adapter_type)


@dataclass(frozen=True)
class HeadFiles:
    """A head folder read into memory, in our terms: what `AdapterMixin.from_files` builds a head from."""

    folder: Path
    # the layout, as errors name it (e.g. "SafeAILab EAGLE-3")
    layout: str
    # the file the config came from, as errors name it
    config_name: str
    # an instance of the head's config class
    config: Any
    # by our parameter names
    tensors: dict[str, torch.Tensor]


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(path))


def write_adapter(folder: str | Path, adapter_type: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Our adapter folder: `config` plus the adapter type (`method`), task type and library version, and the
    tensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / CONFIG_NAME, config | {"method": adapter_type, "task_type": TASK_TYPE,
                                               "library_version": hf_specdec.__version__})
    write_safetensors(folder / WEIGHTS_NAME, tensors)


def read_adapter(
    folder: Path, adapter_types: tuple[str, ...], config_fields: tuple[str, ...]
) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """Our adapter folder: its adapter type (one of `adapter_types`), the values of `config_fields` it holds, and its
    tensors. Unknown config keys are warned about and dropped."""
    raw = read_json(folder / CONFIG_NAME)
    adapter_type = raw.get("method")
    if adapter_type not in adapter_types:
        expected = " or ".join(repr(t) for t in adapter_types)
        owner = registered_head(adapter_type) if isinstance(adapter_type, str) else None
        hint = f"; it holds {owner.__name__}: load it with {owner.__name__}.from_pretrained" if owner else ""
        raise ValueError(f"{folder / CONFIG_NAME}: method {adapter_type!r} is not {expected}{hint}")
    unknown = sorted(set(raw) - set(config_fields) - set(_ADAPTER_KEYS))
    if unknown:
        warnings.warn(f"{folder / CONFIG_NAME}: ignoring unknown keys {unknown}", stacklevel=4)
    return adapter_type, {k: raw[k] for k in config_fields if k in raw}, read_safetensors(folder / WEIGHTS_NAME)


def read_json(path: Path) -> dict:
    """A JSON object from `path`; a missing or damaged file is named in the error."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error}); the file is damaged: save or download it again") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a missing, truncated or damaged file is named in the error."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file (the folder is incomplete: save or download it again)")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot be read as safetensors ({error}); the file is damaged or incomplete: "
                         "save or download it again") from error


def read_weights(folder: Path, stem: str, pickle_name: str | None = None) -> dict[str, torch.Tensor]:
    """`{stem}.safetensors`, else the pickle `pickle_name` (default `{stem}.pt`), loaded with weights_only=True (as
    published checkpoints may ship them)."""
    pickled = pickle_name or f"{stem}.pt"
    if (folder / f"{stem}.safetensors").is_file():
        return read_safetensors(folder / f"{stem}.safetensors")
    if (folder / pickled).is_file():
        try:
            return torch.load(folder / pickled, map_location="cpu", weights_only=True)
        except Exception as error:  # a truncated zip, a pickle with objects weights_only refuses, ...
            raise ValueError(f"{folder / pickled}: cannot be read as a weights file ({error}); it may be damaged or "
                             "incomplete: download or save it again") from error
    raise ValueError(f"{folder}: no {stem}.safetensors or {pickled}")


def resolve_folder(path_or_repo_id: str | Path, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id, downloaded (or read from the cache when offline)."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_repo_id)
    if path.exists():
        raise ValueError(f"{text!r} is a file; pass the folder that holds it")
    looks_local = isinstance(path_or_repo_id, Path) or text.startswith((".", "/", "~", "\\")) or text.count("/") != 1
    if looks_local:
        raise ValueError(f"no such folder: {text!r} (and it is not a Hub repo id, which reads 'owner/name')")
    try:
        return Path(snapshot_download(text, revision=revision))
    except HFValidationError as error:
        raise ValueError(f"no such folder: {text!r}, and not a valid Hub repo id ({error})") from error
    except LocalEntryNotFoundError as error:
        raise ValueError(
            f"{text!r}: no such local folder, and the Hub repo is not in the local cache (offline, or unreachable); "
            "pass a local folder or download it first"
        ) from error
    except RepositoryNotFoundError as error:
        raise ValueError(f"{text!r}: no such local folder, and no such Hub repo (or it is private: log in)") from error


def render_card(
    template: Traversable,
    repo_id: str,
    base_model: str | None,
    tags: list[str],
    measured: dict[str, float] | None = None,
    **fields,
) -> ModelCard:
    """The card from `template`: metadata (library, base model, tags, pipeline), the repo id, the measured numbers
    when known (else "Not measured yet."), and the template's own `fields`."""
    metadata = {"library_name": LIBRARY_TAG, "pipeline_tag": "text-generation",
                "tags": ["speculative-decoding", *tags, LIBRARY_TAG]}
    if base_model:
        metadata["base_model"] = base_model
    metadata_lines = "\n".join(
        f"{key}: {value}" if not isinstance(value, list) else f"{key}:\n" + "\n".join(f"- {v}" for v in value)
        for key, value in sorted(metadata.items())
    )
    rows = "\n".join(f"| {name} | {value:.3g} |" for name, value in sorted((measured or {}).items()))
    text = template.read_text(encoding="utf-8").format(
        metadata=metadata_lines, base_model=base_model or "an unnamed base model", repo_id=repo_id,
        measured=f"| metric | value |\n|---|---|\n{rows}" if rows else "Not measured yet.", **fields,
    )
    return ModelCard(text)


def push_folder(
    repo_id: str,
    save: Callable[[Path], None],
    card: ModelCard,
    commit_message: str,
    private: bool | None = None,
    token: str | None = None,
):
    """Create the repo if needed and upload the folder `save` writes plus README.md (the card)."""
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    with tempfile.TemporaryDirectory() as folder:
        save(Path(folder))
        card.save(Path(folder) / "README.md")
        return api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", commit_message=commit_message)


class AdapterMixin:
    """`save_pretrained`, `from_pretrained`, `push_to_hub` and `model_card` for a head module whose constructor takes
    its config (with `to_dict()` and `base_model_name_or_path`). The head declares:"""

    # the dataclass of its config
    config_class: ClassVar[type]
    # the `method` values its folders carry; the first is written unless `adapter_type_field` says otherwise
    adapter_types: ClassVar[tuple[str, ...]]
    # the config field that holds the adapter type, for a head of several types (stored as `method`), else None
    adapter_type_field: ClassVar[str | None] = None
    # the model card's template (a package resource) and the upload's default commit message
    card_template: ClassVar[Traversable]
    upload_message: ClassVar[str]

    config: Any

    @staticmethod
    def read_published(folder: Path) -> HeadFiles:
        """A folder in a published layout, converted; a head that reads none refuses every other folder."""
        raise ValueError(f"{folder}: not a head folder (expected {CONFIG_NAME})")

    def card_fields(self) -> dict[str, Any]:
        """The values the card template names beyond metadata, base_model, repo_id and measured."""
        return {}

    @property
    def adapter_type(self) -> str:
        field = self.adapter_type_field
        return getattr(self.config, field) if field else self.adapter_types[0]

    def save_pretrained(self, folder: str | Path) -> None:
        """Write the PEFT-style adapter folder (adapter_config.json + adapter_model.safetensors)."""
        values = self.config.to_dict()
        if self.adapter_type_field:
            values.pop(self.adapter_type_field)
        write_adapter(folder, self.adapter_type, values, self.state_dict())

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, revision: str | None = None):
        """Our adapter folder or a published checkpoint the head reads (converted on load): a local folder or a Hub
        id."""
        return cls.from_files(cls.read_folder(resolve_folder(path_or_repo_id, revision)))

    @classmethod
    def read_folder(cls, folder: Path) -> HeadFiles:
        """Our adapter folder when it holds adapter_config.json, else a published layout."""
        if not (folder / CONFIG_NAME).is_file():
            return cls.read_published(folder)
        stored = tuple(f.name for f in fields(cls.config_class) if f.name != cls.adapter_type_field)
        adapter_type, values, tensors = read_adapter(folder, cls.adapter_types, stored)
        if cls.adapter_type_field:
            values[cls.adapter_type_field] = adapter_type
        return HeadFiles(folder, "adapter", CONFIG_NAME, cls.config_class(**values), tensors)

    @classmethod
    def from_files(cls, files: HeadFiles):
        """The head of `files.config` holding `files.tensors`: every parameter present, none unrecognised, shapes
        as the config says."""
        head = cls(files.config)
        expected = set(head.state_dict())
        missing, unrecognised = sorted(expected - set(files.tensors)), sorted(set(files.tensors) - expected)
        if missing or unrecognised:
            raise ValueError(
                f"{files.folder}: {files.layout} weights: missing {missing}, not recognised {unrecognised}"
            )
        try:
            head.load_state_dict(files.tensors)
        except RuntimeError as error:
            raise ValueError(
                f"{files.folder}: {files.layout} weights do not match its {files.config_name}: {error}"
            ) from error
        return head.eval()

    def model_card(self, repo_id: str, measured: dict[str, float] | None = None) -> ModelCard:
        """The card `push_to_hub` uploads."""
        return render_card(self.card_template, repo_id, self.config.base_model_name_or_path, [self.adapter_type],
                           measured, **self.card_fields())

    def push_to_hub(self, repo_id: str, private: bool | None = None, token: str | None = None,
                    commit_message: str | None = None, measured: dict[str, float] | None = None):
        """Upload the adapter folder with a model card (measured acceptance/speedup go in when given)."""
        return push_folder(repo_id, self.save_pretrained, self.model_card(repo_id, measured),
                           commit_message or self.upload_message, private, token)
