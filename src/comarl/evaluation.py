"""Evaluate a team, one model, or a pipeline on a task: the baselines a trained team is compared with.

Three modes, each playing ``num_samples`` independent episodes per item:

- ``team``: the agents act as a team, as trained (each sees its own prompt, they answer in parallel).
  On base models this is the "agents in parallel without training" baseline.
- ``single``: one model alone on the task's ``num_agents=1`` variant.
- ``pipeline``: agent 0 answers first; agent 1 sees that answer through the task's
  ``pipeline_prompt(item, first_completion)``; the joint answer is scored by the team environment.

Metrics: the mean team reward, the success rate, pass@k (unbiased estimator, :func:`pass_at_k`) from
each item's ``info["success"]`` flags, and the mean of every reward component (``reward/<name>``).

A task is a module with ``load_items(split, source)``, an environment constructor and
``pipeline_prompt(item, first_completion)``; :func:`task_protocol` names them for each task.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from comarl.agents import Agent
from comarl.config import ConfigError
from comarl.engines import Engine, HFEngine, SamplingParams, stream_seed
from comarl.envs import Env
from comarl.rollout import Rollout, agent_seed, collect, independent_episodes
from comarl.tracking import json_ready  # the one rule for NaN in JSON output, shared with metrics.jsonl

TASKS = ("code", "writing", "demo")
MODES = ("team", "single", "pipeline")


# ----------------------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of n samples, c of them correct, hold a correct one.

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

    The product form never builds the huge binomials. It is 1 when ``n - c < k`` (every choice of k
    samples holds a correct one) and 0 when ``c = 0``. Example: n = 5, c = 2 gives pass@1 = 0.4 and
    pass@2 = 1 - C(3, 2) / C(5, 2) = 0.7.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} correct samples must be between 0 and n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be between 1 and n={n} (the samples drawn per item)")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


# ----------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class TaskProtocol:
    """What evaluation uses of a task module: its items, its environment, its pipeline prompt."""

    load_items: Callable[[str, str], list[dict[str, Any]]]  # (split, source) -> items
    default_source: str
    id_key: str  # the item column that names an item in the samples
    make_env: Callable[[int, int], Env]  # (num_agents, num_turns) -> environment, with close()
    pipeline_prompt: Callable[[Mapping[str, Any], str], str]
    max_new_tokens: int = 256  # an answer's length when the caller gives none (the demo's answer is a word)


def task_protocol(task: str) -> TaskProtocol:
    """The protocol of ``task`` ("code", "writing" or "demo"), the one place that maps task names to modules."""
    if task == "writing":
        from comarl.tasks import writing

        return TaskProtocol(writing.load_items, "local", "id", writing.make_env, writing.pipeline_prompt)
    if task == "code":
        from comarl.tasks import code

        def code_env(num_agents: int, num_turns: int) -> Env:
            return code.CodeCollabEnv(num_agents=num_agents, num_turns=num_turns)

        return TaskProtocol(code.load_items, "humaneval", "task_id", code_env, code.pipeline_prompt)
    if task == "demo":
        from comarl.tasks import demo

        return TaskProtocol(
            demo.load_items, "local", "id", demo.make_env, demo.pipeline_prompt, max_new_tokens=3
        )
    raise ConfigError(f"task={task!r} (--task): choose one of {list(TASKS)}")


def task_items(
    task: str, split: str = "eval", source: str | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """The first ``limit`` items (all when None) of ``task``'s ``load_items(split, source)``; the CLI loads them
    before any model. ``source`` defaults to the task's (writing and demo "local", code "humaneval")."""
    protocol = task_protocol(task)
    source = protocol.default_source if source is None else source
    try:
        items = protocol.load_items(split, source)
    except (ValueError, ImportError) as exc:  # the task's message names the bad value, or the missing package
        raise ConfigError(f"--split {split} / --source {source}: {_first_line(exc)}") from None
    except (OSError, KeyError) as exc:  # a hub dataset that cannot be fetched, or records without the columns
        raise ConfigError(
            f"--split {split} / --source {source}: cannot load the items ({type(exc).__name__}: {_first_line(exc)}); "
            "check the source and the network, or use the task's default --source"
        ) from None
    items = items if limit is None else items[:limit]
    if not items:
        raise ConfigError(
            f"no items to evaluate: task {task!r}, split {split!r} (--split), source {source!r} (--source), "
            f"limit {limit} (--limit)"
        )
    return items


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_request(
    task: str,
    mode: str,
    num_agents: int,
    num_samples: int,
    k_values: Sequence[int],
    num_turns: int,
    *,
    limit: int | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    temperature: float | None = None,
) -> None:
    """Check an evaluation request before any model loads; errors name the argument (and its CLI flag)."""
    for name, flag, value in (
        ("limit", "--limit", limit),
        ("max_new_tokens", "--max-new-tokens", max_new_tokens),
        ("batch_size", "--batch-size", batch_size),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{name}={value} ({flag}): must be >= 1")
    if task not in TASKS:
        raise ConfigError(f"task={task!r} (--task): choose one of {list(TASKS)}")
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} (--mode): choose one of {list(MODES)}")
    if num_samples < 1:
        raise ConfigError(f"num_samples={num_samples} (--samples): must be >= 1")
    if num_turns < 1:
        raise ConfigError(f"num_turns={num_turns} (--turns): must be >= 1")
    if task in ("writing", "demo") and num_turns != 1:
        raise ConfigError(f"num_turns={num_turns} (--turns): the {task} task is single-turn; use --turns 1")
    if task == "demo" and mode == "single":
        raise ConfigError(
            "mode='single' (--mode single): the demo is a game of two agents, with no one-agent variant; use "
            "--mode team or --mode pipeline"
        )
    if not k_values:
        raise ConfigError("k_values (--k): give at least one k, e.g. --k 1")
    for k in k_values:
        if k < 1:
            raise ConfigError(f"k_values (--k) has {k}: pass@k needs k >= 1")
        if k > num_samples:
            raise ConfigError(
                f"k_values (--k) has {k}: pass@{k} needs at least {k} samples per item but num_samples="
                f"{num_samples} (--samples); raise --samples to >= {k} or lower --k"
            )
    if mode == "single" and num_agents != 1:
        raise ConfigError(
            f"mode='single' (--mode single) plays one model on the task's one-agent variant, but {num_agents} "
            "agents were given: pass one, e.g. --models RUN/agents/agent_0 (or agent_1, whichever you compare)"
        )
    if mode == "team" and num_agents != 2:
        raise ConfigError(
            f"mode='team' (--mode team) plays the task's team of 2 agents, but {num_agents} were given: pass both "
            "(--run RUN or --models A B), or use --mode single for one model"
        )
    if mode == "pipeline":
        if num_agents != 2:
            raise ConfigError(
                f"mode='pipeline' (--mode pipeline) chains agent 0 into agent 1 and needs 2 agents, got "
                f"{num_agents}: pass two (--run RUN or --models A B)"
            )
        if num_turns != 1:
            raise ConfigError(
                f"mode='pipeline' (--mode pipeline) plays one turn, but num_turns={num_turns} (--turns): use 1"
            )
    sampling_params(num_samples, temperature, 1)  # checks the temperature


