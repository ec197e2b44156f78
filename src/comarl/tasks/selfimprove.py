"""Self-improvement: one agent revises its own previous answer from the environment's feedback.

    turn 1: "which place is open in paris ?"
    turn 2: "you said museum . the museum is closed . the park and the cafe are open . which place is open ?"

The agent cannot know the answer at turn 1; the feedback on its own answer makes turn 2
solvable. A single agent (``num_agents=1``) with a ``transition``: GRPO over a tree of turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from comarl.envs import History
from comarl.tasks.demo import CITIES, PLACES, dataset, first_word

__all__ = ["dataset", "formatter", "open_place_reward", "revise_transition", "corpus", "build_agent"]


def formatter(item: dict[str, Any]) -> str:
    return f"which place is open in {item['city']} ?"


def open_place_reward(completions: Sequence[str], open_places: Sequence[Sequence[str]]) -> list[float]:
    """1.0 when the answer is an open place."""
    return [float(first_word(c) in places) for c, places in zip(completions, open_places)]


def revise_transition(item: dict[str, Any], completions: Sequence[str], history: History) -> list[str] | None:
    """Done when right; otherwise feedback on the agent's own last answer (``history`` holds it)."""
    said = first_word(history.responses[0][-1]) or "nothing"
    if said in item["open_places"]:
        return None
    first, second = item["open_places"]
    return [
        f"you said {said} . the {said} is closed . the {first} and the {second} are open . which place is open ?"
    ]


def corpus() -> list[str]:
    lines = [formatter(item) for item in dataset()]
    for item in dataset(CITIES[:1]):
        for said in (*PLACES, "nothing"):
            lines += revise_transition(item, [said], History([[""]], [[said]])) or []
    return lines + [f"the {place} ." for place in PLACES]


def build_agent(base_dir: str | Path, seed: int = 0) -> Path:
    from comarl.tiny import tiny_model

    return tiny_model(Path(base_dir) / "reviser", texts=corpus(), kind="word", arch="llama", seed=seed)
