"""The offline demo: two tiny agents learn to meet at the same place without talking.

The game (a coordination game, played once per dataset item): two of four places are open in
a city, and each agent sees them in its own order::

    alice sees:  "alice is in paris . the park and the cafe are open . where will you meet bob ?"
    bob sees:    "bob is in paris . the cafe and the park are open . where will you meet alice ?"

Each agent answers with a word. The team scores 1.0 when both name the *same open* place;
there is a smaller shared bonus of 0.25 for each agent that names an open place at all, so that
random models find the answer vocabulary. Matching is only possible together, and each pair of
open places has two equally good answers: the agents must read their observation and settle on
a convention (say, "the museum whenever it is open") that neither can impose alone. Random
models succeed well under 1% of the time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from comarl.envs import Env, FunctionEnv

CITIES = ("paris", "tokyo", "cairo", "lima", "oslo", "delhi")
PLACES = ("cafe", "park", "museum", "station")
NAMES = ("alice", "bob")
VALID_BONUS = 0.25
DEMO_STEPS = 300


def first_word(text: str) -> str:
    """The answer: the first word of a completion, lower-cased, without punctuation."""
    for word in text.lower().split():
        word = word.strip(".,!?;:\"'")
        if word:
            return word
    return ""


def meeting_reward(
    alice: Sequence[str], bob: Sequence[str], open_places: Sequence[Sequence[str]], **_: Any
) -> list[float]:
    """Shared reward per joint action: 1.0 for the same open place, else 0.25 per agent naming an open place."""
    rewards = []
    for a, b, places in zip(alice, bob, open_places):
        wa, wb = first_word(a), first_word(b)
        if wa == wb and wa in places:
            rewards.append(1.0)
        else:
            rewards.append(VALID_BONUS * ((wa in places) + (wb in places)))
    return rewards


def formatter(agent: int):  # noqa: ANN201
    """Agent ``agent``'s view of an item: bob lists the open places in the opposite order."""
    me, partner = NAMES[agent], NAMES[1 - agent]

    def view(item: dict[str, Any]) -> str:
        first, second = item["open_places"] if agent == 0 else item["open_places"][::-1]
        return f"{me} is in {item['city']} . the {first} and the {second} are open . where will you meet {partner} ?"

    return view


def dataset(cities: Sequence[str] = CITIES) -> list[dict[str, Any]]:
    """One item per city and pair of open places (6 x 6 = 36)."""
    return [
        {"city": city, "open_places": list(pair)}
        for city in cities
        for pair in itertools.combinations(PLACES, 2)
    ]


# ----------------------------------------------------------------------------- `comarl eval --task demo`


def load_items(split: str = "eval", source: str = "local") -> list[dict[str, Any]]:
    """The game's 36 items for either split (the demo trains and evaluates on every item), each with an ``id``
    such as ``"paris/cafe+park"``; ``source`` must be "local"."""
    if split not in ("train", "eval"):
        raise ValueError(f"load_items: split={split!r}; choose 'train' or 'eval'")
    if source != "local":
        raise ValueError(f"load_items: source={source!r}; the demo's items are 'local' only")
    return [{**item, "id": f"{item['city']}/{'+'.join(item['open_places'])}"} for item in dataset()]


def make_env(num_agents: int = 2, num_turns: int = 1) -> Env:
    """The game as an environment: alice and bob answer once; :func:`meeting_reward` scores them, and an
    episode succeeds when they meet (reward 1.0)."""
    if num_agents != 2 or num_turns != 1:
        raise ValueError(
            f"num_agents={num_agents}, num_turns={num_turns}: the meeting game is one turn of two agents"
        )
    return FunctionEnv(
        meeting_reward, [formatter(0), formatter(1)], 2, reward_call="batched", success_threshold=1.0
    )


def pipeline_prompt(item: dict[str, Any], first_completion: str) -> str:
    """Bob's prompt when he hears alice's answer first (the pipeline baseline): his view, then
    ``"alice meets at the <her answer> ."`` (words his tokenizer knows, from :func:`corpus`)."""
    return f"{formatter(1)(item)} alice meets at the {first_word(first_completion)} ."


