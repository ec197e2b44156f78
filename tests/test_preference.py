"""Preference methods: pair selection and DPO math by hand, MADPO's update against autograd of the team's DPO
loss, MARLHF's reward model, learning on the demo game, checkpoints and config errors."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import pytest
import torch

from comarl import ConfigError, MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer
from comarl.agents import Agent
from comarl.algorithms import dpo_margins, preference_loss, preference_pairs, sequence_logprobs
from comarl.critics import joint_observation
from comarl.engines import Generation
from comarl.tasks import demo
from comarl.trainers.preference import RewardModelEnv, reward_scores

DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob", "return a + b")]


def length_reward(a, b):
    """Shared reward that differs between joint answers, so candidates of one prompt can be ranked."""
    return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]


class CountingReward:
    __name__ = "length_reward"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, a, b):
        self.calls += 1
        return length_reward(a, b)


def madpo_args(**kw) -> MADPOConfig:
    base = dict(
        prompts_per_step=2,
        num_generations=4,
        max_new_tokens=5,
        learning_rate=1e-3,
        max_steps=1,
        progress_bar=False,
        reward_call="batched",
        seed=3,
    )
    base.update(kw)
    return MADPOConfig(**base)


# ---------------------------------------------------------------------------- the math, by hand


def test_preference_pairs_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.5], [2.0, 2.0, 2.0], [0.0, 1.0, 1.0]])
    # item 0: eligible (0,1) gap 1, (0,2) gap .5, (2,1) gap .5; equal gaps keep (chosen, rejected) order.
    # item 1: all tied, no pair. item 2: (1,0) and (2,0), gap 1 each; (1,2) is a tie.
    assert preference_pairs(rewards, 2, "reward_gap").tolist() == [[0, 0, 1], [0, 0, 2], [2, 1, 0], [2, 2, 0]]
    assert preference_pairs(rewards, 1, "reward_gap").tolist() == [[0, 0, 1], [2, 1, 0]]
    every = [[0, 0, 1], [0, 0, 2], [0, 2, 1], [2, 1, 0], [2, 2, 0]]
    assert preference_pairs(rewards, 1, "all").tolist() == every  # 'all' ignores the cap
    picked = preference_pairs(rewards, 2, "random", torch.Generator().manual_seed(0)).tolist()
    assert len(picked) == 4 and all(p in every for p in picked)
    assert [p[0] for p in picked] == [0, 0, 2, 2]
    assert picked == preference_pairs(rewards, 2, "random", torch.Generator().manual_seed(0)).tolist()
    # One stream per item: item b's pairs are those it gets alone from its stream, whatever comes before it
    # (3 of 6 eligible pairs in the stream's order: 120 possible picks).
    ranked = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    seeded = preference_pairs(ranked, 3, "random", [torch.Generator().manual_seed(s) for s in (3, 4, 5)])
    alone = preference_pairs(ranked[2:], 3, "random", [torch.Generator().manual_seed(5)])
    assert seeded[6:, 1:].tolist() == alone[:, 1:].tolist() and seeded[6:, 0].tolist() == [2, 2, 2]
    with pytest.raises(
        ValueError, match=r"^preference_pairs: 2 generators for 3 items; pass one per item, or one$"
    ):
        preference_pairs(rewards, 1, "random", [torch.Generator(), torch.Generator()])
    assert preference_pairs(torch.ones(2, 3), None, "reward_gap").shape == (0, 3)
    with pytest.raises(ValueError, match="selection='best'"):
        preference_pairs(rewards, 2, "best")


def test_dpo_margin_and_loss_by_hand():
    chosen, rejected = torch.tensor([-1.0]), torch.tensor([-3.0])
    ref_chosen, ref_rejected = torch.tensor([-1.5]), torch.tensor([-2.5])
    # 0.5 * ((-1 + 1.5) - (-3 + 2.5)) = 0.5 * (0.5 + 0.5)
    margin = dpo_margins(chosen, rejected, ref_chosen, ref_rejected, 0.5)
    assert margin.tolist() == [0.5]
    assert dpo_margins(chosen, rejected, None, None, 0.5).tolist() == [1.0]  # reference-free: 0.5 * 2
    assert float(preference_loss(margin)) == pytest.approx(math.log(1 + math.exp(-0.5)))
    assert float(preference_loss(torch.tensor(0.0))) == pytest.approx(math.log(2))
    tokens = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert sequence_logprobs(tokens, mask).tolist() == [-7.0, -1.0]


# ---------------------------------------------------------------------------- MADPO's update


@pytest.mark.parametrize("margin_mode", ["joint", "own"])
def test_madpo_step_follows_the_gradient_of_the_team_dpo_loss(qwen_bpe, llama_word, margin_mode):
    """The per-row weighted update (each row scored once, in micro-batches) has the gradient of
    mean_p -log sigmoid(sum_j m_j) ('joint') or of -log sigmoid(m_i) ('own') computed pair by pair with autograd."""
    trainer = MADPOTrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        reward_func=length_reward,
        args=madpo_args(
            candidates_from="current",
            dpo_beta=0.5,
            dpo_margin=margin_mode,
            max_grad_norm=None,
            micro_batch_tokens=40,
        ),
    )
    with torch.no_grad():  # move the agents away from their references, so margins are not all 0
        for agent in trainer.team:
            for p in agent.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    rollout = trainer._collect(DATA[:2])
    K = 4
    pairs = preference_pairs(rollout.rewards.mean(dim=-1), 16, "reward_gap")
    assert len(pairs) >= 3
    chosen, rejected = pairs[:, 0] * K + pairs[:, 1], pairs[:, 0] * K + pairs[:, 2]

    margins, params = [], []
    for i, agent in enumerate(trainer.team):
        gen = rollout.generations[i]
        params.append([p for p in agent.model.parameters() if p.requires_grad])

        def logp(rows, model=None, agent=agent, gen=gen):
            per_token = agent.completion_logprobs(
                gen.prompt_ids[rows],
                gen.prompt_mask[rows],
                gen.completion_ids[rows],
                gen.completion_mask[rows],
                1.0,
                model=model,
            )
            return sequence_logprobs(per_token, gen.completion_mask[rows])

        with torch.no_grad():
            ref_w, ref_l = logp(chosen, trainer.references[i]), logp(rejected, trainer.references[i])
        margins.append(0.5 * ((logp(chosen) - ref_w) - (logp(rejected) - ref_l)))
    expected = []
    for i in range(2):
        loss = preference_loss(margins[0] + margins[1] if margin_mode == "joint" else margins[i]).mean()
        expected.append(torch.autograd.grad(loss, params[i], retain_graph=True))

    recorded = {}
    for i, optimizer in enumerate(trainer.optimizers):
        optimizer.step = lambda *a, i=i, **k: recorded.__setitem__(i, [p.grad.clone() for p in params[i]])
    metrics = trainer.update_team(rollout.generations, pairs, K, None)
    for i in range(2):
        assert len(recorded[i]) == len(expected[i])
        for got, want in zip(recorded[i], expected[i]):
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
        assert metrics[f"agent_{i}/margin"] == pytest.approx(float(margins[i].detach().mean()), abs=1e-5)
    if margin_mode == "joint":
        team = (margins[0] + margins[1]).detach()
        assert metrics["loss"] == pytest.approx(float(preference_loss(team).mean()), abs=1e-5)
        assert metrics["accuracy"] == pytest.approx(float((team > 0).float().mean()))


@pytest.mark.parametrize("margin_mode", ["joint", "own"])
def test_madpo_row_weights_by_hand(qwen_bpe, llama_word, margin_mode):
    """The weight of each scored row in the gradient pass, c_r = beta (sum_{p: w_p = r} g_p - sum_{p: l_p = r} g_p),
    g_p = -(1 - sigmoid(M_p)) / P, with log-probs fixed by hand. One prompt, K = 3, rewards [1, 0, .5]: pairs
    (0, 1), (0, 2), (2, 1); candidate 1 is rejected twice, 2 is chosen once and rejected once; beta = 0.5.
    log-ratios (policy - reference) per row: agent 0 [1, -1, 0], agent 1 [0, 1, -1], so
    m_0 = .5 * [1 - -1, 1 - 0, 0 - -1] = [1, .5, .5], m_1 = .5 * [0 - 1, 0 - -1, -1 - 1] = [-.5, .5, -1],
    team M = [.5, 1, -.5]. joint: g = -[1 - s(.5), 1 - s(1), 1 - s(-.5)] / 3 = -[.377541, .268941, .622459] / 3,
    c = .5 * [g1 + g2, -(g1 + g3), g3 - g2] = [-.107747, 1/6, -.058920] for both agents.
    own, agent 0: g = -[.268941, .377541, .377541] / 3, c = [-.107747, .107747, 0];
    agent 1: g = -[.622459, .377541, .731059] / 3, c = [-1/6, .225586, -.058920]."""
    trainer = MADPOTrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        reward_func=length_reward,
        args=madpo_args(candidates_from="current", dpo_beta=0.5, dpo_margin=margin_mode),
    )
    policy = {0: torch.tensor([-1.0, -3.0, -2.0]), 1: torch.tensor([-4.0, -4.0, -5.0])}
    reference = {0: torch.tensor([-2.0, -2.0, -2.0]), 1: torch.tensor([-4.0, -5.0, -4.0])}

    def sequence_logprobs(i, gen, rows, model=None):
        return (policy if model is None else reference)[i][rows]

    weights = {}

    def dpo_step(i, gen, rows, weight):
        assert rows.tolist() == [0, 1, 2]  # each candidate scored once
        weights[i] = weight.tolist()
        return {}

    trainer._sequence_logprobs = sequence_logprobs
    trainer._dpo_step = dpo_step
    pairs = preference_pairs(torch.tensor([[1.0, 0.0, 0.5]]), 16, "reward_gap")
    assert pairs.tolist() == [[0, 0, 1], [0, 0, 2], [0, 2, 1]]
    metrics = trainer.update_team([None, None], pairs, 3, None)
    if margin_mode == "joint":
        want = {0: [-0.107747, 1 / 6, -0.058920], 1: [-0.107747, 1 / 6, -0.058920]}
        # mean of -log sigmoid([.5, 1, -.5]) = (.474077 + .313262 + .974077) / 3
        assert metrics["loss"] == pytest.approx(0.587139, abs=1e-6)
        assert metrics["margin"] == pytest.approx(1 / 3) and metrics["accuracy"] == pytest.approx(2 / 3)
    else:
        want = {0: [-0.107747, 0.107747, 0.0], 1: [-1 / 6, 0.225586, -0.058920]}
    for i in range(2):
        assert weights[i] == pytest.approx(want[i], abs=1e-6)
    assert metrics["agent_0/margin"] == pytest.approx(2 / 3)
    assert metrics["agent_1/margin"] == pytest.approx(-1 / 3)
    assert metrics["agent_0/chosen_reward"] == pytest.approx(0.5 * (1 + 1 + 0) / 3)  # beta * log-ratio of w


def test_madpo_loss_is_the_mean_over_every_process_pairs(qwen_bpe, llama_word):
    """Under data parallelism update_team gets the pair count of every process: this process's gradient and metric
    sums are divided by it, so with 3x its own pairs in the batch it contributes a third; a process whose items gave
    no pair takes its step with a zero gradient."""
    trainer = MADPOTrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        reward_func=length_reward,
        args=madpo_args(candidates_from="current", max_grad_norm=None),
    )
    with torch.no_grad():
        for agent in trainer.team:
            for p in agent.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    rollout = trainer._collect(DATA[:2])
    pairs = preference_pairs(rollout.rewards.mean(dim=-1), 16, "reward_gap")
    assert len(pairs) >= 3

    def update(pairs, total):
        recorded = {}
        for i, optimizer in enumerate(trainer.optimizers):
            params = [p for p in trainer.team[i].model.parameters() if p.requires_grad]
            optimizer.step = lambda *a, i=i, params=params, **k: recorded.__setitem__(
                i, [None if p.grad is None else p.grad.clone() for p in params]
            )
        return recorded, trainer.update_team(rollout.generations, pairs, 4, None, total)

    own, own_metrics = update(pairs, None)
    third, third_metrics = update(pairs, 3 * len(pairs))
    for i in range(2):
        assert any(g.abs().sum() > 0 for g in own[i])
        for a, b in zip(own[i], third[i]):
            assert torch.allclose(b, a / 3, atol=1e-8, rtol=1e-4)
        for key in ("margin", "loss", "chosen_reward"):
            assert third_metrics[f"agent_{i}/{key}"] == pytest.approx(
                own_metrics[f"agent_{i}/{key}"] / 3, abs=1e-6
            )
    none, metrics = update(torch.zeros(0, 3, dtype=torch.long), 5)
    assert sorted(none) == [0, 1] and all(g is None for i in range(2) for g in none[i])
    assert metrics["loss"] == metrics["agent_1/margin"] == 0.0


def test_madpo_scores_each_agent_in_its_own_micro_batches(qwen_bpe, llama_word):
    trainer = MADPOTrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        reward_func=length_reward,
        args=madpo_args(candidates_from="current", agent_settings=[{"micro_batch_size": 1}, {}]),
    )
    passes = []
    row_logprobs = trainer._row_logprobs

    def recording(agent, gen, rows, model=None):
        passes.append((trainer.team.agents.index(agent), len(rows)))
        return row_logprobs(agent, gen, rows, model)

    trainer._row_logprobs = recording
    trainer.train()
    assert passes and {n for i, n in passes if i == 0} == {1} and max(n for i, n in passes if i == 1) > 1


def test_madpo_initial_candidates_are_sampled_once_and_carry_the_reference(qwen_bpe, tmp_path):
    """candidates_from='initial': the whole dataset is answered at step 1 (reward called once per chunk), never
    again; its log-probs are the reference, so the first step's margins are exactly 0."""
    reward = CountingReward()
    trainer = MADPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=reward,
        args=madpo_args(max_steps=4, output_dir=str(tmp_path), logging_steps=1),
    )
    trainer.train()
    assert reward.calls == 2  # 4 items, 2 per chunk
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["time/generate"] > 0 and all(r["time/generate"] == 0 for r in rows[1:])
    assert rows[0]["agent_0/margin"] == 0.0 and rows[0]["agent_1/accuracy"] == 0.0
    assert rows[-1]["accuracy"] > 0.5  # the team now prefers what the task reward prefers
    assert len(trainer.candidates) == len(DATA)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["rewards"][0] > samples[0]["rewards"][1]


