"""Which agents learn: frozen agents act but keep their weights; alternating agents take turns."""

from __future__ import annotations

import copy

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

    def recorded(items, seeds):
        learners.append(trainer.learning_agents())
        out = step(items, seeds)
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


# ---------------------------------------------------------------------------- one model in every role


@pytest.mark.parametrize("overrides", [{"beta": 0.05, "num_iterations": 2}, {"lora_r": 4}])
def test_shared_weights_take_one_step_on_the_sum_of_the_roles_losses(qwen_bpe, overrides):
    """share_weights: one model and optimizer; its gradient is the sum of each role's gradient (each loss
    normalised over its own completions), computed here by two agents with their own copies of the same weights."""
    overrides = {**overrides, "max_grad_norm": None}  # compare the raw gradients, before any clipping
    shared = _trainer("MAGRPO", [qwen_bpe, qwen_bpe], share_weights=True, max_steps=1, **overrides)
    separate = _trainer("MAGRPO", [qwen_bpe, qwen_bpe], max_steps=1, **overrides)
    assert shared.team[0].model is shared.team[1].model and shared.optimizers[0] is shared.optimizers[1]
    # both separate agents start from the shared model's weights (LoRA adapters are seeded per agent)
    for agent in separate.team:
        agent.model.load_state_dict(shared.team[0].model.state_dict())
    rollout = shared._collect(DATA[:2])
    advantages = {i: torch.randn(8, generator=torch.Generator().manual_seed(i)) for i in range(2)}
    gens = {i: rollout.generations[i] for i in range(2)}

    def record(trainer, agents):
        grads, steps = [], []
        optimizer = trainer.optimizers[agents[0]]
        params = [p for p in trainer.team[agents[0]].model.parameters() if p.requires_grad]

        def step(*a, **k):
            grads.append([p.grad.clone() for p in params])
            steps.append(1)

        optimizer.step = step
        trainer.update_agents(agents, {i: gens[i] for i in agents}, {i: advantages[i] for i in agents})
        return grads, steps

    together, steps = record(shared, [0, 1])
    assert len(steps) == shared.args.num_iterations  # one step per iteration for both roles
    first, _ = record(separate, [0])
    second, _ = record(separate, [1])
    for g, g0, g1 in zip(together[0], first[0], second[0]):
        assert torch.allclose(g, g0 + g1, atol=1e-6, rtol=1e-4)


def test_shared_weights_train_and_are_checked(qwen_bpe, llama_word):
    trainer = _trainer("MAGRPO", [qwen_bpe, qwen_bpe], share_weights=True, max_steps=2)
    before = _weights(trainer.team[0])
    metrics = trainer.train()
    assert not _same(before, _weights(trainer.team[0])) and trainer.team[0].model is trainer.team[1].model
    assert metrics["agent_0/grad_norm"] == metrics["agent_1/grad_norm"]  # one step for both
    with pytest.raises(ConfigError, match="share_weights=True: every agent must name the same model"):
        _trainer("MAGRPO", [qwen_bpe, llama_word], share_weights=True)
    with pytest.raises(
        ConfigError, match="share_weights=True: every agent is the same model, so frozen_agents"
    ):
        MAGRPOConfig(share_weights=True, frozen_agents=[1])
    with pytest.raises(ConfigError, match="the critic trainers keep one model per agent"):
        comarl.IPPOConfig(share_weights=True)
    with pytest.raises(ConfigError, match="MADPO keeps one model per agent"):
        comarl.MADPOConfig(share_weights=True)


def test_one_model_object_in_every_role_trains_as_its_path_does(qwen_bpe):
    """share_weights=True with model=<a model object> refused it (only a hub id or path could be shared) after
    model= had been deep-copied for agent 1; now the object is the one model of every role, and trains exactly as
    the same model named by its path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = dict(share_weights=True, max_steps=1, num_generations=2, prompts_per_step=2, max_new_tokens=4)
    args = MAGRPOConfig(learning_rate=1e-3, progress_bar=False, reward_call="batched", seed=2, **settings)
    named = MAGRPOTrainer(
        model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=length_reward, args=args
    )
    expected = named.train()
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    trainer = MAGRPOTrainer(
        model=model,
        num_agents=2,
        tokenizer=AutoTokenizer.from_pretrained(qwen_bpe),
        train_dataset=DATA,
        reward_func=length_reward,
        args=args,
    )
    metrics = trainer.train()
    assert trainer.team[0].model is model and trainer.team[1].model is model
    assert trainer.team[0].tokenizer is not trainer.team[1].tokenizer  # each role pads its own copy
    assert metrics["agent_0/loss"] == expected["agent_0/loss"] and metrics["reward"] == expected["reward"]
    assert _same(_weights(trainer.team[0]), _weights(named.team[0]))
    with pytest.raises(ConfigError, match="share_weights=True: every agent must name the same model"):
        MAGRPOTrainer(
            agents=[model, copy.deepcopy(model)],
            tokenizer=AutoTokenizer.from_pretrained(qwen_bpe),
            train_dataset=DATA,
            reward_func=length_reward,
            args=args,
        )


def test_a_team_that_shares_one_model_trains_as_share_weights(qwen_bpe):
    """Team(share_weights=True) could not be trained: the config's share_weights=False rebuilt the team (refused as
    two agents holding one model) and share_weights=True took only model names, not agents."""
    from comarl import Agent, Team

    first = Agent.from_pretrained(qwen_bpe, role="a")
    second = Agent(first.model, copy.deepcopy(first.tokenizer), role="b")
    shared = Team([first, second], share_weights=True)
    settings = dict(prompts_per_step=2, num_generations=2, max_new_tokens=4, max_steps=1, progress_bar=False)
    with pytest.raises(
        ConfigError,
        match=r"team=Team\(\.\.\., share_weights=True\) but share_weights=False in the config: set both to True",
    ):
        comarl.MAGRPOTrainer(
            team=shared, train_dataset=DATA, reward_func=length_reward, args=MAGRPOConfig(**settings)
        )
    trainer = comarl.MAGRPOTrainer(
        team=shared,
        train_dataset=DATA,
        reward_func=length_reward,
        args=MAGRPOConfig(share_weights=True, **settings),
    )
    before = _weights(first)
    trainer.train()
    assert trainer.team[0] is first and trainer.team[1] is second and second.model is first.model
    assert trainer.optimizers[0] is trainer.optimizers[1] and not _same(before, _weights(first))
    separate = Team([Agent.from_pretrained(qwen_bpe), Agent.from_pretrained(qwen_bpe)])
    with pytest.raises(ConfigError, match=r"share_weights=False\) but share_weights=True in the config"):
        comarl.MAGRPOTrainer(
            team=separate,
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(share_weights=True, **settings),
        )
