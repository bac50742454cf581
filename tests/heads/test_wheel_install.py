"""The package as users install it: a wheel built from the sources, installed into a fresh virtual environment, saves
Medusa and EAGLE heads and an MLP speculator and pushes them to a mocked Hub with their model cards (the templates
ship inside the package). An editable install reads files from the source tree and cannot show a file missing from
the wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from huggingface_hub import ModelCard

from hf_specdec.heads import EagleHead, MedusaHeads, MlpSpeculator

ROOT = Path(__file__).resolve().parents[2]

# Runs in the installed package's environment: huggingface_hub's upload calls are replaced by copies into argv[1].
PUSH_HEADS = """
import json, sys
from pathlib import Path

import torch
from huggingface_hub import HfApi

import hf_specdec
from hf_specdec.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, MlpSpeculator, MlpSpeculatorConfig

uploads = Path(sys.argv[1])


def create_repo(self, repo_id, **kwargs):
    return repo_id


def upload_folder(self, *, repo_id, folder_path, **kwargs):
    target = uploads / repo_id.replace("/", "--")
    target.mkdir(parents=True)
    for file in Path(folder_path).iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return "commit-info"


HfApi.create_repo = create_repo
HfApi.upload_folder = upload_folder
torch.manual_seed(0)
medusa = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, base_model_name_or_path="local/target"))
eagle = EagleHead(EagleConfig(version="eagle3", hidden_size=16, intermediate_size=32, num_attention_heads=2,
                              num_key_value_heads=2, vocab_size=40, fc_bias=False, feature_layers=(1, 2, 3),
                              draft_vocab_size=24, base_model_name_or_path="local/target"))
mlp = MlpSpeculator(MlpSpeculatorConfig(emb_dim=16, vocab_size=40, inner_dim=8, tie_weights=True,
                                        base_model_name_or_path="local/target"))
medusa.save_pretrained(uploads / "saved-medusa")
eagle.save_pretrained(uploads / "saved-eagle")
mlp.save_pretrained(uploads / "saved-mlp")
results = [medusa.push_to_hub("user/medusa", measured={"mean_acceptance_length": 2.5}), eagle.push_to_hub("user/eagle"),
           mlp.push_to_hub("user/mlp")]
print(json.dumps({"hf_specdec": hf_specdec.__file__, "results": results}))
"""


def _run(*command: str, cwd: Path, env: dict | None = None) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def test_wheel_ships_the_card_templates_and_pushes_heads_with_their_cards(tmp_path):
    # build from a copy, so the build leaves nothing in the source tree
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "hf_specdec", source / "hf_specdec",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w",
         str(wheels), str(source), cwd=tmp_path)
    (wheel,) = wheels.glob("hf_specdec-*.whl")

    # torch, transformers and the other dependencies come from this interpreter's site-packages; the venv's own
    # site-packages (where the wheel goes) come first, ahead of any editable install of the sources
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv), cwd=tmp_path)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    _run(str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)

    uploads = tmp_path / "uploads"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    (tmp_path / "push_heads.py").write_text(PUSH_HEADS)
    # run from tmp_path: the source tree is not on sys.path
    report = json.loads(_run(str(python), str(tmp_path / "push_heads.py"), str(uploads), cwd=tmp_path, env=env))
    installed = Path(report["hf_specdec"]).resolve()
    assert installed.is_relative_to(venv.resolve()), installed
    assert report["results"] == ["commit-info", "commit-info", "commit-info"]

    files = ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    medusa_folder, eagle_folder, mlp_folder = (uploads / f"user--{kind}" for kind in ("medusa", "eagle", "mlp"))
    for folder in (medusa_folder, eagle_folder, mlp_folder):
        assert sorted(p.name for p in folder.iterdir()) == files

    medusa_card = ModelCard.load(medusa_folder / "README.md")
    assert medusa_card.data.library_name == "hf-specdec" and medusa_card.data.base_model == "local/target"
    assert medusa_card.data.tags == ["speculative-decoding", "medusa", "hf-specdec"]
    assert "# Medusa heads for local/target" in medusa_card.text
    assert "3\nMedusa heads (1 residual block(s) each, hidden size 16, each projected by its own lm_head over 40" \
        in medusa_card.text
    assert 'MedusaHeads.from_pretrained("user/medusa")' in medusa_card.text
    assert "| mean_acceptance_length | 2.5 |" in medusa_card.text

    eagle_card = ModelCard.load(eagle_folder / "README.md")
    assert eagle_card.data.library_name == "hf-specdec" and eagle_card.data.base_model == "local/target"
    assert eagle_card.data.tags == ["speculative-decoding", "eagle3", "hf-specdec"]
    assert "# EAGLE-3 draft head for local/target" in eagle_card.text
    assert "entering layers [1, 2, 3] (fused)" in eagle_card.text and "draft vocabulary of 24 tokens" in eagle_card.text
    assert 'EagleHead.from_pretrained("user/eagle")' in eagle_card.text
    assert "Not measured yet." in eagle_card.text

    mlp_card = ModelCard.load(mlp_folder / "README.md")
    assert mlp_card.data.library_name == "hf-specdec" and mlp_card.data.base_model == "local/target"
    assert mlp_card.data.tags == ["speculative-decoding", "mlp_speculator", "hf-specdec"]
    assert "# MLP speculator for local/target" in mlp_card.text
    assert 'MlpSpeculator.from_pretrained("user/mlp")' in mlp_card.text

    # what the installed package wrote (and uploaded) loads here, and is what it saved
    for kind, cls in (("medusa", MedusaHeads), ("eagle", EagleHead), ("mlp", MlpSpeculator)):
        uploaded, saved = cls.from_pretrained(uploads / f"user--{kind}"), cls.from_pretrained(uploads / f"saved-{kind}")
        assert uploaded.config == saved.config
        for (name, a), (_, b) in zip(uploaded.state_dict().items(), saved.state_dict().items(), strict=True):
            assert torch.equal(a, b), (kind, name)

    with zipfile.ZipFile(wheel) as archive:
        cards = sorted(name for name in archive.namelist() if name.endswith("card.md"))
    assert cards == ["hf_specdec/heads/eagle/card.md", "hf_specdec/heads/medusa/card.md",
                     "hf_specdec/heads/mlp_speculator/card.md"]