def one_step_madpo(model, tmp_path) -> MADPOTrainer:
    """A one-step MADPO run on the initial team's candidates (the default)."""
    return MADPOTrainer(
        model=model,
        num_agents=2,
        train_dataset=DATA,
        reward_func=CountingReward(),
        args=madpo_args(max_steps=1, output_dir=str(tmp_path)),
    )


def test_madpo_cached_reference_stays_on_the_cpu_with_the_policy_logprobs(qwen_bpe, tmp_path, monkeypatch):
    """_sequence_logprobs returns the policy's log-probs on the CPU, so the cached reference must stay there too:
    moved to an agent's GPU it met CPU log-probs in dpo_margins and the step crashed. The agent is made to report
    another device (meta) to see where the reference goes."""
    trainer = one_step_madpo(qwen_bpe, tmp_path)
    trainer.train()
    monkeypatch.setattr(Agent, "device", property(lambda self: torch.device("meta")))
    generations, _, ref = trainer._cached([0, 1])
    assert generations[0].completion_ids.device.type == "meta"  # the candidates go to the agent's device
    assert [r.device.type for r in ref] == ["cpu", "cpu"]


def test_madpo_initial_step_refuses_items_it_has_no_candidates_for(qwen_bpe, tmp_path):
    """candidates_from='initial' steps on the cached candidates of the items train() hands it; a training_step
    called with other items trained on the last cached ones (or failed on an empty max())."""
    trainer = one_step_madpo(qwen_bpe, tmp_path)
    with pytest.raises(
        ValueError, match=r"^MADPO.training_step: with candidates_from='initial' a step takes the cached"
    ):
        trainer.training_step(DATA[:2])


