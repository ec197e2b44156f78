"""The Dec-POMDP environment protocol and the adapter for plain reward functions.

An environment plays one dataset item per episode::

    observations = env.reset(item)          # one prompt per agent
    result = env.step(joint_action)         # one completion per agent
    result.rewards                          # one per agent, or one for the whole team
    result.done, result.observations        # next prompts per agent when not done
    result.info                             # anything; "success" (bool): the outcome, read when the episode ends

The rollout takes many joint actions from the same state (the G samples of every agent, or
their combinations). It asks for all of them at once through ``step_many`` so an environment
can score a whole batch in one call; the default implementation copies the episode per joint
action and calls ``step``. Each result carries the branch's environment after the step
(``result.episode``), from which a multi-turn rollout continues that branch.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from comarl.config import ConfigError

Item = Mapping[str, Any]


@dataclass
class StepResult:
    """What one joint action did: the rewards, whether the episode ended, next observations.

    ``rewards``: one per agent, or the team's joint reward (a number, or a list of one), which the rollout gives
    every agent."""

    rewards: list[float]
    done: bool = True
    observations: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    components: dict[str, float] = field(default_factory=dict)
    episode: Env | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.rewards, (int, float)) and not isinstance(self.rewards, bool):
            self.rewards = [self.rewards]  # a joint reward: the rollout gives it to every agent


@dataclass
class History:
    """What each agent saw and said so far on one branch: ``prompts[i][t]``, ``responses[i][t]``."""

    prompts: list[list[str]]
    responses: list[list[str]]

    @classmethod
    def empty(cls, num_agents: int) -> History:
        return cls([[] for _ in range(num_agents)], [[] for _ in range(num_agents)])

    def extended(self, prompts: Sequence[str], responses: Sequence[str]) -> History:
        return History(
            [h + [p] for h, p in zip(self.prompts, prompts)],
            [h + [r] for h, r in zip(self.responses, responses)],
        )


class Env:
    """Base class of Dec-POMDP environments over dataset items. Subclass and implement reset/step."""

    num_agents: int = 1
    # The environment's own turn limit, when it has one; the trainer's num_turns must then agree.
    num_turns: int | None = None

    def reset(self, item: Item) -> list[str]:
        """Start an episode on ``item``; return one observation (prompt) per agent."""
        raise NotImplementedError

    def step(self, joint_action: Sequence[str]) -> StepResult:
        """Apply one completion per agent; return rewards, done, next observations and info."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the environment holds (worker pools, files); called when a run or evaluation ends."""

    def fork(self) -> Env:
        """A copy for a new episode or branch, whose changes never reach this one: a deep copy. Environments
        whose ``reset`` and ``step`` replace their per-episode attributes (never change them in place) may return
        a shallow copy instead, to share what must be shared (a worker pool, a reward model)."""
        try:
            return copy.deepcopy(self)
        except (TypeError, copy.Error) as error:
            raise TypeError(
                f"{type(self).__name__}.fork: the environment cannot be deep-copied ({error}); override fork() to "
                "return a copy that shares what cannot be copied (e.g. copy.copy(self) when reset and step replace "
                "the per-episode attributes)"
            ) from error

    def step_many(
        self, episodes: Sequence[Env], joint_actions: Sequence[Sequence[Sequence[str]]]
    ) -> list[list[StepResult]]:
        """For each episode (an env after ``reset``), apply each of its joint actions from that same state.

        ``joint_actions[e][k]`` is the k-th joint action of episode ``e``. Returns results of the same
        shape, each with ``result.episode`` set to its branch's environment after the step. The
        default forks the episode (``fork``) for every joint action, so that siblings never see each
        other's moves; override it to score a whole batch at once.
        """
        results = []
        for ep, actions in zip(episodes, joint_actions):
            row = []
            for action in actions:
                branch = ep.fork()
                result = branch.step(action)
                result.episode = branch
                row.append(result)
            results.append(row)
        return results


def check_weights(owner: str, weights: Mapping[str, float], names: Iterable[str]) -> None:
    """A task's reward weights: one for each component in ``names``, each a finite number >= 0, summing to 1, so
    that a weighted total of components in [0, 1] stays in [0, 1] with full marks 1.0. Raises ValueError naming
    ``owner``."""
    if set(weights) != set(names):
        raise ValueError(f"{owner}: weights has keys {sorted(weights)}; give exactly {sorted(names)}")
    values = list(weights.values())
    numbers = all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in values
    )
    if not numbers or min(values, default=0) < 0 or abs(sum(values) - 1) > 1e-6:
        raise ValueError(
            f"{owner}: weights {dict(weights)} must be numbers >= 0 that sum to 1 (the total then stays in [0, 1])"
        )