def sampling_params(num_samples: int, temperature: float | None, max_new_tokens: int) -> SamplingParams:
    """Greedy for one sample per item (unless a temperature is given) or temperature 0; else sampling.

    Several samples per item default to temperature 1.0, the distribution a trained policy samples from.
    """
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(
            f"temperature={temperature} (--temperature): must be a finite number >= 0 (0 is greedy)"
        )
    if temperature == 0 or (temperature is None and num_samples == 1):
        return SamplingParams(max_new_tokens=max_new_tokens, do_sample=False)
    return SamplingParams(
        max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0 if temperature is None else temperature
    )


# ----------------------------------------------------------------------------- playing episodes


def _episode_records(rollout: Rollout, num_agents: int) -> list[dict[str, Any]]:
    """One record per episode of a rollout, root by root and, within a root, joint action by joint action.

    Single-turn rollouts have ``K`` aligned joint actions per root, one episode each. Multi-turn
    rollouts are played with one sample per node (``K = 1``), so each root grows a chain, followed
    through ``rollout.child``. Reward is the team's return from the root; success and components
    are those of the episode's last step.
    """
    depth = rollout.depth.tolist()
    num_nodes, K = rollout.joint_index.shape[0], rollout.joint_index.shape[1]
    G = len(rollout.generations[0].completions) // num_nodes
    if max(depth) > 0 and K != 1:
        raise ValueError(
            "_episode_records: multi-turn rollouts must be played with one sample per node (K = 1)"
        )
    roots = [m for m in range(num_nodes) if depth[m] == 0]
    chains = {}
    for root in roots:
        chain = [root]
        while int(rollout.child[chain[-1], 0]) >= 0:
            chain.append(int(rollout.child[chain[-1], 0]))
        chains[root] = chain

    records = []
    for root in roots:
        for k in range(K):
            turns = []
            for m in chains[root]:
                rows = [m * G + int(rollout.joint_index[m, k, i]) for i in range(num_agents)]
                turns.append(
                    {
                        "prompts": [rollout.generations[i].prompts[rows[i]] for i in range(num_agents)],
                        "completions": [
                            rollout.generations[i].completions[rows[i]] for i in range(num_agents)
                        ],
                    }
                )
            last = chains[root][-1]
            success = None if rollout.success is None else bool(rollout.success[last, k])
            records.append(
                {
                    "turns": turns,
                    "reward": float(rollout.node_returns[root, k].mean()),
                    "success": success,
                    "components": {name: float(v[last, k]) for name, v in rollout.components.items()},
                }
            )
    return records


