"""Import each named module alone: in a child forked from this process before any `nonstop` module was imported, so
every child starts from the same pristine interpreter (no other nonstop module imported, nothing registered by one)
and a module that imports only when another was imported first fails here.

What the children share is third-party: first one forked child imports every named module and reports the
third-party modules that loaded, in their order; this process imports those, then forks one child per module. So each
child runs only nonstop's own module code (a second or two of torch and transformers per child would otherwise make
the run minutes long); the package is compiled once, into a temporary bytecode cache the children read (this
environment sets PYTHONDONTWRITEBYTECODE, so each child would compile it again), set once the third-party modules are
imported (a cache prefix hides their own bytecode). The one thing this can hide is a
nonstop module that reaches a third-party submodule it never imports (`torch.x.y` without `import torch.x.y`).

    python import_each.py MODULE... -> one line per failing module, `MODULE<TAB>error`, and exit status 1 if any
"""

from __future__ import annotations

import compileall
import importlib
import os
import select
import sys
import tempfile
import time
import traceback
from pathlib import Path

PARALLEL = 4
CHILD_TIMEOUT_S = 300


def _ours(name: str) -> bool:
    return name == "nonstop" or name.startswith("nonstop.")


def fork(work, *args) -> tuple[int, int]:
    """(pid, read end of a pipe): a child runs `work(*args)`, which returns the bytes it sends back, and exits 1 when
    it raised (sending the traceback)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        status = 0
        try:
            out = work(*args)
        except BaseException:
            out, status = traceback.format_exc(limit=-4).encode(), 1
        with os.fdopen(write, "wb") as pipe:
            pipe.write(out)
        os._exit(status)
    os.close(write)
    return pid, read


def finish(pid: int, read: int, deadline: float) -> tuple[int, bytes]:
    """The child's exit status and what it sent; a child past `deadline` is killed (status -1)."""
    out = b""
    while True:
        ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read)
            return -1, out + b"timed out: the import hangs"
        chunk = os.read(read, 65536)
        if not chunk:
            break
        out += chunk
    os.close(read)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


def third_party_loaded_by(names: list[str]) -> bytes:
    before = set(sys.modules)
    for name in names:
        importlib.import_module(name)
    loaded = [m for m in sys.modules if m not in before and not _ours(m) and "__main__" not in m]
    return "\n".join(loaded).encode()


def import_alone(name: str) -> bytes:
    importlib.import_module(name)
    return b""


def main(names: list[str]) -> int:
    assert not any(_ours(m) for m in sys.modules), "this process must not have imported nonstop"
    error = import_third_party_loaded_by(names)
    if error is not None:
        print(f"(all together)\t{error}")
        return 1
    # Only now: a bytecode prefix hides every __pycache__, third-party ones too, and torch and transformers compiled
    # from source take twice as long to import (in the first child and here).
    with tempfile.TemporaryDirectory() as cache:
        sys.pycache_prefix = cache
        compileall.compile_dir(Path(__file__).resolve().parents[2] / "src" / "nonstop", quiet=1)
        return import_each(names)


def import_third_party_loaded_by(names: list[str]) -> str | None:
    """Import what importing every named module loads of third-party code, learned in a child; its error if any."""
    status, out = finish(*fork(third_party_loaded_by, names), time.monotonic() + CHILD_TIMEOUT_S)
    if status != 0:
        return out.decode().strip()
    for module in out.decode().split():
        try:
            importlib.import_module(module)
        except Exception:  # a module registered under another name (an alias): its package imported it already
            pass
    assert not any(_ours(m) for m in sys.modules), "a third-party module imported nonstop"
    return None


def import_each(names: list[str]) -> int:
    failures, running, pending = {}, [], list(names)
    while pending or running:
        while pending and len(running) < PARALLEL:
            name = pending.pop(0)
            running.append((name, *fork(import_alone, name), time.monotonic() + CHILD_TIMEOUT_S))
        name, pid, read, deadline = running.pop(0)
        status, out = finish(pid, read, deadline)
        if status != 0:
            failures[name] = out.decode().strip() or f"exit status {status}"
    for name, error in failures.items():
        print(f"{name}\t{error}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
