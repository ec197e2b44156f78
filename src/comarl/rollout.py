"""Rollouts: environments + engines -> completions, joint actions, rewards and per-completion returns."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from comarl.agents import Agent
from comarl.algorithms import cross_returns
from comarl.engines import Generation, HFEngine, SamplingParams
from comarl.envs import Env, StepResult


@dataclass
class Rollout:
    """One step's experience for ``B`` items, ``N`` agents, ``G`` samples per agent, ``K`` joint actions per item.

    ``generations[i]`` holds agent i's ``B*G`` completions (item-major). ``joint_index[b, k, i]`` is
    which of agent i's G completions joint action ``k`` of item ``b`` used; ``rewards[b, k, i]`` is
    what agent i received for it; ``returns[i][b, j]`` is the return credited to completion ``j``.
    """

    generations: list[Generation]
    joint_index: torch.Tensor
    rewards: torch.Tensor
    returns: list[torch.Tensor]
    success: torch.Tensor | None
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    results: list[list[StepResult]] = field(default_factory=list)


def joint_action_indices(
    num_generations: int,
    num_agents: int,
    mode: str,
    max_joint_actions: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Joint actions as ``[K, N]`` indices into each agent's G completions.

    - ``aligned``: K = G, joint action j = (j, j, ..., j).
    - ``cross``:   K = G^N, every combination; with ``max_joint_actions = M`` (< G^N) the G aligned
      ones plus M - G others drawn uniformly without replacement, so every completion is credited.
    """
    G, N = num_generations, num_agents
    aligned = torch.arange(G).unsqueeze(1).expand(G, N)
    if mode == "aligned" or N == 1:
        return aligned.clone()
    if mode != "cross":
        raise ValueError(f"joint_action_indices: unknown mode {mode!r}; use 'aligned' or 'cross'")
    total = G**N
    if max_joint_actions is None or max_joint_actions >= total:
        return torch.tensor(list(itertools.product(range(G), repeat=N)))
    # Number each combination in base G; the aligned ones are j * (G^N - 1) / (G - 1).
    diagonal = {j * (total - 1) // (G - 1) for j in range(G)} if G > 1 else {0}
    wanted = max_joint_actions - len(diagonal)
    if total <= 1 << 16:
        others = torch.tensor([c for c in range(total) if c not in diagonal])
        chosen = others[torch.randperm(len(others), generator=generator)[:wanted]].tolist()
    else:  # too many to list: rejection sampling, fine since wanted << total here
        picked: set[int] = set()
        while len(picked) < wanted:
            c = int(torch.randint(total, (1,), generator=generator))
            if c not in diagonal:
                picked.add(c)
        chosen = sorted(picked)
    codes = sorted(diagonal) + chosen
    powers = G ** torch.arange(N - 1, -1, -1)
    return (torch.tensor(codes).unsqueeze(1) // powers) % G


def generate_all(
    engine: HFEngine,
    agents: Sequence[Agent],
    prompts: Sequence[Sequence[Any]],
    num_generations: int,
    params: SamplingParams,
    pool: Any = None,
) -> list[Generation]:
    """One batched generate per agent; concurrent when a thread pool is given (agents on separate devices)."""
    jobs = [(agent, prompts[i]) for i, agent in enumerate(agents)]
    if pool is None:
        return [engine.generate(a, p, num_generations, params) for a, p in jobs]
    futures = [pool.submit(engine.generate, a, p, num_generations, params) for a, p in jobs]
    return [f.result() for f in futures]


def collect(
    env: Env,
    agents: Sequence[Agent],
    items: Sequence[Any],
    *,
    engine: HFEngine,
    num_generations: int,
    params: SamplingParams,
    joint_mode: str = "aligned",
    max_joint_actions: int | None = None,
    generator: torch.Generator | None = None,
    pool: Any = None,
    on_generated: Callable[[], None] | None = None,
) -> Rollout:
    """Play one turn on every item: reset, generate for each agent, form joint actions, step, credit returns."""
    N, G, B = len(agents), num_generations, len(items)
    episodes = [copy.copy(env) for _ in items]
    observations = [ep.reset(item) for ep, item in zip(episodes, items)]
    for b, obs in enumerate(observations):
        if len(obs) != N:
            raise ValueError(
                f"{type(env).__name__}.reset returned {len(obs)} observations for {N} agents (item {b})"
            )
    generations = generate_all(
        engine, agents, [[obs[i] for obs in observations] for i in range(N)], G, params, pool
    )
    if on_generated is not None:
        on_generated()

    joint_index = torch.stack(
        [joint_action_indices(G, N, joint_mode, max_joint_actions, generator) for _ in range(B)]
    )  # [B, K, N]
    actions = [
        [[generations[i].completions[b * G + int(joint[i])] for i in range(N)] for joint in joint_index[b]]
        for b in range(B)
    ]
    results = env.step_many(episodes, actions)
    rewards = torch.tensor([[r.rewards for r in row] for row in results], dtype=torch.float32)  # [B, K, N]
    if rewards.shape[-1] != N:
        raise ValueError(f"{type(env).__name__}.step returned {rewards.shape[-1]} rewards for {N} agents")
    flags = [[r.info.get("success") for r in row] for row in results]
    success = None
    if all(f is not None for row in flags for f in row):
        success = torch.tensor(flags, dtype=torch.float32)
    names = {name for row in results for r in row for name in r.components}
    components = {
        name: torch.tensor([[r.components.get(name, float("nan")) for r in row] for row in results])
        for name in sorted(names)
    }
    returns = [
        torch.stack([cross_returns(rewards[b, :, i], joint_index[b, :, i], G) for b in range(B)])
        for i in range(N)
    ]  # each [B, G]
    return Rollout(generations, joint_index, rewards, returns, success, components, results)