def corpus() -> list[str]:
    """Local text the demo tokenizers are trained on: every prompt and every possible answer."""
    lines = [formatter(i)(item) for i in range(2) for item in dataset()]
    lines += [f"{name} meets at the {place} ." for name in NAMES for place in PLACES]
    return lines


def build_team(base_dir: str | Path, seed: int = 0, texts: Sequence[str] | None = None) -> list[Path]:
    """Two different tiny architectures (Llama and GPT-2), random weights, word-level tokenizers trained on
    ``texts`` (default: this game's ``corpus()``), saved to disk."""
    from comarl.tiny import tiny_model

    texts = corpus() if texts is None else list(texts)
    alice, bob = team_folders(base_dir)
    return [
        tiny_model(alice, texts=texts, kind="word", arch="llama", seed=seed),
        tiny_model(bob, texts=texts, kind="word", arch="gpt2", seed=seed + 1),
    ]


def team_folders(base_dir: str | Path) -> list[Path]:
    """Where :func:`build_team` puts the two agents."""
    return [Path(base_dir) / "alice-llama", Path(base_dir) / "bob-gpt2"]


def demo_config(
    output_dir: str | Path | None, max_steps: int = 120, seed: int = 0, progress_bar: bool = True
):  # noqa: ANN201
    """The demo's training settings (cross joint actions, batched reward calls)."""
    from comarl.config import MAGRPOConfig

    return MAGRPOConfig(
        max_steps=max_steps,
        prompts_per_step=6,
        num_generations=12,
        joint_mode="cross",
        max_new_tokens=3,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        reward_call="batched",
        success_threshold=1.0,
        seed=seed,
        output_dir=None if output_dir is None else str(output_dir),
        progress_bar=progress_bar,
        log_completions=3,
        eval_interval=25,
    )


def demo_trainer(trainer_cls: Any, paths: Sequence[str | Path], args: Any) -> Any:
    """``trainer_cls`` on the game: the team at ``paths``, every item for training and evaluation."""
    return trainer_cls(
        agents=[str(p) for p in paths],
        train_dataset=dataset(),
        eval_dataset=dataset(),
        reward_func=meeting_reward,
        formatters=[formatter(0), formatter(1)],
        args=args,
    )


def run_demo(
    trainer_cls: Any,
    out: str | Path | None = None,
    max_steps: int = DEMO_STEPS,
    seed: int = 0,
    progress_bar: bool = True,
) -> dict[str, Any]:
    """Build the tiny team, measure it, train it with ``trainer_cls`` (MAGRPOTrainer for ``comarl demo``), measure
    again; write everything into a run folder."""
    import torch

    # Models this small are faster on one thread: synchronising threads costs more than the work. The caller's
    # thread count (a notebook's, a library user's) comes back when the demo returns or raises.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_demo(trainer_cls, out, max_steps, seed, progress_bar)
    finally:
        torch.set_num_threads(threads)


def _run_demo(
    trainer_cls: Any, out: str | Path | None, max_steps: int, seed: int, progress_bar: bool
) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    from comarl.engines import SamplingParams

    hf_logging.disable_progress_bar()
    run_dir = Path(out) if out is not None else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = build_team(run_dir / "base_models", seed=seed)
    trainer = demo_trainer(trainer_cls, paths, demo_config(run_dir, max_steps, seed, progress_bar))
    before = trainer.evaluate(do_sample=True, num_generations=8)  # the untrained team's chance level
    trainer.train()
    after = trainer.evaluate()  # greedy: the conventions the team actually uses
    conventions, greedy = {}, SamplingParams(max_new_tokens=3, do_sample=False)
    for item in dataset(CITIES[:1]):
        answers = [
            trainer.engine.generate(agent, [formatter(i)(item)], 1, greedy).completions[0]
            for i, agent in enumerate(trainer.team)
        ]
        conventions[" / ".join(item["open_places"])] = [first_word(a) for a in answers]
    return {
        "run_dir": str(run_dir),
        "success_before": before["eval/success"],
        "success_after": after["eval/success"],
        "reward_before": before["eval/reward"],
        "reward_after": after["eval/reward"],
        "conventions": conventions,
    }
