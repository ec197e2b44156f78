"""FunctionEnv and RewardFunction: calling conventions, keyword passing, weights and error messages (no models).
The tests after "gaps found by mutation testing" each pin a behaviour a mutant of envs.py once changed unseen."""

import copy
import math
import re

import pytest
import torch

from comarl.config import ConfigError
from comarl.envs import (
    FunctionEnv,
    RewardFunction,
    RewardFunctionError,
    StepResult,
    check_weights,
    comlrl_transition,
    prompt_text,
)
from comarl.rollout import _per_agent_reward, _per_agent_rewards

ITEM_X = {"q": "x", "answer": 3}
ITEM_Y = {"q": "y", "answer": 5}
FORMATTERS = [lambda item: f"A: {item['q']}", lambda item: f"B: {item['q']}"]

# Two episodes: item x with two joint actions, item y with one.
JOINT_ACTIONS = [[("a", "bb"), ("ccc", "d")], [("ee", "f")]]


def _episodes(env, items=(ITEM_X, ITEM_Y)):
    episodes = []
    for item in items:
        ep = copy.copy(env)
        ep.reset(item)
        episodes.append(ep)
    return episodes


def lengths(a, b):
    """Team reward len(a) + 10 len(b) per joint action."""
    return [len(x) + 10 * len(y) for x, y in zip(a, b)]


# lengths on JOINT_ACTIONS by hand: ("a","bb") -> 1 + 20 = 21; ("ccc","d") -> 3 + 10 = 13; ("ee","f") -> 2 + 10 = 12
LENGTH_REWARDS = [[21.0, 13.0], [12.0]]


def _rewards(results):
    return [[r.rewards for r in row] for row in results]


# ----------------------------------------------------------------------------- reset and step_many


def test_reset_returns_formatter_outputs():
    env = FunctionEnv(lengths, FORMATTERS, num_agents=2)
    assert env.reset(ITEM_X) == ["A: x", "B: x"]
    assert env.reset(ITEM_Y) == ["A: y", "B: y"]


def test_one_formatter_for_all_agents_and_default_formatter():
    env = FunctionEnv(lengths, lambda item: item["q"].upper(), num_agents=2)
    assert env.reset(ITEM_X) == ["X", "X"]
    env = FunctionEnv(lengths, num_agents=2)
    assert env.reset({"prompt": "hi"}) == ["hi", "hi"]
    with pytest.raises(KeyError, match=r"default formatter reads item\['prompt'\].*\['answer', 'q'\]"):
        env.reset(ITEM_X)


def test_step_many_rewards_per_episode_and_joint_action():
    env = FunctionEnv(lengths, FORMATTERS, num_agents=2)
    episodes = _episodes(env)
    assert [ep.prompts for ep in episodes] == [
        ["A: x", "B: x"],
        ["A: y", "B: y"],
    ]  # copies do not share state
    results = env.step_many(episodes, JOINT_ACTIONS)
    assert [len(row) for row in results] == [2, 1]
    assert all(isinstance(r, StepResult) and r.done for row in results for r in row)
    # a shared team reward is repeated for both agents
    assert _rewards(results) == [[[21.0, 21.0], [13.0, 13.0]], [[12.0, 12.0]]]
    assert results[0][0].components == {"lengths": 21.0}


def test_step_is_one_joint_action():
    env = FunctionEnv(lengths, FORMATTERS, num_agents=2)
    env.reset(ITEM_X)
    assert env.step(("ab", "c")).rewards == [12.0, 12.0]  # 2 + 10 * 1


def test_step_many_without_joint_actions():
    env = FunctionEnv(lengths, FORMATTERS, num_agents=2)
    assert env.step_many(_episodes(env), [[], []]) == [[], []]


# ----------------------------------------------------------------------------- calling conventions


def _recording_reward(calls):
    def team(a, b, batch_items, prompts):
        calls.append({"a": a, "b": b, "batch_items": batch_items, "prompts": prompts})
        return lengths(a, b)

    return team


