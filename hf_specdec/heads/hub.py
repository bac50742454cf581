"""Heads on the Hugging Face Hub: upload with a model card, download by repo id (offline mode honoured).

Every head kind shares the upload (`push_folder`) and the card renderer (`render_card`, over a template in
`model_cards/`); each head class's `push_to_hub` names its folder writer, its card and its commit message.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

from hf_specdec.heads.eagle import EagleHead
from hf_specdec.heads.medusa import MedusaHeads

CARD_TEMPLATES = Path(__file__).resolve().parents[2] / "model_cards"
LIBRARY_TAG = "hf-specdec"


def render_card(
    template: str,
    repo_id: str,
    base_model: str | None,
    tags: list[str],
    measured: dict[str, float] | None = None,
    **fields,
) -> ModelCard:
    """The card from `model_cards/<template>`: metadata (library, base model, tags, pipeline), the repo id, the
    measured numbers when known (else "Not measured yet."), and the template's own `fields`."""
    metadata = {"library_name": LIBRARY_TAG, "pipeline_tag": "text-generation",
                "tags": ["speculative-decoding", *tags, LIBRARY_TAG]}
    if base_model:
        metadata["base_model"] = base_model
    metadata_lines = "\n".join(
        f"{key}: {value}" if not isinstance(value, list) else f"{key}:\n" + "\n".join(f"- {v}" for v in value)
        for key, value in sorted(metadata.items())
    )
    rows = "\n".join(f"| {name} | {value:.3g} |" for name, value in sorted((measured or {}).items()))
    text = (CARD_TEMPLATES / template).read_text().format(
        metadata=metadata_lines, base_model=base_model or "an unnamed base model", repo_id=repo_id,
        measured=f"| metric | value |\n|---|---|\n{rows}" if rows else "Not measured yet.", **fields,
    )
    return ModelCard(text)


def medusa_card(heads: MedusaHeads, repo_id: str, measured: dict[str, float] | None = None) -> ModelCard:
    config = heads.config
    projection = ("the target's own lm_head" if config.shared_lm_head
                  else f"its own lm_head over {config.vocab_size} tokens")
    return render_card("medusa.md", repo_id, config.base_model_name_or_path, ["medusa"], measured,
                       num_heads=config.num_heads, num_layers=config.num_layers, hidden_size=config.hidden_size,
                       projection=projection)


def eagle_card(head: EagleHead, repo_id: str, measured: dict[str, float] | None = None) -> ModelCard:
    config = head.config
    if config.version == "eagle":
        title = "EAGLE-1/2"
        reads = "the target's final hidden state"
        vocabulary = "the target's lm_head and vocabulary"
    else:
        title = "EAGLE-3"
        layers = list(config.feature_layers) if config.feature_layers else "2, L // 2 and L - 3 (L: its layer count)"
        reads = f"the target's hidden states entering layers {layers} (fused)"
        vocabulary = f"its own lm_head over a draft vocabulary of {config.draft_vocab_size or config.vocab_size} tokens"
    return render_card("eagle.md", repo_id, config.base_model_name_or_path, [config.version], measured,
                       title=title, reads=reads, vocabulary=vocabulary, hidden_size=config.hidden_size,
                       vocab_size=config.vocab_size)


def push_folder(
    repo_id: str,
    save: Callable[[Path], None],
    card: ModelCard,
    default_message: str,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
):
    """Create the repo if needed and upload the folder `save` writes plus README.md (the card)."""
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    with tempfile.TemporaryDirectory() as folder:
        save(Path(folder))
        card.save(Path(folder) / "README.md")
        return api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                                 commit_message=commit_message or default_message)


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