def test_madpo_resumes_with_its_candidates(qwen_bpe, tmp_path):
    """The initial team's candidates are part of the checkpoint: a resumed run never samples again and ends
    where the unbroken run ends."""
    unbroken = MADPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=madpo_args(max_steps=4),
    )
    expected = unbroken.train()
    first = MADPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=madpo_args(max_steps=2, save_steps=2, output_dir=str(tmp_path)),
    )
    first.train()
    reward = CountingReward()
    resumed = MADPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=reward,
        args=madpo_args(max_steps=4, output_dir=str(tmp_path)),
    )
    metrics = resumed.train(resume_from_checkpoint=True)
    assert reward.calls == 0
    for a, b in zip(unbroken.team, resumed.team):
        assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    assert metrics["loss"] == expected["loss"]


def test_madpo_keeps_a_reference_copy_only_for_candidates_sampled_during_training(qwen_bpe):
    """The initial team's candidates carry their reference log-probs: no frozen copy (a model's memory) is kept."""

    def references(**kw):
        return MADPOTrainer(
            model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=length_reward, args=madpo_args(**kw)
        ).references

    assert references() is None
    assert references(candidates_from="current", dpo_reference="none") is None
    kept = references(candidates_from="current")
    assert kept is not None and len(kept) == 2