def test_per_joint_action_calls_once_per_joint_action():
    calls = []
    env = FunctionEnv(_recording_reward(calls), FORMATTERS, num_agents=2, reward_call="per_joint_action")
    results = env.step_many(_episodes(env), JOINT_ACTIONS)
    assert [[r.rewards[0] for r in row] for row in results] == LENGTH_REWARDS
    assert calls == [
        {"a": ["a"], "b": ["bb"], "batch_items": [ITEM_X], "prompts": [["A: x"], ["B: x"]]},
        {"a": ["ccc"], "b": ["d"], "batch_items": [ITEM_X], "prompts": [["A: x"], ["B: x"]]},
        {"a": ["ee"], "b": ["f"], "batch_items": [ITEM_Y], "prompts": [["A: y"], ["B: y"]]},
    ]


def test_batched_calls_once_for_everything():
    calls = []
    env = FunctionEnv(_recording_reward(calls), FORMATTERS, num_agents=2, reward_call="batched")
    results = env.step_many(_episodes(env), JOINT_ACTIONS)
    assert [[r.rewards[0] for r in row] for row in results] == LENGTH_REWARDS
    assert calls == [
        {
            "a": ["a", "ccc", "ee"],
            "b": ["bb", "d", "f"],
            "batch_items": [ITEM_X, ITEM_X, ITEM_Y],
            "prompts": [["A: x", "A: x", "A: y"], ["B: x", "B: x", "B: y"]],
        }
    ]


def test_both_conventions_give_identical_results():
    per = FunctionEnv(lengths, FORMATTERS, num_agents=2, reward_call="per_joint_action", success_threshold=13)
    batched = FunctionEnv(lengths, FORMATTERS, num_agents=2, reward_call="batched", success_threshold=13)
    a = per.step_many(_episodes(per), JOINT_ACTIONS)
    b = batched.step_many(_episodes(batched), JOINT_ACTIONS)
    assert _rewards(a) == _rewards(b) == [[[21.0, 21.0], [13.0, 13.0]], [[12.0, 12.0]]]
    assert [[r.info for r in row] for row in a] == [[r.info for r in row] for row in b]
    assert [[r.components for r in row] for row in a] == [[r.components for r in row] for row in b]


def test_a_batched_reward_error_counts_joint_actions_and_items():
    """A batched call over 2 items and 3 joint actions was reported as "a batch of 3 items"."""

    def broken(a, b):
        raise ValueError("no")

    env = FunctionEnv(broken, FORMATTERS, num_agents=2, reward_call="batched")
    with pytest.raises(
        RewardFunctionError, match=r"a batch of 3 joint actions over 2 items \(first: \{'q': 'x'"
    ):
        env.step_many(_episodes(env), JOINT_ACTIONS)


def test_unknown_reward_call():
    with pytest.raises(ValueError, match="reward_call='sometimes'"):
        FunctionEnv(lengths, FORMATTERS, num_agents=2, reward_call="sometimes")


# ----------------------------------------------------------------------------- keyword passing


@pytest.mark.parametrize("reward_call", ["per_joint_action", "batched"])
def test_prompts_keyword_gets_per_agent_prompt_lists(reward_call):
    seen = []

    def with_prompts(a, b, prompts):
        seen.append(prompts)
        return [1.0] * len(a)

    env = FunctionEnv(with_prompts, FORMATTERS, num_agents=2, reward_call=reward_call)
    env.step_many(_episodes(env), JOINT_ACTIONS)
    flat = [[p for call in seen for p in call[i]] for i in range(2)]  # concatenate the calls per agent
    assert flat == [["A: x", "A: x", "A: y"], ["B: x", "B: x", "B: y"]]


def test_column_keyword_gets_column_values_aligned_with_joint_actions():
    # reward = 1 when len(a) == answer; answers per joint action: 3, 3, 5
    def exact_length(a, b, answer):
        return [float(len(x) == ans) for x, ans in zip(a, answer)]

    env = FunctionEnv(exact_length, FORMATTERS, num_agents=2, reward_call="batched")
    results = env.step_many(_episodes(env), [[("abc", ""), ("ab", "")], [("abcde", "")]])
    assert [[r.rewards[0] for r in row] for row in results] == [[1.0, 0.0], [1.0]]


