"""Which agents learn: frozen agents act but keep their weights; alternating agents take turns."""

from __future__ import annotations

import pytest
import torch

import comarl
from comarl import ConfigError, MAGRPOConfig, MAGRPOTrainer

DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob", "return a + b")]


def length_reward(a, b):
    return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]


def _trainer(name, agents, **kw):
    settings = dict(
        prompts_per_step=2,
        num_generations=4,
        max_new_tokens=5,
        learning_rate=1e-3,
        max_steps=2,
        progress_bar=False,
        reward_call="batched",
        seed=2,
    )
    settings.update(kw)
    return getattr(comarl, f"{name}Trainer")(
        agents=agents,
        train_dataset=DATA,
        reward_func=length_reward,
        args=getattr(comarl, f"{name}Config")(**settings),
    )


def _weights(agent):
    return [p.detach().clone() for p in agent.model.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("MAGRPO", {"beta": 0.05}),
        ("IPPO", {"num_iterations": 2}),
        ("MAPPO", {}),
        ("MADPO", {"candidates_from": "current"}),
    ],
)
def test_a_frozen_agent_acts_but_keeps_its_weights(qwen_bpe, llama_word, name, overrides):
    trainer = _trainer(name, [qwen_bpe, llama_word], frozen_agents=[1], **overrides)
    before = [_weights(a) for a in trainer.team]
    metrics = trainer.train()
    assert _same(before[1], _weights(trainer.team[1]))
    assert not _same(before[0], _weights(trainer.team[0]))
    assert "agent_0/grad_norm" in metrics and not any(
        k.startswith("agent_1/") and "reward" not in k for k in metrics
    )
    if trainer.references is not None:
        assert trainer.references[1] is None  # no reference copy for an agent that never moves
    if name == "MAPPO":
        assert "critic/value_loss" in metrics  # the centralized critic still learns


def test_alternating_agents_take_turns(qwen_bpe, llama_word):
    """alternate_agents_every=2 with 2 agents over 4 steps: agent 0 learns in steps 1-2, agent 1 in steps 3-4."""
    trainer = _trainer("MAGRPO", [qwen_bpe, llama_word], max_steps=4, alternate_agents_every=2)
    snapshots = [[_weights(a) for a in trainer.team]]
    learners = []
    step = trainer.training_step

    def recorded(items):
        learners.append(trainer.learning_agents())
        out = step(items)
        snapshots.append([_weights(a) for a in trainer.team])
        return out

    trainer.training_step = recorded
    trainer.train()
    assert learners == [[0], [0], [1], [1]]
    for s, who in enumerate(learners):
        moved = [not _same(snapshots[s][i], snapshots[s + 1][i]) for i in range(2)]
        assert moved == [i in who for i in range(2)], f"step {s + 1}"


def test_frozen_and_alternating_agents_are_checked(qwen_bpe):
    with pytest.raises(ConfigError, match=r"frozen_agents=\[2\]: \[2\] are not agent indices 0..1"):
        MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(frozen_agents=[2]),
        )
    with pytest.raises(ConfigError, match=r"frozen_agents=\[0, 1\] freezes every agent"):
        MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(frozen_agents=[0, 1]),
        )
    with pytest.raises(ConfigError, match="alternate_agents_every=-1: must be an integer >= 0"):
        MAGRPOConfig(alternate_agents_every=-1)