def test_madpo_initial_candidates_without_a_reference_score_nothing(qwen_bpe):
    """dpo_reference='none': the initial candidates are sampled and rewarded, never scored by the agents."""
    trainer = MADPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=madpo_args(dpo_reference="none", max_new_tokens=2),
    )

    def scoring(*args, **kwargs):
        raise AssertionError("the initial candidates were scored")

    trainer._sequence_logprobs = scoring
    cache, _ = trainer._initial_candidates()
    assert len(cache) == len(DATA) and all(c["ref"] == {} for c in cache)


def test_madpo_step_metrics_and_logged_pairs_by_hand(qwen_bpe):
    """training_step's bookkeeping over given candidates (the initial team's cache replaced), K = 3: team rewards
    [[1, 0, .5], [0, 3, 3]] pair item 0 as 0>1, 0>2, 2>1 and item 1 as 1>0, 2>0. candidates/reward = 7.5 / 3 / 2 =
    1.25; 5 pairs; mean reward gap (1 + .5 + .5 + 3 + 3) / 5 = 1.6. The samples are the first pair of each of the
    first log_completions items. Equal rewards give no pair: no update, a gap of 0."""
    trainer = MADPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=madpo_args(num_generations=3),
    )
    generations = [
        Generation(None, None, None, None, [], [f"agent {i} answer {r}" for r in range(6)]) for i in range(2)
    ]
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 3.0, 3.0]])
    trainer.candidates, trainer._step_indices = [], [0, 1]  # as train() leaves them
    trainer._cached = lambda indices: (generations, rewards, None)
    updates = []

    def update_team(generations, pairs, K, ref, total):
        updates.append((pairs.tolist(), K, total))
        return {"loss": 0.25}

    trainer.update_team = update_team
    metrics, samples = trainer.training_step(DATA[:2])
    assert updates == [([[0, 0, 1], [0, 0, 2], [0, 2, 1], [1, 1, 0], [1, 2, 0]], 3, 5)]
    assert metrics["candidates/reward"] == 1.25 and metrics["pairs"] == 5.0 and metrics["loss"] == 0.25
    assert metrics["pairs/reward_gap"] == pytest.approx(1.6)
    assert samples == [
        {
            "chosen": ["agent 0 answer 0", "agent 1 answer 0"],
            "rejected": ["agent 0 answer 1", "agent 1 answer 1"],
            "rewards": [1.0, 0.0],
        },
        {
            "chosen": ["agent 0 answer 4", "agent 1 answer 4"],
            "rejected": ["agent 0 answer 3", "agent 1 answer 3"],
            "rewards": [3.0, 0.0],
        },
    ]
    trainer.args = dataclasses.replace(trainer.args, log_completions=1)
    assert trainer.training_step(DATA[:2])[1] == samples[:1]

    updates.clear()
    rewards = torch.full((2, 3), 2.0)
    metrics, samples = trainer.training_step(DATA[:2])
    assert updates == [] and samples == [] and "loss" not in metrics
    assert (metrics["pairs"], metrics["pairs/reward_gap"], metrics["candidates/reward"]) == (0.0, 0.0, 2.0)