def test_var_keyword_gets_everything():
    seen = {}

    def everything(a, b, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(a)

    env = FunctionEnv(everything, FORMATTERS, num_agents=2, reward_call="batched")
    env.step_many(_episodes(env), JOINT_ACTIONS)
    assert seen == {
        "prompts": [["A: x", "A: x", "A: y"], ["B: x", "B: x", "B: y"]],
        "batch_items": [ITEM_X, ITEM_X, ITEM_Y],
        "q": ["x", "x", "y"],
        "answer": [3, 3, 5],
    }


def test_only_declared_keywords_are_passed():
    seen = {}

    def picky(a, b, q, unused="default"):
        seen.update(q=q, unused=unused)
        return [0.0] * len(a)

    env = FunctionEnv(picky, FORMATTERS, num_agents=2, reward_call="batched")
    env.step_many(_episodes(env), JOINT_ACTIONS)
    assert seen == {"q": ["x", "x", "y"], "unused": "default"}


def test_required_unknown_keyword_raises_naming_it():
    def needs_solution(a, b, solution):
        return [0.0] * len(a)

    env = FunctionEnv(needs_solution, FORMATTERS, num_agents=2)
    with pytest.raises(
        RewardFunctionError, match=r"reward function 'needs_solution' requires argument 'solution'"
    ):
        env.step_many(_episodes(env), JOINT_ACTIONS)


def test_too_few_positional_parameters_raise_at_construction():
    def lonely(completions):
        return [0.0] * len(completions)

    with pytest.raises(
        RewardFunctionError,
        match=r"reward function 'lonely' takes 1 positional argument\(s\) but the team has 2 agent\(s\): it must "
        r"accept one list of completions per agent, e.g. def lonely\(completions_0, completions_1, prompts=None\), "
        r"or def lonely\(\*completions\)$",
    ):
        FunctionEnv(lonely, FORMATTERS, num_agents=2)
    with pytest.raises(RewardFunctionError, match=r"'lonely'.*positional"):
        RewardFunction(lonely, "lonely", num_agents=2)
    # *args takes any number of agents
    RewardFunction(lambda *completions: [0.0], "star", num_agents=3)


def test_prompts_among_the_completion_parameters_raise_at_construction():
    """CoMLRL's f(prompts, a, b) would get agent 0's completions as ``prompts``: refused, with the fix."""

    def prompts_first(prompts, a, b):
        return [0.0]

    with pytest.raises(
        RewardFunctionError,
        match=r"reward function 'prompts_first': its parameter 'prompts' is one of the first 2 positional parameters, "
        r"which take the agents' completions; put it after them, e.g. def prompts_first\(completions_0, "
        r"completions_1, prompts=None\)$",
    ):
        FunctionEnv(prompts_first, FORMATTERS, num_agents=2)
    RewardFunction(
        lambda a, b, prompts: [0.0], "after", num_agents=2
    )  # after the completions it is a keyword


# ----------------------------------------------------------------------------- per-agent rewards


def test_per_agent_rewards():
    env = FunctionEnv(lambda a, b: [[1, 2]], FORMATTERS, num_agents=2)
    env.reset(ITEM_X)
    result = env.step(("p", "q"))
    assert result.rewards == [1.0, 2.0]
    assert result.components == {"reward_0": 1.5}  # mean over the agents: (1 + 2) / 2


def test_per_agent_rewards_wrong_length():
    def three(a, b):
        return [[1, 2, 3]]

    env = FunctionEnv(three, FORMATTERS, num_agents=2)
    env.reset(ITEM_X)
    with pytest.raises(
        RewardFunctionError, match=r"'three' returned per-agent rewards \[1, 2, 3\].*expected 2 values"
    ):
        env.step(("p", "q"))


# ----------------------------------------------------------------------------- several functions


def test_weighted_reward_functions_and_components():
    def first(a, b):
        return [len(a[0])]

    def second(a, b):
        return [len(b[0])]

    env = FunctionEnv([first, second], FORMATTERS, num_agents=2, reward_weights=[0.5, 2.0])
    env.reset(ITEM_X)
    result = env.step(("abcd", "xyz"))
    # 0.5 * 4 + 2.0 * 3 = 8
    assert result.rewards == [8.0, 8.0]
    assert result.components == {"first": 4.0, "second": 3.0}


def test_every_reward_function_gets_a_name_of_its_own():
    """A function of the user's called reward_1 and a lambda in place 1 both got 'reward_1': scores are kept by
    name, so each joint action got another's reward and the components merged."""

    def reward_1(a, b):
        return [1.0] * len(a)

    env = FunctionEnv([reward_1, lambda a, b: [10.0] * len(a), reward_1], FORMATTERS, num_agents=2)
    assert [fn.name for fn in env.rewards] == ["reward_1", "reward_1_1", "reward_2"]
    episode = env.fork()
    episode.reset(ITEM_X)
    (row,) = env.step_many([episode], [[("x", "y"), ("xx", "yy")]])
    assert [r.rewards for r in row] == [[12.0, 12.0], [12.0, 12.0]]
    assert [r.components for r in row] == [{"reward_1": 1.0, "reward_1_1": 10.0, "reward_2": 1.0}] * 2


def test_lambdas_are_named_by_position():
    env = FunctionEnv([lambda a, b: [1.0], lambda a, b: [2.0]], FORMATTERS, num_agents=2)
    assert [fn.name for fn in env.rewards] == ["reward_0", "reward_1"]
    env.reset(ITEM_X)
    result = env.step(("p", "q"))
    assert result.components == {"reward_0": 1.0, "reward_1": 2.0}
    assert result.rewards == [3.0, 3.0]


def test_reward_weights_length_mismatch():
    with pytest.raises(
        ConfigError, match="reward_weights has 1 values but there are 2 reward functions: give one weight per"
    ):
        FunctionEnv([lengths, lengths], FORMATTERS, num_agents=2, reward_weights=[1.0])


# ----------------------------------------------------------------------------- errors


def _step_with(func, **kwargs):
    env = FunctionEnv(func, FORMATTERS, num_agents=2, **kwargs)
    env.reset(ITEM_X)
    return env.step(("p", "q"))


ITEM_X_TEXT = re.escape("item {'q': 'x', 'answer': 3}")


def test_raising_reward_function():
    def exploder(a, b):
        raise ValueError("boom")

    with pytest.raises(RewardFunctionError, match=rf"'exploder' raised on {ITEM_X_TEXT}: ValueError: boom"):
        _step_with(exploder)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward(bad):
    def not_finite(a, b):
        return [bad]

    with pytest.raises(
        RewardFunctionError,
        match=rf"'not_finite' returned {re.escape(repr(bad))} on {ITEM_X_TEXT}: rewards must be finite",
    ):
        _step_with(not_finite)


def test_wrong_number_of_rewards():
    def too_many(a, b):
        return [1.0, 2.0]

    with pytest.raises(
        RewardFunctionError, match=rf"'too_many' returned 2 values on {ITEM_X_TEXT}: expected 1 "
    ):
        _step_with(too_many)


def test_wrong_number_of_rewards_batched():
    def too_few(a, b):
        return [1.0]

    env = FunctionEnv(too_few, FORMATTERS, num_agents=2, reward_call="batched")
    episode = _episodes(env, [ITEM_X])
    with pytest.raises(
        RewardFunctionError, match=rf"'too_few' returned 1 values on {ITEM_X_TEXT}: expected 2 "
    ):
        env.step_many(episode, [[("a", "b"), ("c", "d")]])


def test_string_reward():
    def wordy(a, b):
        return "good"

    with pytest.raises(
        RewardFunctionError, match=rf"'wordy' returned 'good' on {ITEM_X_TEXT}: expected a list of 1 rewards"
    ):
        _step_with(wordy)


def test_string_inside_list_and_bool_rewards():
    with pytest.raises(
        RewardFunctionError, match=rf"'reward_0' returned 'good' on {ITEM_X_TEXT}: rewards must be finite"
    ):
        _step_with(lambda a, b: ["good"])
    with pytest.raises(
        RewardFunctionError, match=rf"'reward_0' returned True on {ITEM_X_TEXT}: rewards must be finite"
    ):
        _step_with(lambda a, b: [True])


def test_scalar_reward_for_one_joint_action():
    assert _step_with(lambda a, b: 0.25).rewards == [0.25, 0.25]


# ----------------------------------------------------------------------------- processor and success


def test_reward_processor_is_applied_to_each_value():
    def first(a, b):
        return [1.0]

    def second(a, b):
        return [[3.0, 5.0]]

    env = FunctionEnv(
        [first, second], FORMATTERS, num_agents=2, reward_weights=[1.0, 0.5], reward_processor=lambda r: 2 * r
    )
    env.reset(ITEM_X)
    result = env.step(("p", "q"))
    # agent 0: 1 * (2 * 1) + 0.5 * (2 * 3) = 5;  agent 1: 1 * (2 * 1) + 0.5 * (2 * 5) = 7
    assert result.rewards == [5.0, 7.0]


def test_reward_processor_must_stay_finite():
    env = FunctionEnv(lambda a, b: [0.0], FORMATTERS, num_agents=2, reward_processor=lambda r: float("inf"))
    env.reset(ITEM_X)
    with pytest.raises(RewardFunctionError, match="reward_processor turned reward 0.0 into inf"):
        env.step(("p", "q"))


def test_success_threshold_sets_info_success():
    env = FunctionEnv(lengths, FORMATTERS, num_agents=2, success_threshold=13.0)
    results = env.step_many(_episodes(env), JOINT_ACTIONS)
    # rewards 21, 13, 12 against the threshold 13 (>=)
    assert [[r.info["success"] for r in row] for row in results] == [[True, True], [False]]
    no_threshold = FunctionEnv(lengths, FORMATTERS, num_agents=2)
    assert all(
        r.info == {} for row in no_threshold.step_many(_episodes(no_threshold), JOINT_ACTIONS) for r in row
    )


# ----------------------------------------------------------------------------- CoMLRL compatibility


def test_comlrl_readme_lambda():
    # |max(len(b), 1) / max(len(a), 1) - 3|: "ab", "abcdef" -> |6/2 - 3| = 0;  "abc", "abcdef" -> |6/3 - 3| = 1
    readme = lambda a, b: [abs(max(len(b[0]), 1) / max(len(a[0]), 1) - 3.0)]  # noqa: E731
    env = FunctionEnv(readme, FORMATTERS, num_agents=2, reward_call="per_joint_action")
    results = env.step_many(_episodes(env, [ITEM_X]), [[("ab", "abcdef"), ("abc", "abcdef")]])
    assert _rewards(results) == [[[0.0, 0.0], [1.0, 1.0]]]


# ============================================================================= gaps found by mutation testing


# ----------------------------------------------------------------------------- processor, weights and success


def test_reward_processor_is_applied_to_each_function_before_its_weight():
    """A clipping processor min(r, 1) tells the three orders apart (a linear one, as in test_rewards.py, cannot):
    per function, then weighted: 0.5 * min(2, 1) + 0.5 * min(0, 1) = 0.5;
    on the weighted sum: min(0.5 * 2 + 0.5 * 0, 1) = 1.0; after the weight: min(1, 1) + min(0, 1) = 1.0."""

    def two(a, b):
        return [2.0]

    def zero(a, b):
        return [0.0]

    result = _step_with([two, zero], reward_weights=[0.5, 0.5], reward_processor=lambda r: min(r, 1.0))
    assert result.rewards == [0.5, 0.5]
    assert result.components == {"two": 2.0, "zero": 0.0}  # components are the functions' own values


def test_success_is_the_mean_over_agents_not_one_agents_reward():
    # per-agent [0, 1], threshold 0.5: mean 0.5 >= 0.5 -> success (agent 0's 0 would fail, agent 1's 1 pass)
    assert _step_with(lambda a, b: [[0.0, 1.0]], success_threshold=0.5).info == {"success": True}
    # per-agent [1, 0], threshold 0.75: mean 0.5 < 0.75 -> no success (agent 0's or the best agent's 1 would pass)
    assert _step_with(lambda a, b: [[1.0, 0.0]], success_threshold=0.75).info == {"success": False}


def test_success_threshold_judges_the_weighted_reward():
    """README: success_threshold turns the (weighted) reward into a success rate. Weighted: 0.25 * 1 + 0.75 * 0 =
    0.25 < 0.5 -> False; the unweighted sum of the components (1 + 0 = 1) would pass."""

    def one(a, b):
        return [1.0]

    def zero(a, b):
        return [0.0]

    result = _step_with([one, zero], reward_weights=[0.25, 0.75], success_threshold=0.5)
    assert result.rewards == [0.25, 0.25]
    assert result.info == {"success": False}


# ----------------------------------------------------------------------------- keyword passing


def test_a_column_named_prompts_or_batch_items_stays_in_batch_items():
    """README: a column named prompts or batch_items does not replace the two lists; it stays in batch_items."""
    item = {"q": "x", "prompts": "a column", "batch_items": "another column"}
    seen = {}

    def reward(a, b, prompts, batch_items):
        seen.update(prompts=prompts, batch_items=batch_items)
        return [0.0]

    env = FunctionEnv(reward, FORMATTERS, num_agents=2)
    env.reset(item)
    env.step(("p", "q"))
    assert seen == {"prompts": [["A: x"], ["B: x"]], "batch_items": [item]}


def test_a_batched_call_refuses_a_column_some_items_lack():
    """One call per joint action leaves a column out for an item that lacks it (the parameter's default applies);
    one batched call over items of which some lack it would have passed None in its place and scored that item
    otherwise ("Both give the same rewards" broke: answer=None against answer=0). It stops, naming the column,
    the item and both fixes; a function that does not take the column is not concerned."""

    def score(a, b, answer=0):
        return (
            [float(x == str(n)) for x, n in zip(a, answer)]
            if isinstance(answer, list)
            else [float(a[0] == "0")]
        )

    items = [ITEM_X, {"q": "z"}]
    actions = [[("3", "-")], [("None", "-")]]
    per_item = FunctionEnv(score, FORMATTERS, num_agents=2, reward_call="per_joint_action")
    assert _rewards(per_item.step_many(_episodes(per_item, items), actions)) == [[[1.0, 1.0]], [[0.0, 0.0]]]
    batched = FunctionEnv(score, FORMATTERS, num_agents=2, reward_call="batched")
    with pytest.raises(
        RewardFunctionError,
        match=r"^reward function 'score' takes column 'answer', which item \{'q': 'z'\} lacks while others in the "
        r"same batched call have it: give every item the column, or use reward_call='per_joint_action'",
    ):
        batched.step_many(_episodes(batched, items), actions)
    lengths_only = FunctionEnv(lengths, FORMATTERS, num_agents=2, reward_call="batched")
    assert _rewards(lengths_only.step_many(_episodes(lengths_only, items), actions)) == [
        [[11.0] * 2],
        [[14.0] * 2],
    ]


def test_keyword_only_parameters_get_their_columns():
    def exact(a, b, *, answer, q="unused"):
        return [[float(len(a[0]) == answer[0]), float(q == ["x"])]]

    env = FunctionEnv(exact, FORMATTERS, num_agents=2)
    env.reset(ITEM_X)
    # len("abc") == 3 -> 1.0 for agent 0; q == ["x"] -> 1.0 for agent 1
    assert env.step(("abc", "z")).rewards == [1.0, 1.0]
    assert env.step(("ab", "z")).rewards == [0.0, 1.0]


# ----------------------------------------------------------------------------- checks of returned values


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_per_agent_rewards_are_checked_for_non_finite_values(bad):
    with pytest.raises(
        RewardFunctionError,
        match=rf"'reward_0' returned {re.escape(repr(bad))} on {ITEM_X_TEXT}: rewards must be finite",
    ):
        _step_with(lambda a, b: [[1.0, bad]])


def test_per_agent_rewards_are_checked_for_bools_and_strings():
    with pytest.raises(RewardFunctionError, match=rf"'reward_0' returned True on {ITEM_X_TEXT}: .*not bools"):
        _step_with(lambda a, b: [[1.0, True]])
    with pytest.raises(RewardFunctionError, match=r"'reward_0' returned 'good' on .*must be finite"):
        _step_with(lambda a, b: [[1.0, "good"]])


def test_per_agent_rewards_with_too_few_values():
    def one_of_two(a, b):
        return [[1.0]]

    with pytest.raises(
        RewardFunctionError, match=r"'one_of_two' returned per-agent rewards \[1.0\] .*expected 2 values"
    ):
        _step_with(one_of_two)


def test_tensor_rewards_are_read_as_lists():
    # values exact in float32: a shared reward 0.25, then per-agent [1, 2]
    assert _step_with(lambda a, b: torch.tensor([0.25])).rewards == [0.25, 0.25]
    assert _step_with(lambda a, b: torch.tensor([[1.0, 2.0]])).rewards == [1.0, 2.0]


def test_a_scalar_for_several_joint_actions_is_named_with_its_value():
    """README: the error names the function, the item and the value (not "returned 1 values")."""

    def half(a, b):
        return 0.5

    env = FunctionEnv(half, FORMATTERS, num_agents=2, reward_call="batched")
    episode = copy.copy(env)
    episode.reset(ITEM_X)
    with pytest.raises(
        RewardFunctionError, match=rf"'half' returned 0.5 on {ITEM_X_TEXT}: expected a list of 2 rewards"
    ):
        env.step_many([episode], [[("a", "b"), ("c", "d")]])


# ----------------------------------------------------------------------------- stepping by hand, histories


def always_continue(item, completions, history):
    return [f"turn{len(history.responses[0]) + 1}"] * len(completions)


def test_stepping_by_hand_returns_the_env_as_the_episode():
    env = FunctionEnv(lambda a, b: [0.0], FORMATTERS, num_agents=2, transition=always_continue, num_turns=3)
    env.reset(ITEM_X)
    first = env.step(("x", "y"))
    assert first.episode is env
    first.episode.step(("x2", "y2"))  # continuing from the result continues the env
    assert env.history.responses == [["x", "x2"], ["y", "y2"]]


def test_reset_starts_a_fresh_history():
    """After a two-turn episode stepped by hand, reset(another item) starts at turn 1: the first step goes on to
    "turn2" (1 response so far < num_turns=2) with only the new responses in the history."""
    env = FunctionEnv(lambda a, b: [0.0], FORMATTERS, num_agents=2, transition=always_continue, num_turns=2)
    env.reset(ITEM_X)
    env.step(("x", "y"))
    env.reset({"q": "z"})
    assert env.history.responses == [[], []]
    result = env.step(("u", "v"))
    assert (result.done, result.observations) == (False, ["turn2", "turn2"])
    assert env.history.prompts == [["A: z"], ["B: z"]] and env.history.responses == [["u"], ["v"]]


def test_chat_prompts_reach_rewards_and_histories_as_text():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert prompt_text(chat) == "be brief\n2+2?"
    assert prompt_text("plain") == "plain"
    seen = []

    def reward(a, b, prompts):
        seen.append(prompts)
        return [0.0]

    env = FunctionEnv(reward, lambda item: chat, num_agents=2, transition=always_continue, num_turns=2)
    env.reset(ITEM_X)
    env.step(("4", "four"))
    assert seen == [[["be brief\n2+2?"], ["be brief\n2+2?"]]]
    assert env.history.prompts == [["be brief\n2+2?"], ["be brief\n2+2?"]]


# ----------------------------------------------------------------------------- comlrl_transition


@pytest.mark.parametrize(
    ("returned", "shown"),
    [(["p1", "p2", "p3"], r"\['p1', 'p2', 'p3'\]"), (["only"], r"\['only'\]")],
    ids=["three", "one"],
)
def test_a_comlrl_transition_with_the_wrong_count_is_reported_unformatted(returned, shown):
    """The wrong count goes to FunctionEnv's check as returned (not through the formatters: a third prompt had no
    formatter, IndexError; a single one came back formatted)."""

    def external(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        return returned

    fmt = [lambda item: f"[helper] {item['prompt']}", lambda item: f"[main] {item['prompt']}"]
    transition = comlrl_transition(external, 2, fmt)
    env = FunctionEnv(lambda a, b: [0.0], fmt, num_agents=2, transition=transition, num_turns=2)
    env.reset({"prompt": "task"})
    with pytest.raises(
        ValueError, match=rf"^transition 'external' returned {shown} on item .*expected a list of 2 prompts"
    ):
        env.step(("x", "y"))


# ----------------------------------------------------------------------------- check_weights


def test_check_weights_accepts_zero_and_refuses_sums_other_than_one():
    check_weights("T", {"a": 0.0, "b": 1.0}, ["a", "b"])  # >= 0: a zero weight switches a component off
    check_weights("T", {"a": 0.25, "b": 0.75}, ["b", "a"])
    for bad in ({"a": 0.5, "b": 0.25}, {"a": 0.75, "b": 0.75}):  # sums 0.75 and 1.5
        with pytest.raises(ValueError, match=r"^T: weights .* must be numbers >= 0 that sum to 1"):
            check_weights("T", bad, ["a", "b"])


def test_check_weights_refuses_bools_and_nan():
    # True sums to 1 and NaN passes both "< 0" and "abs(sum - 1) > 1e-6": only the type/finite check refuses them
    for bad in ({"a": True}, {"a": math.nan}):
        with pytest.raises(ValueError, match=r"^T: weights .* must be numbers >= 0 that sum to 1"):
            check_weights("T", bad, ["a"])


# ----------------------------------------------------------------------------- rollout: one reward per agent


def test_a_step_with_too_few_rewards_is_refused():
    with pytest.raises(
        ValueError, match=r"^FunctionEnv.step returned 2 rewards for 3 agents \(here\): return one reward"
    ):
        _per_agent_reward(FunctionEnv(lambda *c: [0.0], num_agents=3), StepResult([1.0, 2.0]), 3, "here")


def test_an_env_reward_is_a_finite_number_as_a_reward_functions_is():
    """A number is the joint reward; a tensor's values are read as floats; a bool, NaN, inf or a string stops the
    run naming the environment, the place and the value (an Env's rewards were not checked: a NaN went on into the
    advantages, a bool became 1.0, StepResult(True) failed with "object of type 'bool' has no len()")."""
    env = FunctionEnv(lambda a, b: [0.0], num_agents=2)
    for given, expected in (
        (0.5, [0.5, 0.5]),
        (torch.tensor([0.25, 2.0]), [0.25, 2.0]),
        ([1, 0], [1.0, 0.0]),
    ):
        result = StepResult(given)
        _per_agent_reward(env, result, 2, "here")
        assert result.rewards == expected and all(type(r) is float for r in result.rewards)
    for bad, shown in (
        (True, "True"),
        ([1.0, False], "False"),
        ([math.nan, 1.0], "nan"),
        ([1.0, "1"], "'1'"),
    ):
        with pytest.raises(
            ValueError,
            match=rf"^FunctionEnv.step returned reward {shown} \(here\): rewards must be finite numbers, not bools",
        ):
            _per_agent_reward(env, StepResult(bad), 2, "here")
    with pytest.raises(ValueError, match=r"returned reward inf \(item \{'prompt': 'b'\}, turn 2\)"):
        _per_agent_rewards(env, [[StepResult([math.inf, 0.0])]], [{"prompt": "b"}], 1, 2)


def test_a_wrong_reward_count_names_the_item_at_fault():
    env = FunctionEnv(lambda a, b: [0.0], num_agents=2)
    results = [[StepResult([1.0, 1.0])], [StepResult([1.0, 2.0, 3.0])]]
    with pytest.raises(ValueError, match=r"\(item \{'prompt': 'b'\}, turn 1\)"):
        _per_agent_rewards(env, results, [{"prompt": "a"}, {"prompt": "b"}], 0, 2)
