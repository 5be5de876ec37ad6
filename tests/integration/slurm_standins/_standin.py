"""Helpers shared by the Slurm stand-ins (srun, sbatch, scontrol) used to test launch/slurm_grpo.sh on one machine.

Every "node" of a stand-in job is this machine; a step on a node is a local process. What the stand-ins keep from
Slurm is what the launcher relies on: hostlist expansion, per-node steps with their own output files, signal
forwarding, and killing whatever a step leaves behind when it ends (Slurm does that with the step's cgroup).
"""
from __future__ import annotations

import re
import sys


def expand_hostlist(spec: str) -> list[str]:
    """'n[1-3,7],gpu01' -> ['n1', 'n2', 'n3', 'n7', 'gpu01'] (one bracket group per name, zero padding kept)."""
    names: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", spec):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not ranges:
            names.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hi = hi or lo
            width = len(lo) if lo.startswith("0") else 0
            names.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
    return names


def parse_options(argv: list[str], with_value: set[str], flags: set[str], aliases: dict[str, str],
                  prog: str) -> tuple[dict[str, str], list[str]]:
    """Slurm-style options up to the first non-option word; unknown options fail loudly (the launcher's bug)."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        word = argv[i]
        name, eq, value = word.partition("=")
        name = aliases.get(name, name)
        if name in flags:
            opts[name] = "1"
        elif name in with_value:
            if not eq:
                i += 1
                value = argv[i]
            opts[name] = value
        else:
            sys.exit(f"{prog} (stand-in): unsupported option {word!r}")
        i += 1
    return opts, argv[i:]
