"""Heads on the Hugging Face Hub: upload with a model card, download by repo id (offline mode honoured)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

from hf_specdec.heads.files import save_medusa
from hf_specdec.heads.medusa import MedusaHeads

CARD_TEMPLATE = Path(__file__).resolve().parents[2] / "model_cards" / "medusa.md"
TAGS = ["speculative-decoding", "medusa", "hf-specdec"]


def render_card(heads: MedusaHeads, repo_id: str, measured: dict[str, float] | None = None) -> ModelCard:
    """The model card: metadata (library, base model, tags, pipeline) and the measured numbers when known."""
    config = heads.config
    base = config.base_model_name_or_path
    metadata = {"library_name": "hf-specdec", "tags": TAGS, "pipeline_tag": "text-generation"}
    if base:
        metadata["base_model"] = base
    metadata_lines = "\n".join(
        f"{key}: {value}" if not isinstance(value, list) else f"{key}:\n" + "\n".join(f"- {v}" for v in value)
        for key, value in sorted(metadata.items())
    )
    rows = "\n".join(f"| {name} | {value:.3g} |" for name, value in sorted((measured or {}).items()))
    text = CARD_TEMPLATE.read_text().format(
        metadata=metadata_lines, base_model=base or "an unnamed base model", num_heads=config.num_heads,
        num_layers=config.num_layers, hidden_size=config.hidden_size, vocab_size=config.vocab_size, repo_id=repo_id,
        measured=f"| metric | value |\n|---|---|\n{rows}" if rows else "Not measured yet.",
    )
    return ModelCard(text)


def push_medusa(
    heads: MedusaHeads,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    measured: dict[str, float] | None = None,
):
    """Create the repo if needed and upload the adapter folder plus README.md (the model card)."""
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    with tempfile.TemporaryDirectory() as folder:
        save_medusa(heads, folder)
        render_card(heads, repo_id, measured).save(Path(folder) / "README.md")
        return api.upload_folder(
            repo_id=repo_id, folder_path=folder, repo_type="model",
            commit_message=commit_message or "Upload Medusa heads (hf_specdec)",
        )


def resolve_folder(path_or_repo_id: str | Path, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id, downloaded (or read from the cache when offline)."""
    if Path(path_or_repo_id).is_dir():
        return Path(path_or_repo_id)
    try:
        return Path(snapshot_download(str(path_or_repo_id), revision=revision))
    except LocalEntryNotFoundError as error:
        raise ValueError(
            f"{path_or_repo_id!r} is not a local folder, and the Hub repo is not in the local cache (offline, or "
            "unreachable); pass a local folder or download it first"
        ) from error