def step_in_place(env: Env, joint_action: Sequence[str]) -> StepResult:
    """``env.step`` for an environment that implements ``step_many``, which leaves its episodes as they were: one
    branch, whose state ``env`` then takes on, so that stepping by hand moves the episode on."""
    result = env.step_many([env], [[joint_action]])[0][0]
    env.__dict__.update(vars(result.episode))
    result.episode = env
    return result


# ----------------------------------------------------------------------------- reward functions


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned a value the trainer cannot use."""


def _where(items: Sequence[Item]) -> str:
    """Name the item(s) of a reward call for an error message."""
    distinct = len({short_repr(item) for item in items})
    if distinct == 1:
        return f"item {short_repr(items[0])}"
    # One entry per joint action: the same item appears once per joint action of its group.
    return f"a batch of {len(items)} joint actions over {distinct} items (first: {short_repr(items[0])})"


def short_repr(item: Any, limit: int = 120) -> str:
    """``item``'s repr (a mapping's as a dict), cut to ``limit`` characters, for error messages."""
    text = repr(dict(item) if isinstance(item, Mapping) else item)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class RewardFunction:
    """A user reward function and how it is called.

    The function receives one list of completions per agent as its first ``num_agents``
    positional arguments, then, by keyword, those of these it declares (all of them if it takes
    ``**kwargs``): ``prompts`` (one list per agent), ``batch_items`` (the dataset items) and every
    column of the dataset item (one value per joint action), except one named like a completion
    parameter (that name holds the completions; the column stays in ``batch_items``). All lists
    are aligned: element ``k`` belongs to joint action ``k``.

    It returns one reward per joint action (shared by the team) or, per joint action, a sequence
    of ``num_agents`` rewards (one per agent).
    """

    func: Callable[..., Any]
    name: str
    weight: float = 1.0
    num_agents: int = 1

    def __post_init__(self) -> None:
        signature = inspect.signature(self.func)
        params = list(signature.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
        example = (
            f"def {self.name}({', '.join(f'completions_{i}' for i in range(self.num_agents))}, prompts=None)"
        )
        if len(positional) < self.num_agents and not takes_varargs:
            # (CoMLRL calls a one-parameter function with the list of the agents' lists.)
            raise RewardFunctionError(
                f"reward function {self.name!r} takes {len(positional)} positional argument(s) but the team has "
                f"{self.num_agents} agent(s): it must accept one list of completions per agent, e.g. {example}, "
                f"or def {self.name}(*completions)"
            )
        taken = [p.name for p in positional[: self.num_agents] if p.name in ("prompts", "batch_items")]
        if taken:
            # CoMLRL passes the prompts first to f(prompts, a, b); here they would receive agent 0's completions.
            raise RewardFunctionError(
                f"reward function {self.name!r}: its parameter {taken[0]!r} is one of the first {self.num_agents} "
                f"positional parameters, which take the agents' completions; put it after them, e.g. {example}"
            )
        self._takes_all = any(p.kind == p.VAR_KEYWORD for p in params)
        # A column named like a completion parameter (trl-lib/tldr's "completion") would be passed twice.
        self._completion_names = {p.name for p in positional[: self.num_agents]}
        keyword_params = positional[self.num_agents :] + [p for p in params if p.kind == p.KEYWORD_ONLY]
        self._keywords = {p.name for p in keyword_params}
        self._required = [p.name for p in keyword_params if p.default is p.empty]

    def __call__(
        self,
        completions: Sequence[Sequence[str]],
        prompts: Sequence[Sequence[str]],
        items: Sequence[Item],
    ) -> list[list[float]]:
        """Call once on K joint actions; return a K x num_agents list of finite floats."""
        available: dict[str, Any] = {"prompts": [list(p) for p in prompts], "batch_items": list(items)}
        columns = {key for item in items for key in item}
        for key in columns:
            available.setdefault(key, [item.get(key) for item in items])
        missing = [name for name in self._required if name not in available]
        if missing:
            raise RewardFunctionError(
                f"reward function {self.name!r} requires argument {missing[0]!r}, which is neither a dataset column "
                f"nor one of 'prompts', 'batch_items'; give it a default or rename it"
            )
        kwargs = {
            k: v
            for k, v in available.items()
            if (self._takes_all or k in self._keywords) and k not in self._completion_names
        }
        for key in sorted(kwargs.keys() & columns - {"prompts", "batch_items"}):
            lacking = next((item for item in items if key not in item), None)
            if lacking is not None:
                # One call per joint action would leave the column out for that item (the parameter's default):
                # a None in its place would score it otherwise.
                raise RewardFunctionError(
                    f"reward function {self.name!r} takes column {key!r}, which item {short_repr(lacking)} lacks "
                    f"while others in the same batched call have it: give every item the column, or use "
                    "reward_call='per_joint_action' (one call per item, each with its own columns)"
                )
        try:
            value = self.func(*[list(c) for c in completions], **kwargs)
        except Exception as exc:
            raise RewardFunctionError(
                f"reward function {self.name!r} raised on {_where(items)}: {type(exc).__name__}: {exc}"
            ) from exc
        return self._check(value, items)

    def _check(self, value: Any, items: Sequence[Item]) -> list[list[float]]:
        count = len(items)
        if hasattr(value, "tolist"):  # torch / numpy
            value = value.tolist()
        if isinstance(value, (int, float)) and count == 1:
            value = [value]
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise RewardFunctionError(
                f"reward function {self.name!r} returned {short_repr(value)} on {_where(items)}: "
                f"expected a list of {count} rewards"
            )
        if len(value) != count:
            raise RewardFunctionError(
                f"reward function {self.name!r} returned {len(value)} values on {_where(items)}: expected "
                f"{count} (one per joint action, or one list of {self.num_agents} per joint action)"
            )
        rows: list[list[float]] = []
        for k, v in enumerate(value):
            if isinstance(v, Sequence) and not isinstance(v, str):
                if len(v) != self.num_agents:
                    raise RewardFunctionError(
                        f"reward function {self.name!r} returned per-agent rewards {short_repr(v)} on {_where(items[k : k + 1])}: "
                        f"expected {self.num_agents} values (one per agent)"
                    )
                row = list(v)
            else:
                row = [v] * self.num_agents
            for r in row:
                if isinstance(r, bool):  # refused as everywhere in comarl: a flag is not silently a number
                    raise RewardFunctionError(
                        f"reward function {self.name!r} returned {r!r} on {_where(items[k : k + 1])}: rewards must "
                        "be finite numbers, not bools; return float(...) of the condition"
                    )
                if not isinstance(r, (int, float)) or not math.isfinite(r):
                    raise RewardFunctionError(
                        f"reward function {self.name!r} returned {r!r} on {_where(items[k : k + 1])}: "
                        "rewards must be finite numbers"
                    )
            rows.append([float(r) for r in row])
        return rows


def reward_functions(
    funcs: Callable[..., Any] | Sequence[Callable[..., Any]],
    weights: Sequence[float] | None,
    num_agents: int,
) -> list[RewardFunction]:
    """Wrap one or several reward callables with their weights and unique names for logging."""
    funcs = [funcs] if callable(funcs) else list(funcs)
    if not funcs:
        raise RewardFunctionError("reward_func: give at least one reward function")
    if weights is not None and len(weights) != len(funcs):
        raise ConfigError(
            f"reward_weights has {len(weights)} values but there are {len(funcs)} reward functions: give one "
            "weight per function"
        )
    wrapped, seen = [], set()
    for i, func in enumerate(funcs):
        if not callable(func):
            raise RewardFunctionError(f"reward_func[{i}] is {func!r}, not a callable")
        name = getattr(func, "__name__", "") or type(func).__name__
        if name == "<lambda>" or name in seen:
            name = f"reward_{i}"
        # Scores and components are kept by name: a user's function may already hold the one given here.
        base, copy = name, 1
        while name in seen:
            name, copy = f"{base}_{copy}", copy + 1
        seen.add(name)
        wrapped.append(RewardFunction(func, name, 1.0 if weights is None else float(weights[i]), num_agents))
    return wrapped


Transition = Callable[[Item, list[str], History], "Sequence[Any] | None"]


class FunctionEnv(Env):
    """An environment from plain functions: prompts from formatters, rewards from reward functions.

    ``reward_call="batched"`` calls each reward function once per ``step_many`` with every joint
    action of every episode; ``"per_joint_action"`` calls it once per joint action with
    one-element lists (the CoMLRL convention). Both give the same rewards.

    Multi-turn: ``transition(item, completions, history)`` returns the next prompt of every agent,
    or ``None`` when the task is done; ``history`` holds every agent's prompts and responses on
    this branch, the current turn included. It is not called after turn ``num_turns``.
    """

    def __init__(
        self,
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]],
        formatters: Callable[[Item], Any] | Sequence[Callable[[Item], Any]] | None = None,
        num_agents: int = 1,
        reward_weights: Sequence[float] | None = None,
        reward_call: str = "per_joint_action",
        reward_processor: Callable[[float], float] | None = None,
        success_threshold: float | None = None,
        transition: Transition | None = None,
        num_turns: int = 1,
    ) -> None:
        if reward_call not in ("per_joint_action", "batched"):
            raise ValueError(f"reward_call={reward_call!r}: choose 'per_joint_action' or 'batched'")
        self.num_agents = num_agents
        self.rewards = reward_functions(reward_funcs, reward_weights, num_agents)
        self.formatters = _formatters(formatters, num_agents)
        self.reward_call = reward_call
        self.reward_processor = reward_processor
        self.success_threshold = success_threshold
        self.transition = transition
        self.num_turns = num_turns
        self.item: Item = {}
        self.prompts: list[Any] = []
        self.history = History.empty(num_agents)

    def reset(self, item: Item) -> list[Any]:
        self.item = item
        self.prompts = [_format(f, i, item) for i, f in enumerate(self.formatters)]
        self.history = History.empty(self.num_agents)
        return list(self.prompts)

    def fork(self) -> Env:
        """A shallow copy: ``reset`` and ``step`` replace the per-episode attributes (the reward functions are shared)."""
        return copy.copy(self)

    def step(self, joint_action: Sequence[str]) -> StepResult:
        return step_in_place(self, joint_action)

    def step_many(
        self, episodes: Sequence[Env], joint_actions: Sequence[Sequence[Sequence[str]]]
    ) -> list[list[StepResult]]:
        flat = [(ep, action) for ep, actions in zip(episodes, joint_actions) for action in actions]
        if not flat:
            return [[] for _ in episodes]
        calls = [flat] if self.reward_call == "batched" else [[pair] for pair in flat]
        scores: dict[str, list[list[float]]] = {fn.name: [] for fn in self.rewards}
        for call in calls:
            eps = [ep for ep, _ in call]
            completions = [[action[i] for _, action in call] for i in range(self.num_agents)]
            prompts = [[prompt_text(ep.prompts[i]) for ep in eps] for i in range(self.num_agents)]  # type: ignore[attr-defined]
            items = [ep.item for ep in eps]  # type: ignore[attr-defined]
            for fn in self.rewards:
                scores[fn.name].extend(fn(completions, prompts, items))
        results, k = [], 0
        for ep, actions in zip(episodes, joint_actions):
            row = []
            for action in actions:
                components = {name: sum(values[k]) / self.num_agents for name, values in scores.items()}
                rewards = [
                    sum(fn.weight * self._process(scores[fn.name][k][i]) for fn in self.rewards)
                    for i in range(self.num_agents)
                ]
                info = {}
                if self.success_threshold is not None:
                    info["success"] = sum(rewards) / len(rewards) >= self.success_threshold
                result = StepResult(rewards=rewards, done=True, info=info, components=components)
                self._advance(ep, action, result)  # type: ignore[arg-type]
                row.append(result)
                k += 1
            results.append(row)
        return results

    def _advance(self, episode: FunctionEnv, action: Sequence[str], result: StepResult) -> None:
        """The branch after ``action``: its history grows; the transition gives the next prompts or ends it."""
        branch = copy.copy(episode)
        branch.history = episode.history.extended([prompt_text(p) for p in episode.prompts], list(action))
        result.episode = branch
        if self.transition is None or len(branch.history.responses[0]) >= self.num_turns:
            return
        name = getattr(self.transition, "__name__", "transition")
        try:
            prompts = self.transition(episode.item, list(action), branch.history)
        except Exception as exc:
            raise RuntimeError(
                f"transition {name!r} raised on item {short_repr(episode.item)}: {type(exc).__name__}: {exc}"
            ) from exc
        if prompts is None:
            return
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) != self.num_agents:
            raise ValueError(
                f"transition {name!r} returned {short_repr(prompts)} on item {short_repr(episode.item)}: expected a list of "
                f"{self.num_agents} prompts (one per agent) or None when the episode is done"
            )
        branch.prompts = list(prompts)
        result.done, result.observations = False, list(prompts)

    def _process(self, value: float) -> float:
        if self.reward_processor is None:
            return value
        out = float(self.reward_processor(value))
        if not math.isfinite(out):
            raise RewardFunctionError(f"reward_processor turned reward {value!r} into {out!r}")
        return out


def comlrl_transition(
    external_transition: Callable[..., Any],
    num_agents: int,
    formatters: Callable[[Item], Any] | Sequence[Callable[[Item], Any]] | None = None,
    prompt_passthrough: bool = False,
) -> Transition:
    """Adapt a CoMLRL ``external_transition(prompt=, agent_completions=, num_agents=, prompt_history_per_agent=,
    response_history_per_agent=)`` to a comarl transition.

    As in CoMLRL, each returned prompt replaces ``item["prompt"]`` (the item's own prompt is then
    ``item["_original_prompt"]``) and goes through that agent's formatter again, unless
    ``prompt_passthrough`` (CoMLRL: ``external_prompt_passthrough``). A formatter that declares an
    ``external_prompts`` parameter also gets the prompt by that keyword, as CoMLRL calls it.
    """
    fmts = _formatters(formatters, num_agents)
    by_keyword = [_declares(f, "external_prompts") for f in fmts]

    def transition(item: Item, completions: list[str], history: History) -> list[Any] | None:
        prompts = external_transition(
            prompt=item.get("prompt", ""),  # CoMLRL's value for an item without one
            agent_completions=completions,
            num_agents=num_agents,
            prompt_history_per_agent=history.prompts,
            response_history_per_agent=history.responses,
        )
        if prompts is None or prompt_passthrough:
            return prompts
        if isinstance(prompts, str) or len(prompts) != num_agents:
            return prompts  # FunctionEnv reports the wrong count with the function's name
        # CoMLRL's formatters also see the item's own prompt as "_original_prompt"
        original = item.get("prompt", "")
        items = [{**item, "prompt": p, "_original_prompt": original} for p in prompts]
        return [
            fmts[i](items[i], external_prompts=p) if by_keyword[i] else fmts[i](items[i])
            for i, p in enumerate(prompts)
        ]

    transition.__name__ = getattr(external_transition, "__name__", "external_transition")
    return transition


def _declares(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function`` declares a parameter called ``name`` (builtins without a signature do not)."""
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def prompt_text(prompt: Any) -> str:
    """A prompt as text: strings as they are, chat messages as their contents joined."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def _formatters(formatters: Any, num_agents: int) -> list[Callable[[Item], Any]]:
    if formatters is None:
        return [_default_formatter] * num_agents
    if callable(formatters):
        return [formatters] * num_agents
    formatters = list(formatters)
    if len(formatters) != num_agents:
        raise ValueError(
            f"formatters: got {len(formatters)} formatters for {num_agents} agents; give one per agent or one for all"
        )
    for i, f in enumerate(formatters):
        if f is not None and not callable(f):
            raise ValueError(f"formatters[{i}] is {f!r}, not a callable taking the dataset item")
    return [_default_formatter if f is None else f for f in formatters]  # None: item["prompt"]


def _format(formatter: Callable[[Item], Any], agent: int, item: Item) -> Any:
    """Agent ``agent``'s prompt for ``item``; a user formatter's exception is reported with its name and the item."""
    if formatter is _default_formatter:  # its KeyError already says what is missing and what to pass
        return formatter(item)
    try:
        return formatter(item)
    except Exception as exc:
        name = getattr(formatter, "__name__", "") or type(formatter).__name__
        raise RuntimeError(
            f"formatter {name!r} (agent {agent}) raised on item {short_repr(item)}: {type(exc).__name__}: {exc}"
        ) from exc


def _default_formatter(item: Item) -> str:
    if "prompt" not in item:
        raise KeyError(
            f"the default formatter reads item['prompt'], but the item has columns {sorted(item)}; pass formatters="
        )
    return item["prompt"]
