"""FunctionEnv and RewardFunction: calling conventions, keyword passing, weights and error messages (no models)."""

import copy
import re

import pytest

from comarl.config import ConfigError
from comarl.envs import FunctionEnv, RewardFunction, RewardFunctionError, StepResult

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


def _step_with(func):
    env = FunctionEnv(func, FORMATTERS, num_agents=2)
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


def test_success_uses_mean_over_agents():
    env = FunctionEnv(lambda a, b: [[1.0, 0.0]], FORMATTERS, num_agents=2, success_threshold=0.5)
    env.reset(ITEM_X)
    assert env.step(("p", "q")).info == {"success": True}  # (1 + 0) / 2 = 0.5 >= 0.5


# ----------------------------------------------------------------------------- CoMLRL compatibility


def test_comlrl_readme_lambda():
    # |max(len(b), 1) / max(len(a), 1) - 3|: "ab", "abcdef" -> |6/2 - 3| = 0;  "abc", "abcdef" -> |6/3 - 3| = 1
    readme = lambda a, b: [abs(max(len(b[0]), 1) / max(len(a[0]), 1) - 3.0)]  # noqa: E731
    env = FunctionEnv(readme, FORMATTERS, num_agents=2, reward_call="per_joint_action")
    results = env.step_many(_episodes(env, [ITEM_X]), [[("ab", "abcdef"), ("abc", "abcdef")]])
    assert _rewards(results) == [[[0.0, 0.0], [1.0, 1.0]]]