def test_madpo_metrics_of_tied_margins_and_rejected_rewards_by_hand(qwen_bpe, llama_word):
    """The log-probs of test_madpo_row_weights_by_hand; pairs (0, 1), (0, 2), (2, 1) of one prompt. Agent 0's
    log-ratios [1, -1, 0] give its rejected rows 1, 2, 1 the implicit reward 0.5 * mean(-1, 0, -1) = -1/3, agent 1's
    [0, 1, -1] give 0.5 * mean(1, -1, 1) = 1/6. With the policy as its own reference every margin is 0: a tie ranks
    no pair right (accuracy 0, not 1) and the loss is log 2."""
    trainer = MADPOTrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        reward_func=length_reward,
        args=madpo_args(candidates_from="current", dpo_beta=0.5),
    )
    policy = [torch.tensor([-1.0, -3.0, -2.0]), torch.tensor([-4.0, -4.0, -5.0])]
    reference = [torch.tensor([-2.0, -2.0, -2.0]), torch.tensor([-4.0, -5.0, -4.0])]

    def sequence_logprobs(i, gen, rows, model=None):
        return (policy if model is None else reference)[i][rows]

    trainer._sequence_logprobs = sequence_logprobs
    trainer._dpo_step = lambda i, gen, rows, weight: {}
    pairs = torch.tensor([[0, 0, 1], [0, 0, 2], [0, 2, 1]])
    metrics = trainer.update_team([None, None], pairs, 3, None)
    assert metrics["agent_0/rejected_reward"] == pytest.approx(-1 / 3)
    assert metrics["agent_1/rejected_reward"] == pytest.approx(1 / 6)
    tied = trainer.update_team([None, None], pairs, 3, policy)
    assert tied["accuracy"] == tied["agent_0/accuracy"] == tied["agent_1/accuracy"] == 0.0
    assert tied["margin"] == 0.0 and tied["loss"] == pytest.approx(math.log(2))


def test_dataset_chunks_and_pair_streams():
    """The whole training set in calls of prompts_per_step items; under data parallelism (2 shards here) every
    other item, prompts_per_step / 2 per call, and with shard_weights a set that gives the shards different numbers
    of calls is refused. Pairs of a step without seeds come from the trainer's own stream."""
    from types import SimpleNamespace

    from comarl.trainers.preference import dataset_chunks, pair_streams

    def shard(rank):
        return SimpleNamespace(rank=rank, world_size=2, stride=lambda items: list(items[rank::2]))

    assert dataset_chunks(5, 2, None) == [[0, 1], [2, 3], [4]]
    assert dataset_chunks(5, 4, shard(0)) == [[0, 2], [4]] and dataset_chunks(5, 4, shard(1)) == [[1, 3]]
    assert dataset_chunks(8, 4, shard(1), sharded=True) == [[1, 3], [5, 7]]
    with pytest.raises(
        ConfigError,
        match=r"^shard_weights=True: the 5 training items give the data shards different numbers of generate calls "
        r"\(2 items each\) when the team answers the whole set; use a training set of a multiple of "
        r"prompts_per_step=4 items$",
    ):
        dataset_chunks(5, 4, shard(0), sharded=True)
    shared = torch.Generator()
    assert pair_streams(None, shared) is shared
    assert len(pair_streams([1, 2, 3], shared)) == 3


@pytest.fixture(scope="module")
def demo_team(tmp_path_factory):
    return [str(p) for p in demo.build_team(tmp_path_factory.mktemp("pref") / "models")]


def _demo_args(cls, **kw):
    base = dict(
        prompts_per_step=6,
        max_new_tokens=3,
        learning_rate=1e-3,
        reward_call="batched",
        success_threshold=1.0,
        seed=0,
        progress_bar=False,
        num_train_epochs=1000,
    )
    base.update(kw)
    return cls(**base)


@pytest.mark.slow
def test_online_madpo_learns_to_coordinate(demo_team):
    """Online MADPO on the demo game: greedy joint success from 0 to >= 0.9 on all 36 items in 200 steps."""
    trainer = demo.demo_trainer(
        MADPOTrainer,
        demo_team,
        _demo_args(MADPOConfig, max_steps=200, num_generations=12, candidates_from="current", dpo_beta=0.5),
    )
    assert trainer.evaluate()["eval/success"] == 0.0
    trainer.train()
    assert trainer.evaluate()["eval/success"] >= 0.9


def test_offline_madpo_improves_on_the_initial_teams_answers(demo_team):
    """CoMLRL's MADPO (candidates from the initial team only): the answers rise from no reward to naming open
    places (greedy reward >= 0.3) in 60 steps; coordination itself is rarely among the initial candidates."""
    trainer = demo.demo_trainer(
        MADPOTrainer, demo_team, _demo_args(MADPOConfig, max_steps=60, num_generations=12)
    )
    assert trainer.evaluate()["eval/reward"] == 0.0
    trainer.train()
    assert trainer.evaluate()["eval/reward"] >= 0.3


# ---------------------------------------------------------------------------- MARLHF


