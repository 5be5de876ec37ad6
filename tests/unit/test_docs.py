"""The README and docs/ stay true to the tree: every command they quote parses, every repo path they name exists.

Commands are read from the code blocks (bash, console or unlabelled; in a block with `$ ` prompts only the prompted
lines; `\\` continues a line, and so does an indented `[...]`/`--...` line under a synopsis):
- `megatron-rl train|sft|dpo CONFIG overrides` (also `bash launch/demo_cpu.sh overrides`, `launch/grpo_local.sh` and
  `launch/slurm_grpo.sh`, which run it): `--dry-run`, i.e. the config, the overrides and the model/tokenizer checks.
  Where the config's model is the user's own and absent here (`policy.model=/path/to/hf_model`, the DeepScaleR
  recipes; a distillation teacher an earlier command makes), the config and overrides are validated without the
  model. A command the doc shows failing (followed
  by a `# config error: ...` line) must fail with that message; one the doc shows working must draw no pre-flight
  warning (such as a prompt asking for an answer form the reward does not read).
- `megatron-rl eval|convert|plan|info ...`, `launch/torchrun_convert.sh`, `python -m megatron_rl.X ...` and
  `python bench/X.py ...`: the tool's own argparse parses the quoted arguments (the run stops right after the parse),
  and each distinct tool answers `--help`. Synopsis lines with placeholders (`CONFIG.yaml`, `DIR`, `[--tp N]`) only
  need `--help`, whose text must name every flag they show.
- `python -c "..."` lines that only call megatron_rl (the tiny-model writers) run, so that the commands after them
  find their output; `/tmp/` is redirected to a temp dir.
All of it runs in ONE subprocess (the imports are paid once): about 15 s on 2 cores.

Paths: every `megatron_rl/...`, `kernels/...`, `launch/...`, `configs/...`, `bench/...`, `tests/...`, `examples/...`,
`docs/...` and `.ci/...` path the docs name (brace and glob patterns expanded), module-relative paths such as
`policy/offload.py` (under megatron_rl/), bare `test_*.py` names (somewhere under tests/), and every relative
markdown link with its `#anchor` must exist.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN_LANGS = {"", "bash", "sh", "shell", "console"}
TOOLS = {"eval", "convert", "plan", "info"}
PY = re.compile(r"^(?:\S*/)?python3?$")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:\.yaml)?|\.\.\.|\.\.\.\]|\[.*|.*\]|.*\|.*)$")
# scripts without argparse that are cheap enough to run as they are (anything else without argparse is only compiled)
RUN_FULLY = {"bench/plan_vs_nemo_rl.py"}


# ---------------------------------------------------------------------------------------------------- reading docs

def code_blocks(text: str):
    """(first line number, language, lines) of each fenced block."""
    out, lang, start, buf = [], None, 0, []
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if lang is None:
                lang, start, buf = line.strip()[3:].strip().lower(), i + 1, []
            else:
                out.append((start, lang, buf))
                lang = None
        elif lang is not None:
            buf.append(line)
    return out


def block_commands(lines: list[str]):
    """(line offset, command text, expected error or None) of each command line of a block."""
    prompted = any(line.startswith("$ ") for line in lines)
    cmds: list[list] = []
    cont = False
    for i, line in enumerate(lines):
        s = line.strip()
        if cont and cmds:
            cmds[-1][1] += " " + s.rstrip("\\")
            cont = s.endswith("\\")
            continue
        if cmds and s.startswith("# config error:"):
            cmds[-1][2] = s[2:]
            continue
        if cmds and cmds[-1][2] and s.startswith("#  "):
            cmds[-1][2] += " " + s[1:].strip()
            continue
        if cmds and line[:1].isspace() and s[:1] in "[-" and not prompted:
            cmds[-1][1] += " " + s  # a synopsis' indented continuation
            continue
        if prompted:
            if not line.startswith("$ "):
                continue
            s = line[2:].strip()
        if not s or s.startswith("#"):
            continue
        cmds.append([i, s.rstrip("\\"), None])
        cont = s.endswith("\\")
    return [tuple(c) for c in cmds]


def split_commands(text: str) -> list[list[str]]:
    """Shell words of each simple command (comments dropped, split at && ; |)."""
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        words = list(lex)
    except ValueError:
        return []
    out, cur = [], []
    for w in words:
        if w and set(w) <= set(";&|"):
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    return [c for c in out + [cur] if c]


def classify(words: list[str]) -> dict | None:
    """What to run for one quoted command, or None (not a command this test runs)."""
    w = list(words)
    while w and re.match(r"^[A-Z_]+=", w[0]):  # VAR=value prefixes
        w = w[1:]
    if not w:
        return None
    if w[0] == "sbatch":
        scripts = [i for i, x in enumerate(w) if x.endswith(".sh")]
        if not scripts:
            return None
        w = w[scripts[0]:]
    if w[0] == "bash" and len(w) > 1:
        w = w[1:]
    prog = w[0]
    if prog.endswith("megatron-rl"):
        return cli(w[1:])
    if PY.match(prog) and len(w) > 1:
        if w[1] == "-m" and len(w) > 2 and w[2].split(".")[0] == "megatron_rl":
            if w[2] in ("megatron_rl", "megatron_rl.cli"):
                return cli(w[3:])
            return {"kind": "module", "target": w[2], "args": w[3:]}
        if w[1] == "-c" and len(w) > 2 and "megatron_rl" in w[2] and "import" in w[2]:
            return {"kind": "code", "code": w[2]}
        if w[1].startswith("bench/") and w[1].endswith(".py"):
            return {"kind": "script", "target": w[1], "args": w[2:]}
        return None
    launcher = prog.removeprefix("./")
    if launcher == "launch/demo_cpu.sh":
        return cli(["train", "configs/demo_cpu.yaml", *w[1:]])
    if launcher in ("launch/grpo_local.sh", "launch/slurm_grpo.sh") and len(w) > 1 and w[1] not in ("-h", "--help"):
        return cli(["train", *w[1:]])
    if launcher == "launch/torchrun_convert.sh":
        return cli(["convert", *w[1:]])
    if launcher == "launch/torchrun_eval.sh" and "--" in w:
        return cli(["eval", "--model", "exported_hf", *w[w.index("--") + 1:]])
    return None


def cli(args: list[str]) -> dict | None:
    args = [a for a in args if a != "--debug"]
    if not args:
        return None
    sub, rest = args[0], args[1:]
    # `convert` has a subcommand of its own, whose --help lists its flags
    help_argv = [sub, rest[0]] if sub == "convert" and rest and not rest[0].startswith("-") else [sub]
    if any(PLACEHOLDER.match(a) for a in rest):
        flags = sorted({f for a in rest for f in re.findall(r"--[a-z][\w-]*", a)})
        return {"kind": "synopsis", "sub": sub, "help_argv": help_argv, "flags": flags}
    if sub in ("train", "sft", "dpo"):  # the same dry run, with the command's algorithm
        return {"kind": "train", "sub": sub, "args": rest}
    if sub in TOOLS:
        return {"kind": "tool", "sub": sub, "help_argv": help_argv, "args": rest}
    return {"kind": "unknown", "sub": sub}


def quoted_commands() -> list[dict]:
    out = []
    for doc in DOCS:
        for start, lang, lines in code_blocks(doc.read_text()):
            if lang not in RUN_LANGS:
                continue
            for off, text, expect in block_commands(lines):
                for words in split_commands(text):
                    job = classify(words)
                    if job is not None:
                        job.update(where=f"{doc.relative_to(ROOT)}:{start + off}", text=text, expect=expect)
                        out.append(job)
    return out


# ------------------------------------------------------------------------------------- the runner (one subprocess)

RUNNER = r'''
import argparse, contextlib, io, json, os, runpy, sys, traceback
jobs_file, out_file, tmp = sys.argv[1:4]
jobs = json.load(open(jobs_file))
sys.path.insert(0, os.getcwd())

class Parsed(BaseException):
    pass

_orig = argparse.ArgumentParser.parse_args

def _stop_after_parse(self, args=None, namespace=None):
    ns = _orig(self, args, namespace)
    raise Parsed(ns)

def quiet(fn):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            return fn(), out.getvalue(), err.getvalue()
        except SystemExit as e:
            return ("exit", e.code), out.getvalue(), err.getvalue()

def tmpfix(x):
    return x.replace("/tmp/", tmp + "/")

from megatron_rl.cli import main as cli_main
from megatron_rl.config import load_config
from megatron_rl.algorithms.stages import is_chain, load_stages

def run_cli(argv, parse_only):
    if parse_only:
        argparse.ArgumentParser.parse_args = _stop_after_parse
    try:
        return quiet(lambda: cli_main(argv))
    except Parsed as p:
        return ("parsed", None), "", ""
    finally:
        argparse.ArgumentParser.parse_args = _orig

def run_py(kind, target, args, parse_only):
    sys.argv = [target, *args]
    if parse_only:
        argparse.ArgumentParser.parse_args = _stop_after_parse
    try:
        if kind == "script":
            return quiet(lambda: runpy.run_path(target, run_name="__main__"))
        return quiet(lambda: runpy.run_module(target, run_name="__main__", alter_sys=True))
    except Parsed as p:
        return ("parsed", vars(p.args[0])), "", ""
    finally:
        argparse.ArgumentParser.parse_args = _orig

def help_of(job):
    if job["kind"] == "script" and "argparse" not in open(job["target"]).read():
        return ("exit", 0), ""  # no flags to parse (and RUN_FULLY scripts run below anyway)
    if job["kind"] in ("script", "module"):
        r, out, err = run_py(job["kind"], job["target"], ["--help"], False)
    else:
        r, out, err = run_cli([*job["help_argv"], "--help"], False)
    return r, out + err

results, helps = [], {}
for job in jobs:
    res = {"where": job["where"], "text": job["text"], "ok": False, "why": ""}
    try:
        kind = job["kind"]
        if kind == "code":
            exec(compile(tmpfix(job["code"]), "<doc>", "exec"), {"__name__": "__doc_snippet__"})
            res["ok"] = True
        elif kind in ("script", "module", "tool", "synopsis"):
            key = job.get("target") or " ".join(job["help_argv"])
            if key not in helps:
                helps[key] = help_of(job)
            r, text = helps[key]
            if r != ("exit", 0):
                res["why"] = f"--help did not exit 0: {r!r}\n{text[-2000:]}"
            elif kind == "synopsis":
                missing = [f for f in job["flags"] if f not in text]
                res["ok"], res["why"] = not missing, f"--help does not list {missing}"
            elif kind == "tool":
                r, out, err = run_cli([job["sub"], *map(tmpfix, job["args"])], True)
                res["ok"], res["why"] = r[0] == "parsed", f"{r!r}: {err[-2000:]}"
            else:
                src = open(job["target"]).read() if kind == "script" else ""
                if kind == "script" and "argparse" not in src and job["target"] not in RUN_FULLY:
                    compile(src, job["target"], "exec")
                    res["ok"] = True
                else:
                    r, out, err = run_py(kind, job["target"], list(map(tmpfix, job["args"])), True)
                    parsed = isinstance(r, tuple) and r[0] == "parsed"
                    res["ok"] = parsed or (isinstance(r, tuple) and r == ("exit", 0))
                    res["why"] = f"{str(r)[:300]}: {err[-2000:]}"
                    ns = r[1] if parsed else None
                    if res["ok"] and ns and ns.get("overrides"):  # demo_ab.py: overrides of the demo config
                        load_config("configs/demo_cpu.yaml", ns["overrides"], check_model=False)
        elif kind == "train":
            args = [tmpfix(a) for a in job["args"]]
            argv = [job.get("sub", "train"), *args] + ([] if "--dry-run" in args else ["--dry-run"])
            r, out, err = run_cli(argv, False)
            if job["expect"]:
                want = " ".join(job["expect"].split())
                got = " ".join(err.split())
                res["ok"] = r == 2 and want.split(" (")[0] in got
                res["why"] = f"expected exit 2 with {want!r}, got {r!r}: {err[-2000:]}"
            elif r == 0:
                # a quoted command whose own pre-flight warns (e.g. a prompt the verifier cannot read) misleads
                res["ok"], res["why"] = "warning:" not in err, f"pre-flight warns: {err[-2000:]}"
            elif r == 2 and ("policy.model: no config.json" in err
                             or ("distillation.teacher=" in err and ": no config.json" in err)):
                # the user's own model (or distillation teacher, made by an earlier command), absent here: the
                # config and the overrides alone
                cfg, overrides = args[0], [a for a in args[1:] if "=" in a]
                stages = [(st.config, st.overrides) for st in load_stages(cfg)] if is_chain(cfg) else [(cfg, [])]
                from megatron_rl.config.preflight import answer_format_mismatch
                res["ok"] = True
                for path, extra in stages:
                    c = load_config(path, extra + overrides, check_model=False)
                    warn = answer_format_mismatch(c.data, c.reward) if c.algorithm == "grpo" else None
                    if warn:  # the pre-flight the run would start with warns
                        res["ok"], res["why"] = False, f"pre-flight would warn: {warn}"
            else:
                res["why"] = f"dry run: {r!r}: {err[-2000:]}"
        else:
            res["why"] = f"unknown megatron-rl subcommand {job.get('sub')!r}"
    except BaseException as e:
        res["why"] = "".join(traceback.format_exception(e))[-2000:]
    results.append(res)
json.dump(results, open(out_file, "w"))
'''.replace("RUN_FULLY", repr(sorted(RUN_FULLY)))


def test_docs_exist():
    assert (ROOT / "docs").is_dir() and len(DOCS) > 5
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_readme_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "bash launch/demo_cpu.sh" in readme and "bash launch/run_tests.sh" in readme
    assert "bash launch/run_tests.sh" in (ROOT / ".ci" / "run").read_text()


def test_every_quoted_command_parses():
    jobs = quoted_commands()
    kinds = {j["kind"] for j in jobs}
    assert {"train", "tool", "script", "synopsis", "code"} <= kinds, kinds  # the reader still finds commands
    with tempfile.TemporaryDirectory(prefix="test_docs-") as tmp:
        jobs_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "results.json"
        jobs_file.write_text(json.dumps(jobs))
        (Path(tmp) / "t").mkdir()
        env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(jobs_file), str(out_file), str(Path(tmp) / "t")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert out_file.exists(), f"runner died (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        results = json.loads(out_file.read_text())
    bad = [f"{r['where']}: {r['text']}\n    {r['why']}" for r in results if not r["ok"]]
    assert not bad, "commands quoted in the docs that do not parse:\n" + "\n".join(bad)


# -------------------------------------------------------------------------------------------------------- paths

TOP = r"(?:megatron_rl|kernels|launch|configs|bench|tests|examples|docs|\.ci)"
REPO_PATH = re.compile(rf"(?<![\w./-]){TOP}/[\w./{{}},*-]*[\w*}}]")
MODULE_PATH = re.compile(r"(?<![\w./-])(?:algorithms|config|data|distributed|generation|models|policy|rewards|testing"
                         r"|weights)/[\w/]+\.py\b")
BARE_TEST = re.compile(r"(?<![\w./-])test_\w+\.py\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def expand_braces(p: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", p)
    if not m:
        return [p]
    return [q for alt in m.group(1).split(",") for q in expand_braces(p[:m.start()] + alt + p[m.end():])]


def slugs(md: str) -> set[str]:
    """GitHub's heading anchors."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in md.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def missing_paths(doc: Path, text: str) -> list[str]:
    bad = []
    for p in sorted(set(REPO_PATH.findall(text))):
        for q in expand_braces(p):
            if not glob.glob(str(ROOT / q)):
                bad.append(q)
    for p in sorted(set(MODULE_PATH.findall(text))):
        if not ((ROOT / "megatron_rl" / p).exists() or (ROOT / p).exists()):
            bad.append(p)
    for p in sorted(set(BARE_TEST.findall(text))):
        if not glob.glob(str(ROOT / "tests" / "**" / p), recursive=True):
            bad.append(p)
    for target in sorted(set(LINK.findall(text))):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest.read_text()):
            bad.append(f"{target} (no such heading)")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_named_path_exists(doc):
    bad = missing_paths(doc, doc.read_text())
    assert not bad, f"{doc.relative_to(ROOT)} names paths that do not exist: {bad}"


def test_the_path_check_sees_a_missing_file():
    assert missing_paths(ROOT / "README.md", "see `bench/no_such_bench.py` and [x](docs/nowhere.md#a)") == [
        "bench/no_such_bench.py", "docs/nowhere.md", "docs/nowhere.md#a"]
    assert missing_paths(ROOT / "README.md", "`policy/offload.py`, `configs/deepscaler_1.5b_{8k,16k}.yaml`") == []
