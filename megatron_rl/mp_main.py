"""Start spawn/forkserver children without re-running a main module they cannot (or need not) run.

A spawn or forkserver child re-runs the parent's `__main__` before it unpickles its target, so that functions
defined there resolve. Python 3.11 decides how from the parent's `sys.modules["__main__"]` at each process start
(`multiprocessing.spawn.get_preparation_data`): `__spec__.name` -> import it as a module, else `__file__` -> run
that path. Under `python -` (and `python < script.py`) `__file__` is "<stdin>", which the child then tries to open:
FileNotFoundError before any of our code runs, and the worker dies with nothing but its stderr to say why.

The remedy used here: hide `__spec__` and `__file__` for the duration of the start, so the preparation data names
no main and the child keeps its own. Why this over the alternatives: a custom Popen would copy CPython's
`_launch`; `set_forkserver_preload` only covers the forkserver itself (not each child's preparation, which is
sent per process) and does nothing for spawn; `set_executable` changes the interpreter, not the preparation. The
attributes are restored at once; only code reading `__main__.__file__` from another thread during a start could
notice.
"""
from __future__ import annotations

import contextlib
import os
import sys
from multiprocessing import process
from typing import Iterator


def main_is_runnable() -> bool:
    """Whether a spawn child could re-run this process's main: an importable module (python -m) or a script file.
    False for `python -`, `python -c`, the REPL and notebooks."""
    main = sys.modules.get("__main__")
    if main is None:
        return False
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return True
    path = getattr(main, "__file__", None)
    if not path:
        return False
    if not os.path.isabs(path) and process.ORIGINAL_DIR is not None:  # the child resolves it the same way
        path = os.path.join(process.ORIGINAL_DIR, path)
    return os.path.isfile(path) and not path.endswith(".ipynb")


@contextlib.contextmanager
def main_hidden(always: bool = False) -> Iterator[None]:
    """Processes started inside this block do not re-run the parent's main module: never when `always` (their
    targets are all in importable modules), else only when it is not runnable (see `main_is_runnable`)."""
    main = sys.modules.get("__main__")
    if main is None or (not always and main_is_runnable()):
        yield
        return
    missing = object()
    saved = {k: main.__dict__.get(k, missing) for k in ("__spec__", "__file__")}
    main.__spec__ = None  # get_preparation_data reads main.__spec__ unguarded: None, not deleted
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                main.__dict__.pop(k, None)
            else:
                main.__dict__[k] = v
