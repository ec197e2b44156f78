"""The parts import one another only as DESIGN.md's "knows nothing of" column allows (lazy imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import comarl

PACKAGE = Path(comarl.__file__).parent

# part -> the parts (and third-party modules) it must never import, from DESIGN.md's table of parts.
FORBIDDEN = {
    "config": {"torch"},
    "agents": {"envs", "rollout"},
    "engines": {"algorithms"},
    "llama_decoder": {"*"},  # engines' decode step: torch and transformers only
    "envs": {"agents", "engines"},
    "rollout": {"trainers"},
    "algorithms": {
        "agents",
        "engines",
        "envs",
        "rollout",
        "trainers",
        "tracking",
        "checkpoint",
        "distributed",
    },
    "distributed": {"algorithms"},
    "tasks": {"trainers"},
    "sandbox": {"*"},
    "tracking": {"algorithms"},
    "checkpoint": {"envs"},
}


def imported(path: Path) -> set[str]:
    """What ``path`` imports, anywhere in it: comarl's parts by name ('engines', 'tasks'), others by top module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        for module in modules:
            parts = module.split(".")
            names.add(parts[1] if parts[0] == "comarl" and len(parts) > 1 else parts[0])
    return names


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE).with_suffix("")
    return relative.parts[0]


def test_no_part_imports_what_the_design_keeps_it_from():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(path)
        uses = imported(path)
        if part != "__main__" and "cli" in uses:
            broken.append(f"{path.relative_to(PACKAGE)} imports cli")
        forbidden = FORBIDDEN.get(part, set())
        ours = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("_")}
        bad = sorted(uses & (ours if "*" in forbidden else forbidden))
        if bad:
            broken.append(f"{path.relative_to(PACKAGE)} imports {bad}")
    assert broken == []
