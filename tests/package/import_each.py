"""Import each named module alone: in a child forked from this process before any `nonstop` module was imported, so
every child starts from the same pristine interpreter (no other nonstop module imported, nothing registered by one)
and a module that imports only when another was imported first fails here. The expensive third-party imports every
module shares (torch, numpy, triton) are done once, before the fork; they are not nonstop's.

    python import_each.py MODULE... -> one line per failing module, `MODULE<TAB>error`, and exit status 1 if any
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

PRELOADED = ("torch", "numpy", "triton")
PARALLEL = 4


def import_in_child(name: str) -> tuple[int, int]:
    """(pid, read end of a pipe that gets the child's error, empty when the import worked)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        status = 0
        try:
            importlib.import_module(name)
        except BaseException:
            os.write(write, traceback.format_exc(limit=-3).encode())
            status = 1
        os.close(write)
        os._exit(status)
    os.close(write)
    return pid, read


def main(names: list[str]) -> int:
    for module in PRELOADED:
        try:
            importlib.import_module(module)
        except ImportError:
            pass  # triton on a machine without it: modules that need it fail on their own
    leaked = sorted(m for m in sys.modules if m == "nonstop" or m.startswith("nonstop."))
    assert not leaked, f"a preloaded library imported nonstop modules: {leaked}"
    failures, running, pending = {}, {}, list(names)
    while pending or running:
        while pending and len(running) < PARALLEL:
            name = pending.pop(0)
            running[import_in_child(name)] = name
        (pid, read), name = next(iter(running.items()))
        error = b""
        while chunk := os.read(read, 65536):
            error += chunk
        os.close(read)
        _, status = os.waitpid(pid, 0)
        del running[(pid, read)]
        if status != 0:
            failures[name] = error.decode() or f"exit status {status}"
    for name, error in failures.items():
        print(f"{name}\t{error.strip()}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
