"""Hugging Face hub ids resolve through a local cache laid out here as huggingface_hub lays it out, offline; a
missing model names the id and the cache; a download goes through huggingface_hub with nonstop's file list."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from test_loading import assert_same_parameters
from test_transformer import nonstop_copy, tiny_hf_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nonstop.models import load_hf_model, load_model, load_tokenizer, save_hf
from nonstop.models.hub import MODEL_FILES, is_hub_id, resolve_model_path

REPO = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(cache: Path, repo_id: str = REPO) -> tuple[Path, torch.nn.Module]:
    """`models--owner--name/{refs/main, snapshots/<commit>/...}`: what a download leaves in HF_HUB_CACHE."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    model = nonstop_copy(tiny_hf_model("llama-untied", seed=5))
    words = ["<unk>", "<s>", "</s>", "hello", "world"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    save_hf(model, snapshot, tokenizer=tokenizer)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot, model


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no test touches the network
    return cache


def test_hub_id_loads_from_the_local_cache(offline_cache):
    snapshot, saved = lay_out_cache(offline_cache)
    assert resolve_model_path(REPO) == snapshot
    model, tokenizer = load_model(REPO)
    assert_same_parameters(model, saved)
    assert tokenizer("hello world")["input_ids"] == [3, 4]
    assert load_tokenizer(REPO).eos_token == "</s>"
    assert_same_parameters(load_hf_model(resolve_model_path(REPO)), saved)


def test_a_local_directory_named_like_an_id_wins(offline_cache, tmp_path, monkeypatch):
    lay_out_cache(offline_cache)
    local = tmp_path / "work" / "acme" / "tiny-llama"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_path(REPO) == Path(REPO)


def test_hf_home_is_where_a_fresh_process_looks(tmp_path):
    """The environment variables, read by huggingface_hub when it is imported: HF_HOME/hub is the cache."""
    snapshot, _ = lay_out_cache(tmp_path / "home" / "hub")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    code = f"from nonstop.models.hub import resolve_model_path; print(resolve_model_path({REPO!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(snapshot)


def test_a_model_in_no_cache_names_the_id_and_where_it_looked(offline_cache):
    with pytest.raises(FileNotFoundError) as e:
        load_model("acme/absent-model")
    message = str(e.value)
    assert "'acme/absent-model'" in message and str(offline_cache) in message and "HF_HUB_OFFLINE" in message


def test_with_a_network_it_downloads_nonstops_files(offline_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []
    real = huggingface_hub.snapshot_download

    def fake_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)  # the cache is empty: the real lookup fails
        return str(lay_out_cache(offline_cache, repo_id)[0])  # "downloaded"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model_path(REPO).parent.parent.name == "models--acme--tiny-llama"
    assert [c[1].get("local_files_only", False) for c in calls] == [True, False]
    assert calls[1][1]["allow_patterns"] == MODEL_FILES

    def no_network(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("acme/other")
    assert "'acme/other'" in str(e.value) and "downloading it from the hub failed" in str(e.value)
    assert "Name or service not known" in str(e.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("./models/qwen", False),
        ("/abs/path", False),
        ("a/b/c", False),
        ("owner/model.gguf", False),
        ("model", False),
    ],
)
def test_is_hub_id(text, expected):
    assert is_hub_id(text) is expected
