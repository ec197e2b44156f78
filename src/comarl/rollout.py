"""Rollouts: environments + engines -> completions, joint actions, rewards and per-completion returns."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from comarl.agents import Agent
from comarl.algorithms import cross_returns
from comarl.engines import Engine, Generation, SamplingParams, concat_generations, stream_seed
from comarl.envs import Env, StepResult, short_repr

if TYPE_CHECKING:
    from comarl.distributed import AgentParallel, Processes


@dataclass
class Rollout:
    """One step's experience: a tree of turns per item, ``N`` agents, ``G`` samples, ``K`` joint actions per node.

    Nodes are listed turn by turn (the ``B`` roots first, in item order). At node ``n`` every agent
    sampled G completions; ``generations[i]`` holds agent i's completions of every node, node-major
    (row ``n * G + j``). ``joint_index[n, k, i]`` is which completion of agent i joint action ``k``
    used; ``rewards[n, k, i]`` the immediate reward agent i got for it; ``node_returns[n, k, i]``
    its discounted return; ``returns[i][n, j]`` the return credited to completion ``j`` of node ``n``.
    """

    generations: list[Generation]
    joint_index: torch.Tensor
    rewards: torch.Tensor
    returns: list[torch.Tensor]
    node_returns: torch.Tensor
    depth: torch.Tensor  # [num_nodes]: the turn of each node (0 = the item's first turn)
    terminal: torch.Tensor  # [num_nodes, K]: the joint action has no child
    child: torch.Tensor  # [num_nodes, K]: the node the joint action leads to (-1: none)
    # [num_nodes, K]: the episode ended there (the environment said so, or early termination)
    done: torch.Tensor
    # [num_nodes, K]: 1/0 where the episode ended, NaN where it goes on; None when the env reports no success
    success: torch.Tensor | None
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    generate_seconds: float = 0.0  # time spent in generate, all turns
    num_turns: int = 1  # the turn limit it was played with
    # Each node's state before its agents acted: (the branch's environment, the observations).
    states: list[tuple[Env, list[Any]]] = field(default_factory=list, repr=False)


@dataclass
class _Node:
    item: int
    depth: int
    episode: Env
    observations: list[Any]
    parent: tuple[int, int] | None  # (parent node, joint action index)
    seed: int | None = None  # the node's sampling streams derive from it (collect's seeds)


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
    engine: Engine,
    agents: Sequence[Agent],
    prompts: Sequence[Sequence[Any]],
    num_generations: int,
    params: Sequence[SamplingParams],
    pool: Any = None,
    parallel: AgentParallel | None = None,
    seeds: Sequence[Sequence[int]] | None = None,
) -> list[Generation]:
    """One batched generate per agent, agent i sampling by ``params[i]`` (from the streams ``seeds[i]``, one per
    prompt, when given): concurrent in threads when a pool is given (agents on separate devices), or one agent per
    process when ``parallel`` is given (``comarl.distributed``)."""
    if parallel is not None:
        return parallel.generate_all(engine, agents, prompts, num_generations, params, seeds)
    jobs = [
        (agent, prompts[i], params[i], None if seeds is None else seeds[i]) for i, agent in enumerate(agents)
    ]
    if pool is None:
        return [engine.generate(a, p, num_generations, sp, s) for a, p, sp, s in jobs]
    futures = [pool.submit(engine.generate, a, p, num_generations, sp, s) for a, p, sp, s in jobs]
    return [f.result() for f in futures]


def independent_episodes(
    items: Sequence[Any], seeds: Sequence[int] | None, count: int
) -> tuple[list[Any], list[int] | None]:
    """``count`` single-path episodes of each item, as multi-turn evaluation plays them (not a tree): the items
    repeated, episode e of an item seeded with ``stream_seed(its seed, e)`` (None: no seeds)."""
    repeated = [item for item in items for _ in range(count)]
    return repeated, None if seeds is None else [stream_seed(seed, e) for seed in seeds for e in range(count)]


def agent_seed(node_seed: int, agent: int) -> int:
    """The stream ``agent`` draws a node's completions from: keys (node seed, 0, agent), apart from its children's
    node seeds (node seed, 1, joint action) and its :func:`pick_stream` (node seed, 2)."""
    return stream_seed(node_seed, 0, agent)


def pick_stream(node_seed: int) -> torch.Generator:
    """The stream a seeded node draws its scored joint actions (``max_joint_actions``) and its expanded branches
    (``max_children``) from, in that order: keys (node seed, 2)."""
    return torch.Generator().manual_seed(stream_seed(node_seed, 2))


def keep_in_step(
    shards: Processes | None,
    pending: bool,
    engine: Engine,
    agents: Sequence[Agent],
    placeholder: Sequence[Any],
    params: Sequence[SamplingParams],
    pool: Any = None,
    parallel: AgentParallel | None = None,
) -> bool:
    """Whether another turn is played: this process has ``pending`` episodes, or (``shards``: the processes that hold
    shares of the agents, ``shard_weights``) another shard has. Every generate call gathers the agents' layers from
    all shards, so a shard with nothing left answers ``placeholder`` (one prompt per agent) greedily with one token,
    and the turn goes on for the others."""
    if shards is None:
        return pending
    if not any(shards.gather(pending)):
        return False
    if not pending:
        quick = [dataclasses.replace(p, max_new_tokens=1, min_new_tokens=0, do_sample=False) for p in params]
        generate_all(engine, agents, [[prompt] for prompt in placeholder], 1, quick, pool, parallel)
    return True


def collect(
    env: Env,
    agents: Sequence[Agent],
    items: Sequence[Any],
    *,
    engine: Engine,
    num_generations: int,
    params: Sequence[SamplingParams],
    joint_mode: str = "aligned",
    max_joint_actions: int | None = None,
    num_turns: int = 1,
    max_children: int | None = None,
    discount: float = 1.0,
    backup: str = "mean",
    early_termination_threshold: float | None = None,
    generator: torch.Generator | None = None,
    pool: Any = None,
    parallel: AgentParallel | None = None,
    shards: Processes | None = None,
    seeds: Sequence[int] | None = None,
) -> Rollout:
    """Play every item as a tree of turns and credit each completion with its return.

    Turn by turn, every node of every item (siblings included) is generated in one batched call
    per agent, agent i sampling by ``params[i]``, from its own stream (``agent.generator``) or, with ``seeds``
    (one per item), from streams fixed by the item's seed, the node's place in its tree and the agent: an item's
    completions are then the same whatever other items share the call (evaluation at any batch size, training in
    any process layout). Which joint actions are scored (``joint_mode='cross'`` with ``max_joint_actions``) and
    which get children (``max_children``) are drawn from ``generator``, shared by the call's items, or with
    ``seeds`` from a stream of each node's own. Each node's joint actions go to the environment in one
    ``step_many``; a joint action whose episode is not done gets a child node for the next turn, unless the turn limit
    is reached, the node's mean team reward exceeds ``early_termination_threshold`` (off by
    default), or the branch is not among the ``max_children`` sampled for expansion.
    """
    N, G = len(agents), num_generations
    if seeds is not None and len(seeds) != len(items):
        raise ValueError(f"collect: {len(seeds)} seeds for {len(items)} items; pass one per item")
    roots = []
    for b, item in enumerate(items):
        episode = env.fork()  # each item's own state, even if reset changes attributes in place
        observations = episode.reset(item)
        if len(observations) != N:
            raise ValueError(
                f"{type(env).__name__}.reset returned {len(observations)} observations for {N} agents (item "
                f"{short_repr(item)})"
            )
        roots.append(_Node(b, 0, episode, list(observations), None, None if seeds is None else seeds[b]))

    nodes: list[_Node] = []
    level_generations: list[list[Generation]] = []
    joint_rows: list[torch.Tensor] = []
    results: list[list[StepResult]] = []
    terminated: list[int] = []  # nodes whose team reward passed early_termination_threshold
    children: dict[int, dict[int, int]] = {}
    generate_seconds = 0.0
    level = roots
    for depth in range(num_turns):
        if not keep_in_step(
            shards, bool(level), engine, agents, roots[0].observations, params, pool, parallel
        ):
            break
        if not level:  # another data shard still plays this turn
            continue
        started = time.perf_counter()
        gens = generate_all(
            engine,
            agents,
            [[n.observations[i] for n in level] for i in range(N)],
            G,
            params,
            pool,
            parallel,
            None if seeds is None else [[agent_seed(n.seed, i) for n in level] for i in range(N)],
        )
        generate_seconds += time.perf_counter() - started
        level_generations.append(gens)
        offset = len(nodes)
        nodes.extend(level)
        picks = [generator if n.seed is None else pick_stream(n.seed) for n in level]
        joints = [joint_action_indices(G, N, joint_mode, max_joint_actions, g) for g in picks]
        joint_rows.extend(joints)
        actions = [
            [[gens[i].completions[j * G + int(joint[i])] for i in range(N)] for joint in joints[j]]
            for j in range(len(level))
        ]
        level_results = env.step_many([n.episode for n in level], actions)
        _per_agent_rewards(env, level_results, [items[n.item] for n in level], depth, N)
        _check_same_outcomes(parallel, "rewards, done flags or next prompts", level_results)
        results.extend(level_results)
        next_level: list[_Node] = []
        for j, node in enumerate(level):
            row = level_results[j]
            if depth + 1 == num_turns:
                continue
            if _ends_early(row, early_termination_threshold, N):
                terminated.append(offset + j)  # its episodes end here: done, for returns and success
                continue
            open_actions = [k for k, r in enumerate(row) if not r.done]
            if max_children is not None and len(open_actions) > max_children:
                pick = torch.randperm(len(open_actions), generator=picks[j])[:max_children].tolist()
                open_actions = sorted(open_actions[p] for p in pick)
            for k in open_actions:
                result = row[k]
                if result.episode is None or result.observations is None or len(result.observations) != N:
                    raise ValueError(
                        f"{type(env).__name__}.step / step_many: a result that is not done needs .episode (the "
                        f"branch's environment) and {N} next observations"
                    )
                children.setdefault(offset + j, {})[k] = len(nodes) + len(next_level)
                seed = None if node.seed is None else stream_seed(node.seed, 1, k)
                next_level.append(
                    _Node(
                        node.item, depth + 1, result.episode, list(result.observations), (offset + j, k), seed
                    )
                )
        level = next_level

    rewards = torch.tensor(
        [[r.rewards for r in row] for row in results], dtype=torch.float32
    )  # [num_nodes, K, N]
    joint_index = torch.stack(joint_rows)
    done = torch.tensor([[r.done for r in row] for row in results])
    done[terminated] = True
    node_returns, returns = credited_returns(rewards, done, children, joint_index, G, discount, backup)
    child = torch.full(done.shape, -1, dtype=torch.long)
    for n, kids in children.items():
        for k, c in kids.items():
            child[n, k] = c
    terminal = child < 0
    depth = torch.tensor([n.depth for n in nodes])
    success = episode_success(results, done | (depth == num_turns - 1).unsqueeze(1))
    names = sorted({name for row in results for r in row for name in r.components})
    components = {
        name: torch.tensor([[r.components.get(name, float("nan")) for r in row] for row in results])
        for name in names
    }
    generations = [
        concat_generations([gens[i] for gens in level_generations], agents[i].tokenizer.pad_token_id)
        for i in range(N)
    ]
    return Rollout(
        generations,
        joint_index,
        rewards,
        returns,
        node_returns,
        depth=depth,
        terminal=terminal,
        child=child,
        done=done,
        success=success,
        components=components,
        generate_seconds=generate_seconds,
        num_turns=num_turns,
        states=[(n.episode, n.observations) for n in nodes],
    )


def _per_agent_rewards(
    env: Env, results: Sequence[Sequence[StepResult]], items: Sequence[Any], depth: int, num_agents: int
) -> None:
    """Every result of one turn (``results[e]`` for the episode on ``items[e]``) with one reward per agent
    (:func:`_per_agent_reward`)."""
    for item, row in zip(items, results):
        for result in row:
            _per_agent_reward(env, result, num_agents, f"item {short_repr(item)}, turn {depth + 1}")


def _per_agent_reward(env: Env, result: StepResult, num_agents: int, where: str) -> None:
    """``result.rewards`` as one float per agent: a joint reward (one for the team) is every agent's. Every reward
    must be a finite number (a tensor's values too), not a bool: an environment's rewards are checked as a reward
    function's are."""
    rewards = result.rewards.tolist() if hasattr(result.rewards, "tolist") else result.rewards
    if not isinstance(rewards, Sequence) or isinstance(rewards, str):
        rewards = [rewards]
    values = []
    for r in rewards:
        try:
            value = math.nan if isinstance(r, (bool, str)) else float(r)
        except (TypeError, ValueError):  # not a number at all
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(
                f"{type(env).__name__}.step returned reward {short_repr(r)} ({where}): rewards must be finite "
                "numbers, not bools; return float(...) of a condition"
            )
        values.append(value)
    if len(values) not in (1, num_agents):
        raise ValueError(
            f"{type(env).__name__}.step returned {len(values)} rewards for {num_agents} agents ({where}): "
            "return one reward per agent, or one for the team"
        )
    result.rewards = values * num_agents if len(values) == 1 else values


def episode_success(results: Sequence[Sequence[StepResult]], ended: torch.Tensor) -> torch.Tensor | None:
    """``[num_nodes, K]``: 1.0 / 0.0 for the joint actions whose episode ended there (``ended``) by their
    ``info["success"]``, NaN for those whose episode goes on; None when no result reports success.

    Success is an episode's outcome, so only the step that ends it counts: an environment may report the flag
    on that step alone. An ended episode without the flag did not succeed."""
    flags = [[r.info.get("success") for r in row] for row in results]
    if all(f is None for row in flags for f in row):
        return None
    success = torch.tensor([[float(bool(f)) for f in row] for row in flags])
    return torch.where(ended, success, torch.nan)


def _check_same_outcomes(
    parallel: AgentParallel | None, what: str, results: Sequence[Sequence[StepResult]]
) -> None:
    """Under agent parallelism every process steps its own copy of the environment: stop when the processes
    disagree on the rewards, on which episodes go on or on their next prompts (they would play different trees,
    and their collectives would pair up wrongly)."""
    if parallel is not None:
        parallel.check_same(what, [[(r.rewards, r.done, r.observations) for r in row] for row in results])


def _ends_early(results: Sequence[StepResult], threshold: float | None, num_agents: int) -> bool:
    """Whether a node's joint actions ``results`` end its episodes by ``early_termination_threshold``: their mean
    team reward (each one's mean over the agents) is above it."""
    if threshold is None:
        return False
    return sum(sum(r.rewards) / num_agents for r in results) / len(results) > threshold


def greedy_returns(
    env: Env,
    agents: Sequence[Agent],
    rollout: Rollout,
    *,
    engine: Engine,
    params: Sequence[SamplingParams],
    num_turns: int = 1,
    discount: float = 1.0,
    early_termination_threshold: float | None = None,
    pool: Any = None,
    parallel: AgentParallel | None = None,
    shards: Processes | None = None,
) -> tuple[torch.Tensor, float]:
    """The return of the team's greedy play from every node of ``rollout``: ``[num_nodes, N]`` (ReMax baseline).

    From node ``n`` at turn ``t`` every agent answers greedily (``params[i]`` with ``do_sample=False``),
    the environment steps, and the team goes on greedily until the episode is done, the turn limit, or (as the
    sampled episodes) a team reward above ``early_termination_threshold``:

        b[n] = sum_{s >= 0} gamma^s * r_{t+s}(greedy path from n)

    The baseline depends on the node's state only, not on the sampled answers it is compared with,
    so the policy gradient stays unbiased. All paths advance together: one batched generate per agent
    per step, ``num_turns`` steps at most. Returns the baselines and the seconds spent generating.
    """
    N = len(agents)
    totals = torch.zeros(len(rollout.states), N)
    active = [(n, ep, obs, int(rollout.depth[n])) for n, (ep, obs) in enumerate(rollout.states)]
    seconds, weight = 0.0, 1.0
    placeholder = rollout.states[0][1] if rollout.states else None
    while keep_in_step(shards, bool(active), engine, agents, placeholder, params, pool, parallel):
        if not active:  # another data shard's greedy paths go on
            continue
        started = time.perf_counter()
        gens = generate_all(
            engine, agents, [[obs[i] for _, _, obs, _ in active] for i in range(N)], 1, params, pool, parallel
        )
        seconds += time.perf_counter() - started
        actions = [[[gens[i].completions[j] for i in range(N)]] for j in range(len(active))]
        results = env.step_many([ep for _, ep, _, _ in active], actions)
        _check_same_outcomes(parallel, "greedy rewards, done flags or next prompts", results)
        next_active = []
        for j, (n, _, _, depth) in enumerate(active):
            result = results[j][0]
            _per_agent_reward(env, result, N, f"turn {depth + 1} of the greedy baseline's path from node {n}")
            totals[n] += weight * torch.tensor(result.rewards, dtype=torch.float32)
            if (
                not result.done
                and not _ends_early(results[j], early_termination_threshold, N)
                and depth + 1 < num_turns
                and result.episode is not None
                and result.observations
            ):
                next_active.append((n, result.episode, list(result.observations), depth + 1))
        active, weight = next_active, weight * discount
    return totals, seconds


def episode_answers(rollout: Rollout, items: Sequence[Any]) -> list[tuple[Any, list[list[str]]]]:
    """Each episode of ``rollout`` as ``(its item, answers[turn][agent])``: one per joint action of each root
    (root ``b`` plays ``items[b]``), followed turn by turn through its child's first joint action (the single-path
    episodes that evaluation plays)."""
    N = len(rollout.generations)
    G = len(rollout.generations[0].completions) // len(rollout.depth)
    episodes = []
    for root in range(len(items)):
        for k in range(rollout.joint_index.shape[1]):
            node, joint, turns = root, k, []
            while True:
                rows = [node * G + int(rollout.joint_index[node, joint, i]) for i in range(N)]
                turns.append([rollout.generations[i].completions[r] for i, r in enumerate(rows)])
                node, joint = int(rollout.child[node, joint]), 0
                if node < 0:
                    break
            episodes.append((items[root], turns))
    return episodes


def with_rewards(rollout: Rollout, rewards: torch.Tensor, discount: float, backup: str = "mean") -> Rollout:
    """``rollout`` with its immediate rewards replaced by ``rewards`` ``[num_nodes, K, N]`` (e.g. less a KL
    penalty) and its returns recomputed from them down the same tree, as :func:`collect` computes them."""
    children = {
        n: {k: c for k, c in enumerate(row) if c >= 0} for n, row in enumerate(rollout.child.tolist())
    }
    G = rollout.generations[0].completion_ids.shape[0] // len(rollout.depth)
    node_returns, returns = credited_returns(
        rewards, rollout.done, children, rollout.joint_index, G, discount, backup
    )
    return dataclasses.replace(rollout, rewards=rewards, node_returns=node_returns, returns=returns)


def credited_returns(
    rewards: torch.Tensor,
    done: torch.Tensor,
    children: dict[int, dict[int, int]],
    joint_index: torch.Tensor,
    num_generations: int,
    discount: float,
    backup: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each joint action's return (:func:`tree_returns`, ``[num_nodes, K, N]``) and each agent's return per
    completion, ``[num_nodes, G]`` per agent: the mean over the joint actions it took part in (``cross_returns``)."""
    node_returns = tree_returns(rewards, done, children, discount, backup)
    returns = [
        torch.stack(
            [
                cross_returns(node_returns[n, :, i], joint_index[n, :, i], num_generations)
                for n in range(len(node_returns))
            ]
        )
        for i in range(rewards.shape[-1])
    ]
    return node_returns, returns


def tree_returns(
    rewards: torch.Tensor,
    done: torch.Tensor,
    children: dict[int, dict[int, int]],
    discount: float,
    backup: str = "mean",
) -> torch.Tensor:
    """Discounted returns of every joint action of a rollout tree, ``[num_nodes, K, N]``.

    Children have larger node indices than their parents. The value of a node is the ``mean``
    (or ``max``, per agent) of its joint actions' returns, and

        R[n, k] = r[n, k] + gamma * V(child of (n, k))

    A joint action that is done, or at the last turn, keeps ``R = r``. One that could have gone on
    but was not expanded (``max_children``) is bootstrapped with the mean value of its expanded
    siblings, so a branch is not penalised for being left out of the budget.
    """
    if backup not in ("mean", "max"):
        raise ValueError(f"tree_returns: backup={backup!r}; choose 'mean' or 'max'")
    returns = rewards.clone()
    values = torch.zeros(rewards.shape[0], rewards.shape[2])
    for n in range(rewards.shape[0] - 1, -1, -1):
        kids = children.get(n, {})
        if kids:
            child_values = {k: values[c] for k, c in kids.items()}
            sibling_mean = torch.stack(list(child_values.values())).mean(dim=0)
            for k in range(rewards.shape[1]):
                if k in child_values:
                    returns[n, k] += discount * child_values[k]
                elif not done[n, k]:
                    returns[n, k] += discount * sibling_mean
        values[n] = returns[n].mean(dim=0) if backup == "mean" else returns[n].max(dim=0).values
    return returns