def test_reward_model_env_scores_with_the_model_and_keeps_the_task_reward(qwen_bpe):
    trainer = MARLHFTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=MARLHFConfig(prompts_per_step=2, num_generations=2, max_new_tokens=4, progress_bar=False),
    )
    env = trainer.env
    assert isinstance(env, RewardModelEnv) and trainer.task_env is env.task_env
    with torch.no_grad():
        trainer.reward_model.head.linear.bias.fill_(0.0)
        trainer.reward_model.head.linear.weight.normal_()
    episode = copy.copy(env)  # as the rollout does: one copy per episode
    observations = episode.reset(DATA[0])
    results = env.step_many([episode], [[["abc", "d"], ["a", "bcdef"]]])[0]
    texts = [joint_observation(observations, ["abc", "d"]), joint_observation(observations, ["a", "bcdef"])]
    scores = reward_scores(trainer.reward_model, texts).tolist()
    for result, score, task in zip(results, scores, length_reward(["abc", "a"], ["d", "bcdef"])):
        assert result.rewards == [pytest.approx(score)] * 2
        assert result.components["task"] == pytest.approx(task)
        assert result.components["length_reward"] == pytest.approx(task)
    assert scores[0] != scores[1]
    # one joint action at a time (Env.step) is scored as in a batch
    single = episode.step(["a", "bcdef"])
    assert single.rewards == [pytest.approx(scores[1])] * 2 and single.components == results[1].components
    # evaluation scores the task, never the reward model
    with torch.no_grad():
        trainer.reward_model.head.linear.bias.fill_(100.0)
    assert env.step_many([episode], [[["abc", "d"]]])[0][0].rewards[0] > 50
    assert abs(trainer.evaluate(DATA)["eval/reward"]) < 5


def _small_marlhf(model, **reward_settings):
    """A two-agent MARLHF trainer on DATA with short completions; ``reward_settings`` configure its reward model."""
    return MARLHFTrainer(
        model=model,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=MARLHFConfig(
            prompts_per_step=2, num_generations=2, max_new_tokens=4, progress_bar=False, **reward_settings
        ),
    )


def test_marlhf_fits_its_reward_model_on_given_pairs(qwen_bpe):
    """fit_reward_model(pairs=) learns from preference texts the caller gives (e.g. human labels); the team is
    not asked for candidates."""
    trainer = _small_marlhf(
        qwen_bpe, reward_learning_rate=1e-3, reward_num_train_epochs=4, reward_train_batch_size=4
    )

    def no_sampling(*args, **kwargs):
        raise AssertionError("the team was sampled")

    trainer.engine.generate = no_sampling
    chosen = [f"agent 0 says: the answer to {k} is yes" for k in range(8)]
    rejected = [f"agent 0 says: the answer to {k} is no" for k in range(8)]
    before = reward_scores(trainer.reward_model, chosen) - reward_scores(trainer.reward_model, rejected)
    metrics = trainer.fit_reward_model(pairs=(chosen, rejected))
    after = reward_scores(trainer.reward_model, chosen) - reward_scores(trainer.reward_model, rejected)
    assert metrics["reward_model/pairs"] == 8 and trainer.reward_model_fitted
    assert metrics["reward_model/accuracy"] == float((after > 0).float().mean()) == 1.0
    assert float(after.mean()) > float(before.mean()) + 0.5
    with pytest.raises(
        ConfigError, match="MARLHF: 2 chosen and 1 rejected texts; the reward model needs pairs"
    ):
        trainer.fit_reward_model(pairs=(["a", "b"], ["c"]))


def test_marlhf_bradley_terry_loss_by_hand(qwen_bpe):
    """A fresh reward model has a zero head: every score is 0, so one batch holding all 4 pairs has the loss
    mean_p -log sigmoid(0 - 0) = log 2 (a mean over the pairs, not a sum: 4 log 2 would be 2.772589), and its one
    step moves chosen above rejected (s_w - s_l, not s_l - s_w)."""
    trainer = _small_marlhf(qwen_bpe, reward_learning_rate=1e-2, reward_train_batch_size=8)
    chosen = [joint_observation(["x", "y"], [f"yes {k}", "ok"]) for k in range(4)]
    rejected = [joint_observation(["x", "y"], [f"no {k}", "ok"]) for k in range(4)]
    assert reward_scores(trainer.reward_model, chosen + rejected).abs().max() == 0
    metrics = trainer.fit_reward_model(pairs=(chosen, rejected))
    assert metrics["reward_model/loss"] == pytest.approx(math.log(2), abs=1e-6)  # 0.693147
    assert metrics["reward_model/accuracy"] == 1.0


def test_marlhf_saves_a_reward_model_that_reloads(qwen_bpe, tmp_path):
    """Stage 1 fits the model on the team's pairs; reward_model/ reloads with fit_reward_model=False and scores
    the same."""
    settings = dict(
        prompts_per_step=2,
        num_generations=2,
        max_new_tokens=4,
        max_steps=1,
        progress_bar=False,
        reward_call="batched",
        preference_num_candidates=4,
        reward_learning_rate=1e-3,
        reward_num_train_epochs=3,
    )
    trainer = MARLHFTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=MARLHFConfig(**settings, output_dir=str(tmp_path)),
    )
    metrics = trainer.train()
    assert metrics["reward_model/pairs"] >= 8
    assert metrics["reward_model/accuracy"] > 0.5
    assert "reward/task" in metrics
    saved = tmp_path / "agents" / "reward_model"
    assert (saved / "value_head.pt").exists()
    again = MARLHFTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=MARLHFConfig(**settings, reward_model=str(saved), fit_reward_model=False),
    )
    assert again.reward_model_fitted
    texts = [joint_observation(["x", "y"], ["abc", "d"]), joint_observation(["x", "y"], ["a", "bcdef"])]
    assert torch.allclose(
        reward_scores(again.reward_model, texts), reward_scores(trainer.reward_model, texts)
    )
    # a folder without a fitted head scored 0 everywhere (a zero head): every advantage 0, nothing learnt. The config
    # refuses it, before any model loads.
    for unfitted, where in (
        (None, "reward_model is not set"),
        (qwen_bpe, f"{qwen_bpe} has no value_head.pt"),
    ):
        with pytest.raises(
            ConfigError,
            match=rf"^fit_reward_model=False scores with reward_model= as it is, but {re.escape(where)}: point "
            r"reward_model= at a fitted one \(the reward_model/ folder a MARLHF run saves\) or set fit_reward_model=True$",
        ):
            MARLHFConfig(**settings, reward_model=unfitted, fit_reward_model=False)


