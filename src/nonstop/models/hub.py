"""Hugging Face hub model ids (`Qwen/Qwen2.5-0.5B-Instruct`) as local directories, as `from_pretrained` finds them.

A path that exists is used as it is. Otherwise an `owner/name` id is looked up in the local Hugging Face cache
(`HF_HUB_CACHE`, by default `$HF_HOME/hub`), without network, and downloaded into it when it is not there and
the hub can be reached (not with `HF_HUB_OFFLINE=1`). Only what nonstop reads is fetched: the config, safetensors
weights and tokenizer files.
"""

from __future__ import annotations

import re
from pathlib import Path

# `owner/name`, as the hub spells repo ids: neither part starts with a dot or a dash, no other slashes.
_HUB_ID = re.compile(r"^[A-Za-z0-9_][\w.-]*/[A-Za-z0-9_][\w.-]*$")
MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
]


def is_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and not text.endswith(".gguf")


def resolve_model_path(path_or_id: str | Path) -> Path:
    """The local directory or file for a path or hub id; a FileNotFoundError naming the id and where it looked."""
    path = Path(path_or_id).expanduser()
    if path.exists() or not is_hub_id(str(path_or_id)):
        return path
    from huggingface_hub import constants, snapshot_download

    repo_id = str(path_or_id)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=MODEL_FILES))
    except Exception:  # not cached (LocalEntryNotFoundError), or a cache entry without a snapshot
        pass
    where = f"neither a local path nor in the Hugging Face cache {constants.HF_HUB_CACHE} (HF_HOME / HF_HUB_CACHE)"
    if constants.is_offline_mode():
        raise FileNotFoundError(f"model {repo_id!r} is {where}, and HF_HUB_OFFLINE is set: nothing is downloaded")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES))
    except Exception as e:  # no network, unknown or gated repo: huggingface_hub raises several types
        raise FileNotFoundError(
            f"model {repo_id!r} is {where}, and downloading it from the hub failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else e!r}); download it where a network exists "
            f"(`hf download {repo_id}`) or pass a local directory"
        ) from None
