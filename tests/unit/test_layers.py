"""Imports run down the layers (DESIGN, "Layers"): a module never imports one of a floor above its own.

Read from the source (ast), function-local imports included: a lazy import is still a dependency. Checked for the
modules whose upward imports issue 31 removed (the model card, the pre-flight, the GRPO loop, evaluation) and for the
planner and environments packages.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "megatron_rl"

# floors, lowest first, by the first name under megatron_rl (coarser than DESIGN's table: within a floor any import)
FLOORS = (
    ("ground", {"platform", "paths", "lifecycle", "buffers", "mp_main", "config", "data", "rewards", "models", "distributed",
                "weights", "planner"}),
    # environments: on config, data and rewards below; generation and the algorithms (the rollout loop) import it
    ("workers", {"environments", "policy", "generation"}),
    ("algorithms", {"algorithms"}),
    ("composition and entry", {"build", "api", "cli", "__main__"}),
)
CHECKED = ["weights/model_card.py", "config/preflight.py", "algorithms/grpo.py", "algorithms/evaluate.py",
           "algorithms/trainer.py", "algorithms/supervised.py", "algorithms/supervised_batches.py",
           "algorithms/supervised_loss.py", "data/supervised.py",
           *sorted(str(p.relative_to(PKG)) for p in (PKG / "planner").glob("*.py")),
           *sorted(str(p.relative_to(PKG)) for p in (PKG / "environments").glob("*.py"))]


def floor_of(top: str) -> int:
    for i, (_, names) in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"megatron_rl.{top} is on no floor: add it to FLOORS")


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every megatron_rl import in the file; `from megatron_rl import x` names x."""
    package = ["megatron_rl", *path.relative_to(PKG).parent.parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}" if base == "megatron_rl" else base) for a in node.names]
    return [(line, m) for line, m in out if m.split(".")[0] == "megatron_rl" and m.count(".")]


def upward_imports(rel: str) -> list[str]:
    path = PKG / rel
    mine = floor_of(Path(rel).parts[0].removesuffix(".py"))
    return [f"megatron_rl/{rel}:{line} imports {m} ({FLOORS[floor_of(m.split('.')[1])][0]}, above "
            f"{FLOORS[mine][0]})" for line, m in imported(path) if floor_of(m.split(".")[1]) > mine]


@pytest.mark.parametrize("rel", CHECKED)
def test_no_import_from_a_floor_above(rel):
    assert (PKG / rel).is_file(), rel
    assert upward_imports(rel) == []


def test_the_check_sees_lazy_and_package_imports(tmp_path, monkeypatch):
    """The parser finds a function-local import and `from megatron_rl import x`, and ranks them."""
    fake = tmp_path / "megatron_rl"
    (fake / "weights").mkdir(parents=True)
    (fake / "weights" / "x.py").write_text("from megatron_rl import build\n\ndef f():\n"
                                           "    from megatron_rl.algorithms.tracking import read_metrics\n"
                                           "    from megatron_rl.config import Config\n")
    monkeypatch.setitem(globals(), "PKG", fake)
    assert upward_imports("weights/x.py") == [
        "megatron_rl/weights/x.py:1 imports megatron_rl.build (composition and entry, above ground)",
        "megatron_rl/weights/x.py:4 imports megatron_rl.algorithms.tracking (algorithms, above ground)"]


def test_environments_import_only_the_ground_floor():
    """Generation and the rollout loop will import the environments, so these must not import workers-floor
    packages (policy, generation) either: they stand on config, data and rewards."""
    found = [f"megatron_rl/environments/{p.name}:{line} imports {m}"
             for p in sorted((PKG / "environments").glob("*.py")) for line, m in imported(p)
             if floor_of(m.split(".")[1]) > 0 and m.split(".")[1] != "environments"]
    assert found == []
