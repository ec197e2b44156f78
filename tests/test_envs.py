"""A user-written Dec-POMDP environment plugs into the trainer (the README example)."""

from __future__ import annotations

import pytest

from comarl import ConfigError, Env, FunctionEnv, MAGRPOConfig, MAGRPOTrainer, StepResult
from comarl.envs import RewardFunctionError


class Guess(Env):
    """The README example: both agents must start with the same word."""

    num_agents = 2

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, item):
        self.item = item
        return [f"guess a colour for {item['thing']}", f"which colour is {item['thing']}?"]

    def step(self, joint_action):
        self.steps += 1
        same = joint_action[0].split()[:1] == joint_action[1].split()[:1]
        return StepResult(rewards=[float(same)] * 2, done=True, info={"success": same})


DATA = [{"thing": t} for t in ("grass", "sky", "snow", "coal")]


def test_custom_env_trains_and_reports_success(qwen_bpe):
    env = Guess()
    args = MAGRPOConfig(
        prompts_per_step=2,
        num_generations=2,
        joint_mode="cross",
        max_new_tokens=3,
        max_steps=2,
        progress_bar=False,
    )
    trainer = MAGRPOTrainer(
        model=qwen_bpe, num_agents=2, train_dataset=DATA, eval_dataset=DATA, env=env, args=args
    )
    metrics = trainer.train()
    assert 0.0 <= metrics["success"] <= 1.0
    assert env.steps == 0  # every episode ran on a copy: siblings never share state with the prototype
    assert "eval/success" in trainer.evaluate()


def test_env_and_reward_func_are_exclusive(qwen_bpe):
    with pytest.raises(ConfigError, match="either env= or reward_func="):
        MAGRPOTrainer(model=qwen_bpe, train_dataset=DATA, env=Guess(), reward_func=lambda a, b: [0.0])


def test_default_step_many_isolates_sibling_joint_actions():
    class Counter(Env):
        num_agents = 1

        def reset(self, item):
            self.seen = []
            return ["x"]

        def step(self, joint_action):
            self.seen.append(joint_action[0])
            return StepResult(rewards=[float(len(self.seen))])

    episode = Counter()
    episode.reset({})
    results = episode.step_many([episode], [[["a"], ["b"], ["c"]]])
    assert [r.rewards for r in results[0]] == [[1.0], [1.0], [1.0]]  # each sibling starts from the same state
    assert episode.seen == []
    assert [r.episode.seen for r in results[0]] == [
        ["a"],
        ["b"],
        ["c"],
    ]  # each branch continues from its own state


def test_a_failing_formatter_is_named_with_its_agent_and_item():
    def helper_prompt(item):
        return "helper: " + item["prompt"]  # the column is "question"

    env = FunctionEnv(
        lambda a, b: [0.0] * len(a), [lambda item: item["question"], helper_prompt], num_agents=2
    )
    with pytest.raises(
        RuntimeError,
        match=r"^formatter 'helper_prompt' \(agent 1\) raised on item \{'question': 'q'\}: KeyError: 'prompt'$",
    ):
        env.reset({"question": "q"})


def test_a_column_named_like_the_completion_parameter_is_not_passed_twice():
    """trl-lib/tldr has a "completion" column: the parameter holds the completions; the column stays in
    batch_items (it was passed again by keyword: TypeError, multiple values for argument 'completion')."""
    seen = {}

    def length_reward(completion, **kwargs):
        seen.update(kwargs)
        return [float(len(c)) for c in completion]

    env = FunctionEnv(length_reward, num_agents=1)
    env.reset({"prompt": "TL;DR:", "completion": "the reference summary"})
    assert env.step(["abc"]).rewards == [3.0]
    assert "completion" not in seen and seen["prompt"] == ["TL;DR:"]
    assert seen["batch_items"][0]["completion"] == "the reference summary"


def test_a_bool_reward_is_refused_with_the_fix():
    env = FunctionEnv(lambda a, b: [a[0] == b[0]], lambda item: item["prompt"], num_agents=2)
    env.reset({"prompt": "p"})
    with pytest.raises(
        RewardFunctionError, match=r"returned True .*not bools; return float\(\.\.\.\) of the condition$"
    ):
        env.step(["x", "x"])
