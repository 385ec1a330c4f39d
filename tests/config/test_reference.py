"""docs/configuration.md is generated from the field metadata and must not drift from it."""

import dataclasses
from pathlib import Path

from nonstop.config import reference_markdown
from nonstop.config.tree import key_index

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_doc_is_generated():
    assert DOC.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: run `python -m nonstop.config.reference > docs/configuration.md`"
    )


def test_every_key_is_documented():
    doc = reference_markdown()
    for key, tp in key_index().items():
        if not dataclasses.is_dataclass(tp):
            assert f"| `{key}` |" in doc, key
