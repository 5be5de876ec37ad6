"""megatron_rl.mp_main: spawn children of a main that is no file (`python -`) start instead of dying on `<stdin>`."""
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_rl import mp_main

REPO = Path(__file__).resolve().parents[2]

# a spawn child whose target is importable (os.getpid); only the main-module handling differs between the runs
CHILD = """
import multiprocessing, os
from megatron_rl.mp_main import main_hidden, main_is_runnable
print("runnable", main_is_runnable())
ctx = multiprocessing.get_context("spawn")
p = ctx.Process(target=os.getpid)
with main_hidden() if {hide} else open(os.devnull):
    p.start()
p.join()
print("exitcode", p.exitcode, "file", __file__)
"""


@pytest.mark.parametrize("hide", [False, True])
def test_spawn_child_of_python_stdin(hide):
    r = subprocess.run([sys.executable, "-"], input=CHILD.format(hide=hide), capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert "runnable False" in r.stdout, r.stdout + r.stderr
    if hide:  # the child started, and the parent's __file__ is back afterwards
        assert "exitcode 0 file <stdin>" in r.stdout and not r.stderr, r.stdout + r.stderr
    else:  # the cause, pinned: CPython's child opens the main "file" <stdin>
        assert "exitcode 1" in r.stdout and "FileNotFoundError" in r.stderr and "<stdin>" in r.stderr, r.stderr


def test_main_is_runnable_and_main_hidden_restore(monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    cases = [(dict(__file__="<stdin>", __spec__=None), False), (dict(__spec__=None), False),  # python -, REPL
             (dict(__file__=str(tmp_path / "nb.ipynb"), __spec__=None), False),
             (dict(__file__=str(script), __spec__=None), True),
             (dict(__file__=str(script), __spec__=types.SimpleNamespace(name="pkg.train")), True)]  # python -m
    for attrs, runnable in cases:
        main = types.ModuleType("__main__")
        main.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, "__main__", main)
        assert mp_main.main_is_runnable() is runnable, attrs
        with mp_main.main_hidden(always=True):
            assert main.__spec__ is None and not hasattr(main, "__file__")
        with mp_main.main_hidden():
            assert hasattr(main, "__file__") == (runnable and "__file__" in attrs)
        assert {k: main.__dict__.get(k) for k in attrs} == attrs  # restored as it was