def test_reward_scores_of_no_texts_are_empty(qwen_bpe):
    """Under data parallelism a process's share of the pairs may be empty: no forward, an empty tensor."""
    from comarl.critics import CriticModel

    assert reward_scores(CriticModel.from_pretrained(qwen_bpe), []).shape == (0,)


def test_marlhf_needs_reward_model_when_agent_0_is_an_object(qwen_bpe):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    agents = [
        Agent(AutoModelForCausalLM.from_pretrained(qwen_bpe), AutoTokenizer.from_pretrained(qwen_bpe))
        for _ in range(2)
    ]
    assert agents[0].source is None
    with pytest.raises(
        ConfigError, match=r"^MARLHF: set reward_model= \(a hub id or path\); agent 0 was given as an object$"
    ):
        MARLHFTrainer(
            agents=agents,
            train_dataset=DATA,
            reward_func=length_reward,
            args=MARLHFConfig(prompts_per_step=2, num_generations=2, max_new_tokens=4, progress_bar=False),
        )


def test_marlhf_plans_a_reward_model_it_does_not_fit_as_frozen(qwen_bpe, tmp_path):
    """A fitted reward model used as it is (fit_reward_model=False, no refits) holds its fp32 weights only (4 bytes
    per parameter); one that is fit also its gradients and AdamW state (16)."""
    from comarl.critics import CriticModel
    from comarl.memory import model_size

    fitted = tmp_path / "reward_model"
    CriticModel.from_pretrained(qwen_bpe).save(fitted)
    size = model_size(str(fitted), lm_head=False)

    def planned(**kw):
        trainer = _small_marlhf(qwen_bpe, reward_model=str(fitted), **kw)
        return {m.name: m for m in trainer._memory_plan([qwen_bpe] * 2, ["cpu"] * 2)}["reward model"].total

    assert planned(fit_reward_model=False) == 4 * size.parameters
    assert planned(fit_reward_model=False, reward_refit_steps=2) == 16 * size.parameters


def test_marlhf_refits_every_k_steps_after_the_first(qwen_bpe, monkeypatch):
    """reward_refit_steps=2: refits at steps 3, 5, ...; the first fit is at step 1 only when the model is unfitted."""
    from comarl.trainers.magrpo import MAGRPOTrainer

    monkeypatch.setattr(MAGRPOTrainer, "training_step", lambda self, items, seeds=None: ({}, []))
    trainer = _small_marlhf(qwen_bpe, reward_refit_steps=2)
    fits = []

    def fit():
        fits.append(trainer.step)
        trainer.reward_model_fitted = True
        return {"reward_model/loss": 0.5}

    trainer.fit_reward_model = fit
    for step in range(1, 6):
        trainer.step = step
        metrics, _ = trainer.training_step(DATA[:2])
        assert ("reward_model/loss" in metrics) == (step in (1, 3, 5))
    assert fits == [1, 3, 5]
    fits.clear()
    trainer.reward_model_fitted = True  # as fit_reward_model=False leaves it: nothing to fit at step 1
    for step in range(1, 6):
        trainer.step = step
        trainer.training_step(DATA[:2])
    assert fits == [3, 5]


def test_marlhf_refuses_to_fit_on_no_pairs(qwen_bpe):
    trainer = _small_marlhf(qwen_bpe, preference_num_candidates=3)
    with pytest.raises(
        ConfigError,
        match=r"^MARLHF: 0 chosen and 0 rejected texts; the reward model needs pairs to learn from$",
    ):
        trainer.fit_reward_model(pairs=([], []))
    trainer._preference_texts = lambda: ([], [])  # every candidate got the same task reward
    with pytest.raises(
        ConfigError,
        match=r"^MARLHF: 0 chosen and 0 rejected texts; the reward model needs pairs to learn from \(every candidate "
        r"of every training prompt got the same task reward: raise preference_num_candidates, now 3, or the "
        r"sampling temperature\)$",
    ):
        trainer.fit_reward_model()


@pytest.mark.slow
def test_marlhf_raises_the_task_reward_through_the_learned_reward(demo_team, tmp_path):
    """The reward model learns the initial team's preferences (accuracy >= 0.8 on its pairs) and MAGRPO on its
    scores lifts the task reward the team never sees, from ~0.03 at step 1 to >= 0.15 (mean of steps 41-60; seeds
    0 and 1 give 0.219 and 0.207 there, still rising: 0.233 and 0.33 over steps 61-80)."""
    trainer = demo.demo_trainer(
        MARLHFTrainer,
        demo_team,
        _demo_args(
            MARLHFConfig,
            max_steps=60,
            num_generations=12,
            preference_num_candidates=16,
            reward_learning_rate=3e-4,
            reward_num_train_epochs=5,
            output_dir=str(tmp_path),
        ),
    )
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward_model/accuracy"] >= 0.8
    task = [r["reward/task"] for r in rows if "reward/task" in r]
    assert task[0] < 0.1
    assert sum(task[40:]) / len(task[40:]) >= 0.15