def play_episodes(
    env: Env,
    agents: Sequence[Agent],
    items: Sequence[Mapping[str, Any]],
    engine: Engine,
    num_samples: int,
    params: SamplingParams,
    num_turns: int,
    seeds: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """``num_samples`` episodes per item, every agent acting on its own prompt (the team and single modes).

    ``seeds``, one per item, fix the item's draws (see :func:`comarl.rollout.collect`; None: the agents' own
    streams). Returns one record per episode, item-major: ``turns`` (per turn, each agent's prompt and
    completion), ``reward`` (the team's return), ``success`` and ``components`` (of the last step).
    """
    if num_turns == 1:
        rollout = collect(
            env,
            agents,
            items,
            engine=engine,
            num_generations=num_samples,
            params=[params] * len(agents),
            joint_mode="aligned",
            seeds=seeds,
        )
    else:  # independent episodes, not a tree: each item repeated, one answer per agent per turn
        repeated, episode_seeds = independent_episodes(items, seeds, num_samples)
        rollout = collect(
            env,
            agents,
            repeated,
            engine=engine,
            num_generations=1,
            params=[params] * len(agents),
            num_turns=num_turns,
            seeds=episode_seeds,
        )
    return _episode_records(rollout, len(agents))


def play_pipeline(
    env: Env,
    agents: Sequence[Agent],
    items: Sequence[Mapping[str, Any]],
    engine: Engine,
    num_samples: int,
    params: SamplingParams,
    pipeline_prompt: Callable[[Mapping[str, Any], str], str],
    seeds: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Agent 0 answers ``num_samples`` times per item; agent 1 answers each of those once, having read it.

    Agent 1's prompt is ``pipeline_prompt(item, agent 0's completion)``; the team environment
    ``env`` scores the joint answer. ``seeds``, one per item, fix the item's draws (None: the agents' own
    streams). Records as in :func:`play_episodes`.
    """
    episodes = []
    for item in items:
        episode = env.fork()
        observations = episode.reset(item)
        episodes.append((episode, observations))
    first = engine.generate(
        agents[0],
        [obs[0] for _, obs in episodes],
        num_samples,
        params,
        # agent 0's streams are those of the team mode (collect's), so both modes see its same answers
        None if seeds is None else [agent_seed(seed, 0) for seed in seeds],
    )
    second_prompts = [
        pipeline_prompt(item, first.completions[b * num_samples + j])
        for b, item in enumerate(items)
        for j in range(num_samples)
    ]
    second = engine.generate(
        agents[1],
        second_prompts,
        1,
        params,
        None if seeds is None else [stream_seed(seed, 2, j) for seed in seeds for j in range(num_samples)],
    )
    rows = range(len(items) * num_samples)
    joint = [[first.completions[r], second.completions[r]] for r in rows]
    results = env.step_many(
        [ep for ep, _ in episodes],
        [joint[b * num_samples : (b + 1) * num_samples] for b in range(len(items))],
    )
    records = []
    for b, row in enumerate(results):
        for j, result in enumerate(row):
            r = b * num_samples + j
            records.append(
                {
                    "turns": [{"prompts": [first.prompts[r], second_prompts[r]], "completions": joint[r]}],
                    "reward": sum(result.rewards) / len(result.rewards),
                    "success": None if "success" not in result.info else bool(result.info["success"]),
                    "components": dict(result.components),
                }
            )
    return records


# ----------------------------------------------------------------------------- metrics


def summarize(
    records: Sequence[Mapping[str, Any]], num_samples: int, k_values: Sequence[int]
) -> dict[str, float]:
    """Metrics of item-major records (``num_samples`` consecutive records per item).

    ``reward``: mean team reward. ``success``: mean success. ``pass@k``: mean over items of
    :func:`pass_at_k` (n = ``num_samples``, c = the item's successes). ``reward/<name>``: mean of
    each reward component (NaN values, from steps that did not report it, are skipped).
    """
    metrics = {"reward": sum(r["reward"] for r in records) / len(records)}
    flags = [r["success"] for r in records]
    if all(flag is not None for flag in flags):
        metrics["success"] = sum(flags) / len(flags)
        per_item = [sum(flags[s : s + num_samples]) for s in range(0, len(flags), num_samples)]
        for k in k_values:
            metrics[f"pass@{k}"] = sum(pass_at_k(num_samples, c, k) for c in per_item) / len(per_item)
    names = sorted({name for r in records for name in r["components"]})
    for name in names:
        values = [
            r["components"][name] for r in records if not math.isnan(r["components"].get(name, math.nan))
        ]
        if values:
            metrics[f"reward/{name}"] = sum(values) / len(values)
    return metrics


# ----------------------------------------------------------------------------- the entry point


def evaluate_task(
    task: str,
    agents: Sequence[Agent],
    mode: str = "team",
    num_samples: int = 1,
    k_values: Sequence[int] = (1,),
    split: str = "eval",
    *,
    source: str | None = None,
    limit: int | None = None,
    num_turns: int = 1,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    seed: int = 0,
    items: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Play ``task`` in ``mode`` with ``agents`` (loaded :class:`Agent` objects), ``num_samples`` episodes per item.

    Items are ``load_items(split, source)`` of the task (``source`` defaults to the task's: writing and demo
    "local", code "humaneval"), the first ``limit`` of them when given (``items``: those, already
    loaded by :func:`task_items`), ``batch_size`` items per batched generate call; ``max_new_tokens``
    defaults to the task's (256; the demo's one-word answers 3). Sampling draws from
    streams fixed by ``seed``, the item's index, the episode and the agent (:func:`comarl.rollout.collect`), so
    the results do not depend on ``batch_size``; the agents' own streams and torch's global one are not used.
    Returns a JSON-ready dict: the request
    (``task``, ``mode``, ``split``, ``source``, ``num_items``, ``num_samples``, ``num_turns``,
    ``temperature`` (None: greedy), ``agents``), ``metrics`` (see :func:`summarize`) and
    ``samples``: one record per episode with ``item``, ``id``, ``sample``, ``turns`` (each turn's
    prompts and completions, per agent), ``reward``, ``success``, ``components``.
    """
    check_request(
        task,
        mode,
        len(agents),
        num_samples,
        k_values,
        num_turns,
        limit=limit,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        temperature=temperature,
    )
    protocol = task_protocol(task)
    params = sampling_params(
        num_samples, temperature, protocol.max_new_tokens if max_new_tokens is None else max_new_tokens
    )
    source = protocol.default_source if source is None else source
    items = task_items(task, split, source, limit) if items is None else list(items)[:limit]
    if not items:
        raise ConfigError(
            "evaluate_task(items=[]): no items to evaluate; pass at least one, or None to load them"
        )
    env = protocol.make_env(1 if mode == "single" else len(agents), num_turns)
    engine = HFEngine()

    records: list[dict[str, Any]] = []
    try:
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            # Each item's draws come from its own streams, fixed by the seed and its index: the same at any
            # batch size, whoever owns the agents (their own streams, e.g. a trainer's, are not used).
            seeds = [stream_seed(seed, start + b) for b in range(len(batch))]
            if mode == "pipeline":
                played = play_pipeline(
                    env, agents, batch, engine, num_samples, params, protocol.pipeline_prompt, seeds
                )
            else:
                played = play_episodes(env, agents, batch, engine, num_samples, params, num_turns, seeds)
            for e, record in enumerate(played):
                index = start + e // num_samples
                item_id = items[index][protocol.id_key]
                records.append({"item": index, "id": item_id, "sample": e % num_samples, **record})
    finally:
        env.close()  # the code env stops its sandbox pool

    return {
        "task": task,
        "mode": mode,
        "split": split,
        "source": source,
        "num_items": len(items),
        "num_samples": num_samples,
        "num_turns": num_turns,
        "temperature": params.temperature if params.do_sample else None,
        "agents": [agent.source for agent in agents],
        "metrics": summarize(records, num_samples, k_values),
        "samples": records,
    }


# ----------------------------------------------------------------------------- loading and output


def run_agent_paths(run_dir: str | Path) -> list[Path]:
    """The agents a training run saved: ``run_dir/agents/agent_0``, ``agent_1``, ... (consecutive)."""
    folder = Path(run_dir) / "agents"
    paths = []
    while (folder / f"agent_{len(paths)}").is_dir():
        paths.append(folder / f"agent_{len(paths)}")
    if not paths:
        raise ConfigError(
            f"--run {run_dir}: no {folder / 'agent_0'}; give the output_dir of a training run, or --models"
        )
    return paths


def check_device(device: str | None = None) -> str:
    """``device``, checked before any model loads (None: cuda when available, else cpu)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(
            f"device={device!r} (--device): not a torch device; use cpu, cuda or cuda:N"
        ) from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} (--device): CUDA is not available here; use --device cpu")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(
                f"device={device!r} (--device): this machine has {count} CUDA device(s), cuda:0 to "
                f"cuda:{count - 1}; use one of them"
            )
    return device


def load_agents(sources: Sequence[str | Path], device: str | None = None) -> list[Agent]:
    """Load each model (path or hub id) as an :class:`Agent` on ``device`` (default: cuda when available)."""
    device = check_device(device)
    agents = []
    for source in sources:
        try:
            agents.append(Agent.from_pretrained(str(source), device=device))
        except OSError as exc:  # a missing folder, or a hub id that cannot be fetched
            raise ConfigError(f"cannot load the model {source}: {_first_line(exc)}") from None
    return agents


def check_output(path: str | Path) -> Path:
    """Make sure a JSON result can be written at ``path`` (creating its folder) before the evaluation runs."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"--json {path} is a folder; give a file path, e.g. {path}/result.json")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = _temporary(path)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ConfigError(
            f"--json {path}: cannot write there: {exc.strerror or exc}{where}; choose another path"
        ) from None
    return path


def _temporary(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (and where check_output probes)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_json(result: Mapping[str, Any], path: str | Path) -> Path:
    """Write an :func:`evaluate_task` result as indented JSON, creating parent folders.

    Non-finite numbers (a NaN reward) are written as null, as in ``metrics.jsonl``: NaN is not JSON. The file
    is written next to ``path`` and renamed into place, so a failed write never leaves half a file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_ready(result), indent=2, allow_nan=False)
    temporary = _temporary(path)
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def print_table(result: Mapping[str, Any]) -> None:
    """The metrics of an :func:`evaluate_task` result as a terminal table."""
    from rich.console import Console
    from rich.table import Table

    decoding = "greedy" if result["temperature"] is None else f"temperature {result['temperature']:g}"
    table = Table(
        title=f"{result['task']} · mode {result['mode']} · {result['num_items']} items x {result['num_samples']} "
        f"samples · {decoding}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in result["metrics"].items():
        table.add_row(name, f"{value:.4f}")
    console = Console()
    console.print(table)
    console.print("agents: " + ", ".join(str(a) for a in result["agents"]))
