"""A user-written Dec-POMDP environment plugs into the trainer (the README example)."""

from __future__ import annotations

import pytest

from comarl import ConfigError, Env, MAGRPOConfig, MAGRPOTrainer, StepResult


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
