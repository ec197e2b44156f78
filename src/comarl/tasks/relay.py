"""A two-turn coordination game: the second turn's observation depends on the first joint answer.

Only alice knows which two places are open; bob does not::

    turn 1   alice: "alice is in paris . the park and the cafe are open . where will you meet bob ?"
             bob:   "bob is in paris . where will you meet alice ?"

If they named the same open place the episode ends. Otherwise each hears what the other said::

    turn 2   alice: "bob said museum . the park and the cafe are open . where will you meet bob ?"
             bob:   "alice said park . where will you meet alice ?"

The joint answer is scored as in the demo (1.0 for the same open place, 0.25 per agent naming an
open place), and the score is paid once, when the episode ends (``relay_reward``): a miss at turn 1
pays nothing and turn 2 pays its score, so missing first never returns more than matching at once
(1.0 for both with ``discount=1``, less for the miss with ``discount < 1``). In one turn bob can only
guess (about half of the items at best); over two turns the team can always succeed, e.g. alice
names an open place and bob repeats what alice said. A single-turn trainer never sees turn 2 (its
one-turn episodes are paid ``meeting_reward``, the score at their end); the multi-turn trainer
learns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from comarl.envs import History
from comarl.tasks import demo
from comarl.tasks.demo import CITIES, PLACES, dataset, first_word, meeting_reward

__all__ = [
    "dataset",
    "formatter",
    "relay_transition",
    "relay_reward",
    "meeting_reward",
    "corpus",
    "build_team",
]


def formatter(agent: int):  # noqa: ANN201
    """Turn-1 view: alice sees the open places, bob only the city."""

    def view(item: dict[str, Any]) -> str:
        if agent == 0:
            first, second = item["open_places"]
            return f"alice is in {item['city']} . the {first} and the {second} are open . where will you meet bob ?"
        return f"bob is in {item['city']} . where will you meet alice ?"

    return view


def relay_transition(item: dict[str, Any], completions: Sequence[str], history: History) -> list[str] | None:
    """End the episode on a match; otherwise tell each agent what the other said."""
    a, b = first_word(completions[0]), first_word(completions[1])
    if a == b and a in item["open_places"]:
        return None
    first, second = item["open_places"]
    return [
        f"bob said {b or 'nothing'} . the {first} and the {second} are open . where will you meet bob ?",
        f"alice said {a or 'nothing'} . where will you meet alice ?",
    ]


def relay_reward(
    alice: Sequence[str],
    bob: Sequence[str],
    open_places: Sequence[Sequence[str]],
    prompts: Sequence[Sequence[str]],
    **_: Any,
) -> list[float]:
    """The game's score (``meeting_reward``), paid once, when the two-turn episode ends: a match ends it at either
    turn (1.0); a miss at turn 1 pays nothing, and turn 2 (alice's prompt reports "bob said ...") pays its score.
    Paying the score at every turn made missing first (0.5 + 1.0) worth more than matching at once (1.0)."""
    scores = meeting_reward(alice, bob, open_places)
    return [s if s == 1.0 or p.startswith("bob said ") else 0.0 for s, p in zip(scores, prompts[0])]


def corpus() -> list[str]:
    """Every prompt of both turns, for the tokenizers."""
    lines = []
    for item in dataset():
        lines += [formatter(0)(item), formatter(1)(item)]
        for said in (*PLACES, "nothing"):
            lines += relay_transition(item, [said, "x"], History.empty(2)) or []
    lines += [f"meet at the {place} ." for place in PLACES] + [f"{city} ." for city in CITIES]
    return lines


def build_team(base_dir: str | Path, seed: int = 0) -> list[Path]:
    """The demo's two tiny models (Llama and GPT-2), with tokenizers trained on this game's text."""
    return demo.build_team(base_dir, seed, texts=corpus())
