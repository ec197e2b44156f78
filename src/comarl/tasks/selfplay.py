"""Self-play: a hider and a seeker play ``rounds`` rounds (3 by default); the environment keeps the score.

A competitive Dec-POMDP with per-agent rewards, written as an ``Env`` subclass::

    hider:  "round 1 . score hider 0 seeker 0 . hide in a place :"
    seeker: "round 1 . score hider 0 seeker 0 . where is the hider ?"

Each round the hider names a place (a word from ``PLACES``) and the seeker guesses one. The
seeker scores when it names the hider's place; the hider scores when it hides in a real place and
is not found. Every round is played and pays its own rewards; there is no match winner. The score
is the environment's state: it changes the next round's observations, and every branch of the
rollout tree keeps its own copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from comarl.envs import Env, StepResult
from comarl.tasks.demo import PLACES, first_word

MAX_ROUNDS = 9  # the numbers corpus() teaches the tiny team's word-level tokenizers


class HideAndSeek(Env):
    """``rounds`` rounds per episode: the environment's own turn limit (``num_turns``), which the trainer's
    ``num_turns`` must equal."""

    num_agents = 2

    def __init__(self, rounds: int = 3) -> None:
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
            raise ValueError(
                f"HideAndSeek: rounds={rounds!r}: choose an integer from 1 to {MAX_ROUNDS} (the tiny team's "
                "vocabulary, corpus(), has the round and score numbers up to that)"
            )
        self.rounds = rounds
        self.num_turns = rounds
        self.round = 1
        self.score = [0, 0]

    def reset(self, item: dict[str, Any]) -> list[str]:
        self.round, self.score = 1, [0, 0]
        return self.observations()

    def observations(self) -> list[str]:
        state = f"round {self.round} . score hider {self.score[0]} seeker {self.score[1]} ."
        return [f"{state} hide in a place :", f"{state} where is the hider ?"]

    def step(self, joint_action: Sequence[str]) -> StepResult:
        hide, seek = first_word(joint_action[0]), first_word(joint_action[1])
        found = hide in PLACES and seek == hide
        hidden = hide in PLACES and not found
        self.score[0] += hidden
        self.score[1] += found
        self.round += 1
        done = self.round > self.rounds
        return StepResult(
            rewards=[float(hidden), float(found)],
            done=done,
            observations=None if done else self.observations(),
            info={"score": list(self.score)},
        )


def dataset(games: int = 4) -> list[dict[str, int]]:
    """Self-play needs no data: one item per game."""
    return [{"game": g} for g in range(games)]


def corpus() -> list[str]:
    """Every observation of games up to ``MAX_ROUNDS`` rounds (at round r the scores sum to at most r - 1)."""
    lines = []
    for r in range(1, MAX_ROUNDS + 1):
        for h in range(r):
            for s in range(r - h):
                state = f"round {r} . score hider {h} seeker {s} ."
                lines += [f"{state} hide in a place :", f"{state} where is the hider ?"]
    return lines + [f"the {place} ." for place in PLACES]


def build_team(base_dir: str | Path, seed: int = 0) -> list[Path]:
    from comarl.tiny import tiny_model

    base = Path(base_dir)
    return [
        tiny_model(base / "hider", texts=corpus(), kind="word", arch="llama", seed=seed),
        tiny_model(base / "seeker", texts=corpus(), kind="word", arch="llama", seed=seed + 1),
    ]