# ---------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"beta": 0.1},
            "beta=0.1, kl_penalty='loss': MADPO's pull towards the reference is dpo_beta; set beta=0",
        ),
        (
            {"kl_penalty": "reward"},
            "beta=0.0, kl_penalty='reward': MADPO's pull towards the reference is dpo_beta",
        ),
        ({"num_generations": 1}, "MADPO: 1 candidates per prompt cannot form a preference pair"),
        ({"num_turns": 2}, "num_turns=2: MADPO compares whole single-turn joint answers"),
        (
            {"joint_mode": "cross"},
            "joint_mode='cross': MADPO's joint candidate k is every agent's k-th answer",
        ),
        ({"pair_selection": "best"}, "pair_selection='best': choose one of"),
        ({"dpo_beta": 0.0}, "dpo_beta=0.0: must be > 0"),
        ({"candidates_from": "past"}, "candidates_from='past': choose one of"),
        ({"baseline": "group_mean"}, "MADPO learns from preference pairs, not advantages"),
        ({"preference_pairs_per_sample": 0}, "preference_pairs_per_sample=0: must be an integer >= 1"),
        (
            {"mask_truncated_completions": True},
            "mask_truncated_completions=True masks a policy-gradient loss; MADPO's DPO loss compares whole answers",
        ),
    ],
)
def test_madpo_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        MADPOConfig(**kwargs)


def test_comlrl_preference_spellings_and_marlhf_errors():
    assert MADPOConfig(preference_num_candidates=6).num_generations == 6
    with pytest.raises(ConfigError, match="reward_refit_steps=-1: must be an integer >= 0"):
        MARLHFConfig(reward_refit_steps=-1)
    with pytest.raises(ConfigError, match="MARLHF: 1 candidates per prompt"):
        MARLHFConfig(preference_num_candidates=1)


def test_marlhf_resumes_with_its_reward_model(qwen_bpe, tmp_path):
    """The reward model, its optimizer and whether it is fitted are in the checkpoint: resumed at step 2 with a
    refit at step 3, the run ends where the unbroken run ends."""

    def trainer(max_steps, **kw):
        args = MARLHFConfig(
            prompts_per_step=2,
            num_generations=2,
            max_new_tokens=4,
            max_steps=max_steps,
            progress_bar=False,
            reward_call="batched",
            preference_num_candidates=3,
            reward_learning_rate=1e-3,
            reward_refit_steps=2,
            learning_rate=1e-3,
            seed=4,
            **kw,
        )
        return MARLHFTrainer(
            model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=length_reward, args=args
        )

    unbroken = trainer(4)
    expected = unbroken.train()
    trainer(2, save_steps=2, output_dir=str(tmp_path)).train()
    resumed = trainer(4, output_dir=str(tmp_path))
    metrics = resumed.train(resume_from_checkpoint=True)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert (
        "reward_model/loss" in rows[1]
        and "reward_model/loss" in rows[3]
        and "reward_model/loss" not in rows[4]
    )
    for a, b in zip(unbroken.team, resumed.team):
        assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    for x, y in zip(unbroken.reward_model.parameters(), resumed.reward_model.parameters()):
        assert torch.equal(x, y)
    assert metrics["reward"] == expected["reward"]


def test_marlhf_checkpoint_carries_whether_the_reward_model_is_fitted(qwen_bpe):
    """A run resumed after its reward model was fit goes on with that model, instead of fitting it again at the
    next step (with reward_refit_steps=0 it would be refit on the current team's answers)."""
    fitted = _small_marlhf(qwen_bpe)
    fitted.reward_model_fitted = True
    with torch.no_grad():
        fitted.reward_model.head.linear.bias.fill_(1.5)
    resumed = _small_marlhf(qwen_bpe)
    assert not resumed.reward_model_fitted
    resumed.load_checkpoint_state(fitted.checkpoint_state())
    assert resumed.reward_model_fitted and resumed.reward_model.head.linear.bias.tolist() == [1.5]


@pytest.mark.parametrize("trainer", ["madpo", "marlhf"])
def test_cli_trains_preference_methods_from_yaml(tmp_path, capsys, trainer):
    from comarl.cli import main
    from comarl.config import config_class, config_help

    assert all(config_help(config_class(trainer)).values())  # a help line per field
    spec = tmp_path / "run.yaml"
    spec.write_text(
        f"trainer: {trainer}\ntask: demo\nargs:\n  max_steps: 1\n  max_new_tokens: 3\n  progress_bar: false\n  prompts_per_step: 2\n"
        "  num_generations: 4\n  reward_call: batched\n  success_threshold: 1.0\n"
        + (
            "  preference_num_candidates: 2\n  preference_pairs_per_sample: 1\n"
            if trainer == "marlhf"
            else ""
        )
    )
    out = tmp_path / "out"
    assert main(["train", str(spec), "--set", f"output_dir={out}"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "eval/success" in printed
    if trainer == "marlhf":
        assert (
            "reward_model/accuracy" in printed
            and (out / "agents" / "reward_model" / "value_head.pt").is_file()
        )
    else:
        assert "pairs" in printed and (out / "agents" / "agent_1").is_dir()
