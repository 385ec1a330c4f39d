"""Every key `NonstopConfig` accepts is read somewhere in `src/nonstop` outside `config/`, so none is accepted without
an effect: the path of `<section>.<field>` reads on expressions of each section's class (config_reads.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from config_reads import ConfigReads, config_fields, key_paths

from nonstop.config import NonstopConfig

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT_PY = SRC / "nonstop" / "config" / "root.py"

# Read by config/root.py only, where it fills other keys (the ones the code reads).
RESOLVED_IN_CONFIG = {
    "actor_rollout_ref.actor.clip_ratio": "fills clip_ratio_low / clip_ratio_high when they are null",
}
# Keys that act only when a switch is on that the trainer refuses so far (trainer/checks.py); their verl meaning is
# the same: the in-reward KL penalty's estimator and coefficient controller apply with use_kl_in_reward=True only.
GATED = {
    key: "algorithm.use_kl_in_reward"
    for key in (
        "algorithm.kl_penalty",
        "algorithm.kl_ctrl.type",
        "algorithm.kl_ctrl.kl_coef",
        "algorithm.kl_ctrl.horizon",
        "algorithm.kl_ctrl.target_kl",
    )
}


def library_files(src: Path) -> list[Path]:
    return [p for p in sorted((src / "nonstop").rglob("*.py")) if p.relative_to(src / "nonstop").parts[0] != "config"]


@pytest.fixture(scope="module")
def reads() -> ConfigReads:
    return ConfigReads(library_files(SRC), SRC, config_fields(NonstopConfig))


def test_every_config_key_is_read_outside_config(reads):
    paths = key_paths(NonstopConfig)
    unread = set(reads.unread(paths)) - set(RESOLVED_IN_CONFIG) - set(GATED)
    assert sorted(unread) == [], "keys accepted but read nowhere: read them, or refuse them in config/unsupported.py"


def test_the_exceptions_are_current(reads):
    """Each listed key exists, is still unread outside config/ (else drop it from its list), and what it relies on
    holds: the resolved keys are read by config/root.py, the gates outside config/."""
    paths = key_paths(NonstopConfig)
    unread = set(reads.unread(paths))
    for key in (*RESOLVED_IN_CONFIG, *GATED):
        assert key in paths and key in unread, key
    in_root = ConfigReads([ROOT_PY], SRC, config_fields(NonstopConfig))
    assert not set(RESOLVED_IN_CONFIG) & set(in_root.unread({k: paths[k][-1:] for k in RESOLVED_IN_CONFIG}))
    assert not set(GATED.values()) & unread


@dataclass
class PlantedLoss:
    n: int = 1
    unused: int = 0
    by_name: int = 0


@dataclass
class PlantedRollout:
    n: int = 1  # the same leaf name as PlantedLoss.n: only reads on a PlantedRollout count for it


@dataclass
class PlantedRoot:
    loss: PlantedLoss = field(default_factory=PlantedLoss)
    rollout: PlantedRollout = field(default_factory=PlantedRollout)
    top: int = 0
    never: int = 0


PLANTED = """
from pkg.holder import Holder


def direct(config: PlantedRoot) -> int:
    section = config.loss
    return section.n


def through_a_call_site(config: PlantedRoot) -> Holder:
    return Holder(config)


def by_name(loss: PlantedLoss | None) -> int:
    for key in ("by_name",):
        return getattr(loss, key)


def unrelated(thing, other) -> int:
    return thing.unused + other.n + other.never
"""
HOLDER = """
class Holder:
    def __init__(self, config):
        self.config = config

    def top(self) -> int:
        return self.config.top
"""


def test_the_checker_finds_planted_unread_keys(tmp_path):
    """A key read only as an attribute name on unrelated objects (`unused`, `never`), and a leaf whose name is read on
    another section (`rollout.n`), are unread; reads through aliases, `self.` attributes bound at a call site and
    `getattr` with a loop of names count."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "code.py").write_text(PLANTED)
    (package / "holder.py").write_text(HOLDER)
    reads = ConfigReads(sorted(package.glob("*.py")), tmp_path, config_fields(PlantedRoot))
    assert reads.unread(key_paths(PlantedRoot)) == ["loss.unused", "never", "rollout.n"]
