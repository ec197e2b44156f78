"""Hand-computed checks of the actor-critic, preference, KL-in-reward and schedule math that a second and a third
mutation test found unpinned by the other tests.

Each test names the mutation it kills; every expected number is worked out by hand in the comments.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.testing import assert_close

from comarl import (
    IACConfig,
    IACTrainer,
    MAACConfig,
    MAACTrainer,
    MADPOConfig,
    MADPOTrainer,
    MAGRPOConfig,
    MAGRPOTrainer,
    MARLHFConfig,
    MARLHFTrainer,
)
from comarl.algorithms import aggregate_loss, clipped_surrogate, explained_variance
from comarl.critics import last_token_hidden
from comarl.tasks import demo
from comarl.trainers.magrpo import lr_lambda

# ----------------------------------------------------------------------------- clipped_surrogate, explained_variance


def test_clipped_surrogate_scores_a_masked_position_at_ratio_one_with_no_gradient():
    """After EOS the log-ratio is set to 0 *before* the exponential (mutation: no ``torch.where`` on the log-ratio,
    so exp(0 - (-100)) = exp(100) overflows float32 to inf there).

    A = 2, eps = 0.2. Scored position: logp = old = -1 -> ratio 1, loss -min(2, 2) = -2.
    Masked position: logp 0, old -100. Ratio 1 -> loss -2, not clipped; under the mutation the ratio is inf and
    the loss -min(inf * 2, 1.2 * 2) = -2.4. Its backward: the masked loss gets gradient 0, which the exponential
    turns into 0 * inf = NaN under the mutation; with the mask it stays 0. dapo over 1 scored token: d/d logp_0 =
    -A * ratio = -2.
    """
    logp = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -100.0]])
    mask = torch.tensor([[1, 0]])
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([2.0]), 0.2, mask=mask)
    assert loss.tolist() == [[-2.0, -2.0]]
    assert clipped.tolist() == [[0.0, 0.0]]
    aggregate_loss(loss, mask, "dapo", num_sequences=1, num_tokens=1, max_completion_length=2).backward()
    assert logp.grad.tolist() == [[-2.0, 0.0]]


def test_explained_variance_is_one_minus_the_residual_variance_ratio():
    """EV = 1 - Var(y - V) / Var(y) (mutation: Var(V) / Var(y), which agrees on the two cases the other tests try:
    V = y gives 1 and a constant V gives 0).

    y = [1, 2, 3]: Var(y) = (1 + 0 + 1) / 2 = 1 (unbiased).
    V = [3, 2, 1]: y - V = [-2, 0, 2], Var = (4 + 0 + 4) / 2 = 4 -> EV = 1 - 4 = -3 (mutation: Var(V) / 1 = 1).
    V = [1, 2, 2]: y - V = [0, 0, 1], mean 1/3, Var = (1/9 + 1/9 + 4/9) / 2 = 1/3 -> EV = 2/3 (mutation: V has
    mean 5/3, Var(V) = (4/9 + 1/9 + 1/9) / 2 = 1/3).
    """
    y = torch.tensor([1.0, 2.0, 3.0])
    assert explained_variance(torch.tensor([3.0, 2.0, 1.0]), y) == pytest.approx(-3.0)
    assert explained_variance(torch.tensor([1.0, 2.0, 2.0]), y) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- actor-critic advantages


@pytest.fixture(scope="module")
def demo_team(tmp_path_factory):
    return [str(p) for p in demo.build_team(tmp_path_factory.mktemp("math-gaps") / "models")]


def _fixed_reward(alice, bob, **_):
    """Team rewards by position in the batch: node 0's two joint actions 1 and 3, node 1's 0 and 4."""
    return [1.0, 3.0, 0.0, 4.0][: len(alice)]


def _demo_trainer(
    trainer_cls,
    demo_team,
    reward_func=_fixed_reward,
    transition=None,
    formatters=None,
    critic_model=None,
    **settings,
):
    """``trainer_cls`` (IAC, MAAC, MAGRPO, MADPO) on the demo game: one step of 2 prompts x 2 samples of 2 tokens,
    seeded, unless ``settings`` say otherwise; ``critic_model`` for the actor-critics."""
    config = {
        "IACTrainer": IACConfig,
        "MAACTrainer": MAACConfig,
        "MAGRPOTrainer": MAGRPOConfig,
        "MADPOTrainer": MADPOConfig,
    }[trainer_cls.__name__]
    base = dict(max_steps=1, prompts_per_step=2, num_generations=2, max_new_tokens=2, reward_call="batched")
    return trainer_cls(
        agents=demo_team,
        train_dataset=demo.dataset(),
        reward_func=reward_func,
        formatters=formatters or [demo.formatter(0), demo.formatter(1)],
        transition=transition,
        **({"critic_model": critic_model} if critic_model is not None else {}),
        args=config(**{**base, "progress_bar": False, "seed": 0, **settings}),
    )


def _capture_actor_inputs(trainer, values):
    """Fix the critic's values, skip the updates; returns (the rollout holder, agent -> (A, targets, V_old))."""
    collect, seen, calls = trainer._collect, {}, {}

    def collecting(items, seeds=None):
        seen["rollout"] = collect(items, seeds)
        return seen["rollout"]

    def update_actor(i, gen, advantages, value_targets, old_values):
        calls[i] = (advantages.tolist(), value_targets.tolist(), old_values.tolist())
        return {}

    trainer._critic_values = lambda rollout: ([None], values)
    trainer._collect, trainer.update_actor = collecting, update_actor
    trainer.update_critic = lambda *args: {}
    return seen, calls


@pytest.mark.parametrize("whiten_advantages", [False, True])
def test_actor_critic_advantage_is_the_return_less_its_own_nodes_value(demo_team, whiten_advantages):
    """IAC with value heads, one turn, 2 prompts x G = 2 aligned joint actions; the critic's values are fixed by hand:
    V[node, agent] = [[0.5, 1.0], [2.0, -1.0]]. One turn and lambda = 1: the targets are the rewards [[1, 3], [0, 4]].

    agent 0: A = [1 - .5, 3 - .5, 0 - 2, 4 - 2] = [.5, 2.5, -2, 2]
    agent 1: A = [1 - 1, 3 - 1, 0 + 1, 4 + 1] = [0, 2, 1, 5]
    Mutations killed: no baseline (A = the returns [1, 3, 0, 4]); whitening applied although whiten_advantages is
    off; the old values V_old per completion spread with ``repeat`` ([.5, 2, .5, 2]) instead of
    ``repeat_interleave`` ([.5, .5, 2, 2], each node's value for each of its G completions).
    Whitened, agent 0: mean .75, deviations [-.25, 1.75, -2.75, 1.25], squares sum .0625 + 3.0625 + 7.5625
    + 1.5625 = 12.25, unbiased std sqrt(12.25 / 3) = 2.0207259 -> [-.1237179, .8660254, -1.3608971, .6185896];
    agent 1: mean 2, deviations [-2, 0, -1, 3], squares sum 14, std sqrt(14 / 3) = 2.1602469
    -> [-.9258201, 0, -.4629100, 1.3887301]. (Without the baseline, both agents would whiten [1, 3, 0, 4] alike.)
    """
    trainer = _demo_trainer(IACTrainer, demo_team, whiten_advantages=whiten_advantages)
    assert trainer.value_heads is not None
    seen, calls = _capture_actor_inputs(trainer, torch.tensor([[0.5, 1.0], [2.0, -1.0]]))
    trainer.training_step(demo.dataset()[:2])
    assert seen["rollout"].rewards[:, :, 0].tolist() == [
        [1.0, 3.0],
        [0.0, 4.0],
    ]  # the layout the numbers assume
    for i in range(2):
        assert calls[i][1] == [1.0, 3.0, 0.0, 4.0]  # value targets: the returns
    assert calls[0][2] == [0.5, 0.5, 2.0, 2.0] and calls[1][2] == [1.0, 1.0, -1.0, -1.0]
    if whiten_advantages:
        assert calls[0][0] == pytest.approx([-0.1237179, 0.8660254, -1.3608971, 0.6185896], abs=1e-6)
        assert calls[1][0] == pytest.approx([-0.9258201, 0.0, -0.4629100, 1.3887301], abs=1e-6)
    else:
        assert calls[0][0] == [0.5, 2.5, -2.0, 2.0]
        assert calls[1][0] == [0.0, 2.0, 1.0, 5.0]


def test_actor_critic_targets_use_the_discount_as_gamma_and_gae_lambda_as_lambda(demo_team):
    """Two turns (the first paid 1, the second 4 and last), discount .5, gae_lambda .25, G = 2 aligned, one prompt:
    root node 0 -> children 1 and 2 (one per joint action); values fixed by hand V = [0, 2, 6] (both agents).
    Leaves: G = 4. Root action to child c: G = 1 + .5 (.75 V[c] + .25 * 4) = 1.5 + .375 V[c] -> 2.25 and 3.75.
    (Mutation: discount and lambda swapped in the call, gamma .25 and lambda .5: 1 + .25 (.5 V + .5 * 4) = 1.5
    + .125 V -> 1.75 and 2.25. The other tests use lambda = 1 with V = 0, where the swap gives the same numbers.)
    Advantages (whitening off) G - V[node]: [2.25, 3.75, 4 - 2, 4 - 2, 4 - 6, 4 - 6].
    """
    trainer = _demo_trainer(
        IACTrainer,
        demo_team,
        reward_func=lambda a, b, prompts: [4.0 if p.startswith("again") else 1.0 for p in prompts[0]],
        transition=lambda item, completions, history: ["again", "again"],
        prompts_per_step=1,
        num_turns=2,
        discount=0.5,
        gae_lambda=0.25,
        whiten_advantages=False,
    )
    seen, calls = _capture_actor_inputs(trainer, torch.tensor([[0.0, 0.0], [2.0, 2.0], [6.0, 6.0]]))
    trainer.training_step(demo.dataset()[:1])
    rollout = seen["rollout"]
    assert rollout.child.tolist() == [[1, 2], [-1, -1], [-1, -1]]  # the tree the numbers assume
    assert rollout.rewards[:, :, 0].tolist() == [[1.0, 1.0], [4.0, 4.0], [4.0, 4.0]]
    for i in range(2):
        assert calls[i][1] == pytest.approx([2.25, 3.75, 4.0, 4.0, 4.0, 4.0])
        assert calls[i][0] == pytest.approx([2.25, 3.75, 2.0, 2.0, -2.0, -2.0])


def test_q_critic_advantage_is_q_less_the_counterfactual_baseline_and_v_old_the_mean_q(demo_team):
    """MAAC with critic_type 'q', one prompt, G = 2, N = 2: the 4 joint actions (0,0), (0,1), (1,0), (1,1) with
    Q fixed by hand: agent 0 [1, 2, 3, 4], agent 1 [10, 20, 30, 40]; team rewards [1, 3, 0, 4]; whitening off.
    Counterfactual baselines (the agent's other answer, partner kept): agent 0 [3, 4, 1, 2], agent 1
    [20, 10, 40, 30]; Q - b: agent 0 [-2, -2, 2, 2], agent 1 [-10, 10, -10, 10]; per completion, the mean over
    the joint actions holding it: agent 0 answer 0 in (0,0), (0,1) -> -2, answer 1 -> 2; agent 1 answer 0 in
    (0,0), (1,0) -> -10, answer 1 -> 10 (mutation: no baseline -> agent 0 [1.5, 3.5], agent 1 [20, 30]).
    V_old per completion: the node's mean Q, agent 0 (1 + 2 + 3 + 4) / 4 = 2.5, agent 1 25 (mutation: max over
    the joint actions -> 4 and 40). Targets: agent 0 [(1 + 3) / 2, (0 + 4) / 2] = [2, 2], agent 1
    [(1 + 0) / 2, (3 + 4) / 2] = [.5, 3.5].
    """
    trainer = _demo_trainer(
        MAACTrainer,
        demo_team,
        prompts_per_step=1,
        joint_mode="cross",
        critic_type="q",
        whiten_advantages=False,
    )
    q = torch.tensor([[[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]]])
    seen, calls = _capture_actor_inputs(trainer, q)
    trainer.training_step(demo.dataset()[:1])
    assert seen["rollout"].joint_index[0].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert calls[0] == ([-2.0, 2.0], [2.0, 2.0], [2.5, 2.5])
    assert calls[1] == ([-10.0, 10.0], [0.5, 3.5], [25.0, 25.0])


@pytest.mark.parametrize("value_clip", [None, 0.2])
def test_value_head_loss_is_value_coef_times_the_mini_batch_mean(demo_team, value_clip):
    """The value head trains in the actor's forward on value_coef x sum_i L_i / |mini-batch| (mutations: the
    coefficient dropped; ``.mean()`` over each micro-batch instead of the sum over the mini-batch's size, which
    equals it only when the micro-batch is the whole mini-batch; value_clip not passed to this loss).

    Two completions, micro_batch_size 1 (two micro-batches of one row), advantages 0 (no policy gradient reaches
    the head), the head starts at 0 so V = 0, targets y = [1, -1], V_old = [.5, .5], value_coef .5.
    Unclipped: L = .5 (V - y)^2 = [.5, .5]; metric sum L / 2 = .5; d/d bias = .5 * ((0 - 1) + (0 + 1)) / 2 = 0.
    value_clip .2: V_clip = .5 + clip(0 - .5, -.2, .2) = .3; row 0: max((0 - 1)^2, (.3 - 1)^2) = max(1, .49) = 1,
    unclipped, gradient V - y = -1; row 1: max((0 + 1)^2, (.3 + 1)^2) = max(1, 1.69) = 1.69, the clipped term,
    whose clamp is saturated: gradient 0. Metric (.5 + .845) / 2 = .6725; d/d bias = .5 * (-1 + 0) / 2 = -.25.
    Under the mutations: no coefficient -> -.5; mean per micro-batch -> .5 * (-1) = -.5 and metric .5 + .845.
    Targets [1, 3] unclipped (second call): d/d bias = .5 * (-1 - 3) / 2 = -1; metric .5 (1 + 9) / 2 = 2.5
    (no coefficient: -2; mean per micro-batch: -2 and metric 5).
    """
    from comarl.engines import HFEngine, SamplingParams

    trainer = _demo_trainer(
        IACTrainer, demo_team, value_coef=0.5, value_clip=value_clip, micro_batch_size=1, max_grad_norm=None
    )
    head, agent = trainer.value_heads[0], trainer.team[0]
    gen = HFEngine().generate(agent, ["alice and bob"], 2, SamplingParams(max_new_tokens=2))
    grads, step = [], trainer._step

    def capture(optimizer, parameters, value_head):
        grads.append(float(head.linear.bias.grad))
        optimizer.zero_grad(set_to_none=True)  # a step on no gradient: the head stays at 0 for the next call
        return step(optimizer, parameters, value_head)

    trainer._step = capture
    zeros, old = torch.zeros(2), torch.tensor([0.5, 0.5])
    metrics = trainer.update_actor(0, gen, zeros, torch.tensor([1.0, -1.0]), old)
    if value_clip is None:
        assert grads[-1] == pytest.approx(0.0, abs=1e-7) and metrics["value_loss"] == pytest.approx(0.5)
    else:
        assert grads[-1] == pytest.approx(-0.25) and metrics["value_loss"] == pytest.approx(0.6725)
        return
    metrics = trainer.update_actor(0, gen, zeros, torch.tensor([1.0, 3.0]), old)
    assert grads[-1] == pytest.approx(-1.0) and metrics["value_loss"] == pytest.approx(2.5)


@pytest.mark.parametrize("value_clip", [None, 0.2])
def test_a_separate_critic_clips_its_values_like_the_value_head(demo_team, value_clip):
    """update_critic's loss is sum_samples mean_outputs value_loss(V, V_old, y, value_clip) / |mini-batch|
    (mutation: value_clip not passed, so the critic never clips).

    A fresh critic (zero head: V = 0) on 2 samples, one mini-batch, targets y = [1, -1], V_old = [.5, .5].
    Unclipped: L = .5 y^2 = [.5, .5], value_loss metric (.5 + .5) / 2 = .5, d/d bias = ((0 - 1) + (0 + 1)) / 2 = 0.
    value_clip .2: V_clip = .5 + clip(-.5, -.2, .2) = .3; row 0: max(1, (.3 - 1)^2 = .49) = 1, gradient -1;
    row 1: max(1, (.3 + 1)^2 = 1.69) = 1.69 through the saturated clamp, gradient 0. Metric (.5 + .845) / 2 = .6725,
    d/d bias = (-1 + 0) / 2 = -.5.
    """
    trainer = _demo_trainer(
        IACTrainer, demo_team, critic_model=demo_team[0], value_clip=value_clip, max_grad_norm=None
    )
    critic = trainer.critics[0]
    grads, step = [], trainer._step

    def capture(optimizer, parameters, head):
        grads.append(float(critic.head.linear.bias.grad))
        return step(optimizer, parameters, head)

    trainer._step = capture
    samples = critic.encode(["agent 0 sees: a", "agent 0 sees: b c"])
    stats = trainer.update_critic(0, samples, torch.tensor([[1.0], [-1.0]]), torch.tensor([[0.5], [0.5]]))
    assert len(grads) == 1
    if value_clip is None:
        assert grads[0] == pytest.approx(0.0, abs=1e-7) and stats["value_loss"] == pytest.approx(0.5)
    else:
        assert grads[0] == pytest.approx(-0.5) and stats["value_loss"] == pytest.approx(0.6725)


def test_ppo_mini_batches_of_one_epoch_keep_the_behaviour_log_probs(demo_team, monkeypatch):
    """num_iterations 1 with num_mini_batches 2 still reuses the batch: the second mini-batch is scored after the
    first one's step, so its ratio is pi_new / pi_old, not 1 (mutation: old log-probs only when num_iterations > 1,
    so each mini-batch's behaviour is its own detached log-probs and the clip never acts).
    The first mini-batch's ratio is 1 (no step yet: old = new up to float noise of the batching); lr 1e-2 moves
    the policy, so on the second |log pi_new - log pi_old| > 1e-4 somewhere.
    """
    import comarl.trainers.actor_critic as actor_critic

    trainer = _demo_trainer(IACTrainer, demo_team, num_mini_batches=2, learning_rate=1e-2)
    seen, surrogate = [], actor_critic.clipped_surrogate

    def spy(logprobs, old_logprobs, *args, **kwargs):
        seen.append((logprobs.detach().clone(), old_logprobs.clone()))
        return surrogate(logprobs, old_logprobs, *args, **kwargs)

    monkeypatch.setattr(actor_critic, "clipped_surrogate", spy)
    trainer.training_step(demo.dataset()[:2])
    assert len(seen) == 4  # 2 agents x 2 mini-batches
    for first, second in (seen[0:2], seen[2:4]):
        assert_close(first[0], first[1], atol=1e-5, rtol=0)
        assert float((second[0] - second[1]).abs().max()) > 1e-4


def test_approx_kl_metric_is_k3_of_the_sampler_against_the_new_policy(demo_team):
    """approx_kl estimates KL(pi_old || pi) from tokens pi_old sampled: k3 with r = pi / pi_old,
    (r - 1) - log r (mutation: the arguments of kl_k3 swapped, r = pi_old / pi).
    The behaviour log-probs are made the policy's + .5 on every token, and no step moves the policy, so on every
    scored token log r = -.5: k3 = e^-.5 - 1 + .5 = .6065307 - .5 = .1065307 (mutation: e^.5 - 1 - .5 =
    1.6487213 - 1.5 = .1487213); the metric, a token mean, is that number.
    """
    from comarl.engines import HFEngine, SamplingParams

    trainer = _demo_trainer(IACTrainer, demo_team, num_iterations=2)
    logprobs, step = trainer._logprobs, trainer._step
    trainer._logprobs = lambda i, gen, batches, model=None: logprobs(i, gen, batches, model) + 0.5

    def no_move(optimizer, parameters, head):
        optimizer.zero_grad(set_to_none=True)
        return step(optimizer, parameters, head)

    trainer._step = no_move
    gen = HFEngine().generate(trainer.team[0], ["alice and bob"], 2, SamplingParams(max_new_tokens=2))
    zeros = torch.zeros(2)
    metrics = trainer.update_actor(0, gen, torch.tensor([1.0, -1.0]), zeros, zeros)
    assert metrics["approx_kl"] == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-5)


@pytest.mark.parametrize("aggregation", ["dapo", "grpo"])
def test_each_ppo_mini_batch_is_normalised_by_its_own_size(demo_team, aggregation):
    """A mini-batch's policy loss is normalised over that mini-batch: dapo by its scored tokens, grpo by its
    sequences (mutations: the whole batch's tokens, ``row_tokens.sum()``; the whole batch's size M).
    4 completions in 2 mini-batches of 2, every advantage 1, and no step moves the policy, so the ratio is 1:
    dapo: -(sum over the mini-batch's tokens of 1) / its tokens = -1 per mini-batch, metric (-1 - 1) / 2 = -1
    (mutation: -(n_1 + n_2) / (n_1 + ... + n_4) per mini-batch, averaging to -1/2);
    grpo: -(1/2) (1 + 1) = -1 per mini-batch (mutation: -(1/4)(1 + 1) = -1/2).
    """
    from comarl.engines import HFEngine, SamplingParams

    trainer = _demo_trainer(IACTrainer, demo_team, num_mini_batches=2, loss_aggregation=aggregation)
    step = trainer._step

    def no_move(optimizer, parameters, head):
        optimizer.zero_grad(set_to_none=True)
        return step(optimizer, parameters, head)

    trainer._step = no_move
    gen = HFEngine().generate(
        trainer.team[0], ["alice and bob", "the agents"], 2, SamplingParams(max_new_tokens=2)
    )
    zeros = torch.zeros(4)
    metrics = trainer.update_actor(0, gen, torch.ones(4), zeros, zeros)
    assert metrics["loss"] == pytest.approx(-1.0, abs=1e-5)


@pytest.mark.parametrize(("critic_type", "agent"), [("v", 1), ("v", None), ("q", None)])
def test_a_separate_v_critic_regresses_on_the_mean_of_its_nodes_joint_action_targets(critic_type, agent):
    """A V critic gets one sample per node, whose target is the mean over the node's K joint actions' TD(lambda)
    targets (mutation: ``targets[:, 0]``, the first joint action's only); a Q critic one sample per joint action.

    targets[node, k, agent] = [[[1, 10], [3, 30]], [[0, 0], [4, 8]]]:
    V, means over k: node 0 [(1 + 3) / 2, (10 + 30) / 2] = [2, 20], node 1 [(0 + 4) / 2, (0 + 8) / 2] = [2, 4]
    (mutation: [[1, 10], [0, 0]]); agent 1's own critic: the column [[20], [4]] with its old values [[-1], [-3]].
    Q: the 4 joint actions in order, [[1, 10], [3, 30], [0, 0], [4, 8]], and the old Q values alike.
    """
    from types import SimpleNamespace

    from comarl.trainers.actor_critic import ActorCriticTrainer

    owner = SimpleNamespace(args=SimpleNamespace(critic_type=critic_type))
    targets = torch.tensor([[[1.0, 10.0], [3.0, 30.0]], [[0.0, 0.0], [4.0, 8.0]]])
    old = torch.tensor([[0.0, -1.0], [2.0, -3.0]]) if critic_type == "v" else -targets
    inputs = (torch.zeros(2, 1), torch.ones(2, 1))
    got_inputs, got, got_old = ActorCriticTrainer._critic_samples(owner, inputs, targets, old, agent)
    assert got_inputs is inputs
    if critic_type == "q":
        assert got.tolist() == [[1.0, 10.0], [3.0, 30.0], [0.0, 0.0], [4.0, 8.0]]
        assert torch.equal(got_old, -got)
    elif agent == 1:
        assert got.tolist() == [[20.0], [4.0]] and got_old.tolist() == [[-1.0], [-3.0]]
    else:
        assert got.tolist() == [[2.0, 20.0], [2.0, 4.0]] and torch.equal(got_old, old)


def test_actor_critic_schedule_spans_every_mini_batch_step(demo_team):
    """An actor's linear decay runs over steps x num_iterations x num_mini_batches optimizer steps (mutation: the
    mini-batches left out, so it reaches 0 halfway through the run).
    max_steps 2, num_iterations 1, num_mini_batches 2: total 4, factor(s) = 1 - s / 4 -> [1, .75, .5, .25, 0]
    (mutation: total 2 -> [1, .5, 0, 0, 0]).
    """
    trainer = _demo_trainer(
        IACTrainer, demo_team, max_steps=2, num_mini_batches=2, lr_scheduler_type="linear"
    )
    for scheduler in trainer.schedulers:
        factor = scheduler.lr_lambdas[0]
        assert [factor(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


# ----------------------------------------------------------------------------- MARLHF's reward model

DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob", "return a + b")]


def length_reward(a, b):
    return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]


def _marlhf(model, data=DATA, **settings):
    return MARLHFTrainer(
        model=model,
        num_agents=2,
        train_dataset=data,
        reward_func=length_reward,
        args=MARLHFConfig(
            prompts_per_step=2, num_generations=2, max_new_tokens=4, progress_bar=False, **settings
        ),
    )


def test_reward_model_step_is_the_gradient_of_the_mean_pair_loss_and_a_tie_is_not_correct(qwen_bpe):
    """One batch of 4 pairs, a fresh (zero) head, so every score is 0 and sigmoid(s_w - s_l) = 1/2:
    L = (1/4) sum_p -log sigmoid(s_w - s_l), dL/dW = (1/4) sum_p -(1 - 1/2) (h_w - h_l) = -1/2 mean_p (h_w - h_l),
    with h the backbone's last-token hidden state (mutation: ``losses.sum().backward()``, 4x this gradient; AdamW's
    scale invariance hides it from a test that only looks at the scores after the step).
    With the step skipped the scores stay 0: every pair is a tie, which is not a correct ranking, so the accuracy
    is 0, not 1 (mutation: ``after >= 0``); the loss is log 2 = 0.693147.
    """
    trainer = _marlhf(qwen_bpe, reward_train_batch_size=8, max_grad_norm=None)
    rm = trainer.reward_model
    chosen = [f"agent 0 answers: yes {k}" for k in range(4)]
    rejected = [f"agent 0 answers: no no {k}" for k in range(4)]
    grads = []
    trainer.reward_optimizer.step = lambda *a, **k: grads.append(rm.head.linear.weight.grad.clone())
    metrics = trainer.fit_reward_model(pairs=(chosen, rejected))
    assert len(grads) == 1
    with torch.no_grad():
        h = last_token_hidden(rm.model, *rm.encode(chosen + rejected))  # the batch the fit encoded
    expected = -0.5 * (h[:4] - h[4:]).mean(dim=0, keepdim=True)
    assert float(expected.abs().max()) > 1e-3
    assert_close(grads[0], expected, atol=1e-6, rtol=1e-4)
    assert metrics["reward_model/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["reward_model/accuracy"] == 0.0


def test_reward_model_pairs_put_the_higher_rewarded_joint_answer_first(qwen_bpe, monkeypatch):
    """_preference_texts returns (chosen, rejected) with the joint answer of the higher task reward as chosen
    (mutation: the texts built for (lose, win)). The joint observation is replaced by a JSON of the answers, so each
    text's reward, len(a) / 10 - len(b) / 20, is recomputed from it by hand."""
    import comarl.trainers.preference as preference

    monkeypatch.setattr(preference, "joint_observation", lambda obs, answers: json.dumps(answers))
    trainer = _marlhf(qwen_bpe, DATA[:2], preference_num_candidates=4)
    chosen, rejected = trainer._preference_texts()
    assert len(chosen) == len(rejected) > 0
    for win, lose in zip(chosen, rejected):
        (a_w, b_w), (a_l, b_l) = json.loads(win), json.loads(lose)
        assert len(a_w) / 10 - len(b_w) / 20 > len(a_l) / 10 - len(b_l) / 20


# ----------------------------------------------------------------------------- lr_lambda


def _factors(total, **settings):
    factor = lr_lambda(MAGRPOConfig(**settings), total)
    return [factor(s) for s in range(total + 3)]


def test_linear_schedule_by_hand():
    """warmup_steps 2 of total 6, then linear to 0: warmup (s + 1) / (2 + 1) = [1/3, 2/3]; then progress
    (s - 2) / (6 - 2): s = 2..6 -> 1 - [0, 1/4, 1/2, 3/4, 1] = [1, .75, .5, .25, 0]; past the total it stays 0.
    Mutations killed: progress measured from step 0 (s / 6: s = 3 -> .5); the linear branch dropped (cosine:
    s = 3 -> .8535534); warmup s / warmup (s = 0 -> 0); progress not capped at 1 (s = 7 -> -.25, s = 8 -> -.5;
    the trainer stops at s = total, so only a caller of lr_lambda past it sees this).
    (``s <= warmup`` for the warmup test is equivalent: at s = warmup both branches give 1.)
    """
    got = _factors(6, warmup_steps=2, lr_scheduler_type="linear")
    assert got == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0])


def test_cosine_schedule_by_hand():
    """warmup_steps 2 of total 6, then 1/2 (1 + cos(pi p)), p = (s - 2) / 4:
    p = 0 -> 1; 1/4 -> (1 + .7071068) / 2 = .8535534; 1/2 -> .5; 3/4 -> (1 - .7071068) / 2 = .1464466; 1 -> 0;
    and 0 past the total (mutation: p not capped, so s = 8, p = 3/2, gives 1/2 (1 + cos(3 pi / 2)) = .5: the
    rate climbs back). Mutations killed: cos(pi p / 2) (p = 1/4 -> .9238795); 1/2 (1 - cos(pi p)) (p = 0 -> 0).
    """
    got = _factors(6, warmup_steps=2, lr_scheduler_type="cosine")
    assert got == pytest.approx([1 / 3, 2 / 3, 1.0, 0.8535534, 0.5, 0.1464466, 0.0, 0.0, 0.0], abs=1e-7)


def test_constant_schedule_and_warmup_ratio_by_hand():
    """constant: 1 after warmup, up to the last step and past it (mutation: the constant branch dropped, which
    decays by the cosine: s = 4 of 8 -> .5).
    warmup_ratio .25 of total 6: ceil(1.5) = 2 warmup steps (rounded up, as transformers' get_warmup_steps; int()
    gave 1), so s = 0, 1 -> 1 / 3, 2 / 3, then 1; warmup_steps, when set, wins over the ratio.
    """
    assert _factors(8, lr_scheduler_type="constant") == [1.0] * 11
    assert _factors(6, warmup_ratio=0.25, lr_scheduler_type="constant")[:3] == pytest.approx(
        [1 / 3, 2 / 3, 1.0]
    )
    assert _factors(6, warmup_ratio=0.25, warmup_steps=3)[:4] == [0.25, 0.5, 0.75, 1.0]


def _one_agent(model, **settings):
    """MAGRPO with one agent of ``model``, rewarded by its answer's length: 2 prompts x 2 samples of 2 tokens."""
    return MAGRPOTrainer(
        model=model,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda c: [len(x) for x in c],
        args=MAGRPOConfig(
            prompts_per_step=2, num_generations=2, max_new_tokens=2, progress_bar=False, **settings
        ),
    )


def test_magrpo_schedule_spans_every_iteration_step(qwen_bpe):
    """MAGRPO's decay runs over steps x num_iterations optimizer steps (mutation: num_iterations left out).
    max_steps 2, num_iterations 2, linear: total 4, factor(s) = 1 - s / 4 -> [1, .75, .5, .25, 0]
    (mutation: total 2 -> [1, .5, 0, 0, 0]).
    """
    trainer = _one_agent(qwen_bpe, max_steps=2, num_iterations=2, lr_scheduler_type="linear")
    factor = trainer.schedulers[0].lr_lambdas[0]
    assert [factor(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_magrpo_passes_the_lower_and_upper_clip_in_order(qwen_bpe, monkeypatch):
    """epsilon .1 is the lower clip (ratio >= .9) and epsilon_high .3 the upper (ratio <= 1.3) in the policy loss
    (mutation: the two swapped in MAGRPO's call of clipped_surrogate, clip range [.7, 1.1])."""
    import comarl.trainers.magrpo as magrpo
    from comarl.engines import HFEngine, SamplingParams

    trainer = _one_agent(qwen_bpe, epsilon=0.1, epsilon_high=0.3)
    seen, surrogate = [], magrpo.clipped_surrogate

    def spy(logprobs, old_logprobs, advantages, epsilon, epsilon_high=None, mask=None):
        seen.append((epsilon, epsilon_high))
        return surrogate(logprobs, old_logprobs, advantages, epsilon, epsilon_high, mask)

    monkeypatch.setattr(magrpo, "clipped_surrogate", spy)
    gen = HFEngine().generate(trainer.team[0], ["alice and bob"], 2, SamplingParams(max_new_tokens=2))
    trainer.update_agent(0, gen, torch.tensor([1.0, -1.0]))
    assert seen and all(pair == (0.1, 0.3) for pair in seen)


# ----------------------------------------------------------------------------- found by the third mutation test


def _zero_reward(alice, bob, **_):
    return [0.0] * len(alice)


def _reference_shifted(trainer, shift):
    """The reference's log-probs are the policy's + ``shift`` on every token (the policy's are untouched)."""
    logprobs = trainer._logprobs
    trainer._logprobs = lambda i, gen, batches, model=None: (
        logprobs(i, gen, batches, model) + (shift if model is not None else 0.0)
    )


# ----------------------------------------------------------------------------- the KL term of the actor's loss


def test_actor_critic_kl_in_the_loss_adds_beta_times_k3(demo_team):
    """kl_penalty='loss': the per-token loss is the surrogate + beta x k3(pi || ref) (mutation: ``- beta * kl``, which
    rewards moving away from the reference).
    Advantages 0, so the surrogate is -min(r * 0, clip(r) * 0) = 0; entropy_coef 0; the value head starts at 0 and
    its targets and old values are 0, so the value loss is 0. The reference is the policy + .5 on every token:
    ref - logp = .5, k3 = e^.5 - .5 - 1 = 1.6487213 - 1.5 = .1487213 per token. dapo over the tokens: the loss
    metric is beta x .1487213 = .01487213 with beta .1 (mutation: -.01487213); the kl metric .1487213 either way.
    """
    from comarl.engines import HFEngine, SamplingParams

    trainer = _demo_trainer(IACTrainer, demo_team, beta=0.1, kl_penalty="loss")
    assert trainer.references is not None
    _reference_shifted(trainer, 0.5)
    gen = HFEngine().generate(trainer.team[0], ["alice and bob"], 2, SamplingParams(max_new_tokens=2))
    zeros = torch.zeros(2)
    metrics = trainer.update_actor(0, gen, zeros, zeros, zeros)
    k3 = math.exp(0.5) - 1.5
    assert metrics["kl"] == pytest.approx(k3, abs=1e-5)
    assert metrics["loss"] == pytest.approx(0.1 * k3, abs=1e-6)


def test_actor_critic_kl_in_the_reward_is_not_also_in_the_loss(demo_team):
    """kl_penalty='reward': the KL is already in the returns, so the actor's loss has no KL term (mutation: the
    reference log-probs taken whatever kl_penalty says, so the KL counts twice).
    Same set-up as above: advantages 0, zero value loss, the reference the policy + .5. The loss is 0 and there is
    no kl metric (mutation: loss .1 x (e^.5 - 1.5) = .01487213, and a kl metric).
    """
    from comarl.engines import HFEngine, SamplingParams

    trainer = _demo_trainer(IACTrainer, demo_team, beta=0.1, kl_penalty="reward")
    _reference_shifted(trainer, 0.5)
    gen = HFEngine().generate(trainer.team[0], ["alice and bob"], 2, SamplingParams(max_new_tokens=2))
    zeros = torch.zeros(2)
    metrics = trainer.update_actor(0, gen, zeros, zeros, zeros)
    assert "kl" not in metrics
    assert metrics["loss"] == pytest.approx(0.0, abs=1e-7)


# ----------------------------------------------------------------------------- the KL penalty in the rewards


def _two_turns_kl_one(monkeypatch):
    """Every completion's sequence KL is 1 (so its penalty is beta)."""
    import comarl.trainers.magrpo as magrpo

    monkeypatch.setattr(magrpo, "sequence_kl_k1", lambda logp, ref, mask: torch.ones(logp.shape[0]))


def test_magrpo_kl_penalty_in_the_reward_is_discounted_down_the_tree(demo_team, monkeypatch):
    """kl_penalty='reward' recomputes the returns with the run's discount (mutation: ``with_rewards(..., 1.0, ...)``,
    undiscounted; the other tests use one turn, or discount 1, where both agree).
    Two turns, one prompt, G = 2 aligned: root node 0 -> children 1 and 2. Task rewards 0, every KL 1, beta .2:
    each completion's reward is -.2. Leaves: return -.2. Root: -.2 + .5 x mean(-.2, -.2) = -.3 (mutation: -.2
    - .2 = -.4). Per agent, per completion [nodes, G]: [[-.3, -.3], [-.2, -.2], [-.2, -.2]]. The kl_penalty metric:
    the mean penalty, .2 x 1 = .2.
    """
    _two_turns_kl_one(monkeypatch)
    trainer = _demo_trainer(
        MAGRPOTrainer,
        demo_team,
        reward_func=_zero_reward,
        transition=lambda item, completions, history: ["again", "again"],
        prompts_per_step=1,
        num_turns=2,
        discount=0.5,
        beta=0.2,
        kl_penalty="reward",
    )
    rollout = trainer._collect(demo.dataset()[:1])
    assert rollout.child.tolist() == [[1, 2], [-1, -1], [-1, -1]]  # the tree the numbers assume
    metrics = {}
    penalised = trainer._penalised(rollout, metrics)
    for i in range(2):
        assert penalised.returns[i].flatten().tolist() == pytest.approx([-0.3, -0.3, -0.2, -0.2, -0.2, -0.2])
        assert metrics[f"agent_{i}/kl_penalty"] == pytest.approx(0.2)


def test_actor_critic_value_targets_are_the_kl_penalised_returns(demo_team, monkeypatch):
    """IAC with kl_penalty='reward': the critic's targets (and the advantages) come from the penalised rewards
    (mutation: the penalty dropped from the actor-critic step, so the targets are the task returns, 0). The targets
    are TD(lambda) of the penalised rewards (``tree_lambda_returns``), not the rollout's returns, so the discount of
    ``_penalised``'s ``with_rewards`` does not reach them.
    Two turns, one prompt, G = 2, root 0 -> children 1 and 2; task rewards 0, every KL 1, beta .2: every reward -.2.
    Values fixed at 0, lambda = 1, discount .5: leaves -.2; root actions -.2 + .5 x (-.2) = -.3 (penalty dropped:
    0). Targets per completion, both agents: [-.3, -.3, -.2, -.2, -.2, -.2];
    with V = 0 and whitening off the advantages are the same numbers.
    """
    _two_turns_kl_one(monkeypatch)
    trainer = _demo_trainer(
        IACTrainer,
        demo_team,
        prompts_per_step=1,
        num_turns=2,
        discount=0.5,
        gae_lambda=1.0,
        beta=0.2,
        kl_penalty="reward",
        whiten_advantages=False,
        reward_func=_zero_reward,
        transition=lambda item, completions, history: ["again", "again"],
    )
    calls = {}

    def update_actor(i, gen, advantages, value_targets, old_values):
        calls[i] = (advantages.tolist(), value_targets.tolist())
        return {}

    trainer._critic_values = lambda rollout: ([None], torch.zeros(3, 2))
    trainer.update_actor = update_actor
    metrics, _ = trainer.training_step(demo.dataset()[:1])
    expected = [-0.3, -0.3, -0.2, -0.2, -0.2, -0.2]
    for i in range(2):
        assert calls[i][1] == pytest.approx(expected)
        assert calls[i][0] == pytest.approx(expected)
        assert metrics[f"agent_{i}/kl_penalty"] == pytest.approx(0.2)


# ----------------------------------------------------------------------------- the critic's node values


def test_value_heads_read_each_nodes_own_prompt(demo_team, monkeypatch):
    """A value head values node n from node n's prompt, row n x G of the generation (mutation: ``roots =
    arange(nodes)``, rows 0, 1, ...: node 1 would read row 1, node 0's second sample, i.e. node 0's prompt;
    the value heads start at 0, so every other test sees V = 0 whichever prompt is read).
    The hidden state is replaced by the prompt's length in tokens and agent i's head by h -> (i + 1) h. The demo
    tokenizers give one token per word and no BOS: "where will you meet" is 4 tokens, twice that 8.
    V = [[4, 8], [8, 16]] (mutation: node 1 reads node 0's prompt: [[4, 8], [4, 8]]).
    """
    import comarl.trainers.actor_critic as actor_critic

    prompts = ["where will you meet", "where will you meet where will you meet"]
    trainer = _demo_trainer(
        IACTrainer,
        demo_team,
        formatters=[lambda item: item["prompt"]] * 2,
        reward_func=_zero_reward,
    )
    rollout = trainer._collect([{"prompt": p} for p in prompts])
    monkeypatch.setattr(
        actor_critic, "last_token_hidden", lambda model, ids, mask: mask.sum(dim=1, keepdim=True).float()
    )
    trainer.value_heads = [lambda h: h, lambda h: 2 * h]
    _, values = trainer._critic_values(rollout)
    assert values.tolist() == [[4.0, 8.0], [8.0, 16.0]]


def test_a_separate_critic_regresses_on_the_returns_not_the_advantages(demo_team):
    """A separate critic's targets are the TD(lambda) returns themselves (mutation: the returns less the critic's
    own values, ``targets - V``, which the value-head path does not share, so the tests of the head miss it).
    IAC with a critic model per agent, one turn, 2 prompts x G = 2 aligned; team rewards by node [[1, 3], [0, 4]];
    the critic's values fixed by hand V[node, agent] = [[.5, 1], [2, -1]]. One sample per node, target the mean over
    its joint actions: node 0 (1 + 3) / 2 = 2, node 1 (0 + 4) / 2 = 2, for both agents: [[2], [2]]
    (mutation: agent 0 [[2 - .5], [2 - 2]] = [[1.5], [0]], agent 1 [[1], [3]]); the old values are V's column.
    """
    trainer = _demo_trainer(IACTrainer, demo_team, critic_model=demo_team[0])
    assert trainer.value_heads is None and len(trainer.critics) == 2
    critic_calls = {}

    def update_critic(c, samples, targets, old_values):
        critic_calls[c] = (targets.tolist(), old_values.tolist())
        return {}

    trainer._critic_values = lambda rollout: ([None, None], torch.tensor([[0.5, 1.0], [2.0, -1.0]]))
    trainer.update_actor = lambda *args: {}
    trainer.update_critic = update_critic
    trainer.training_step(demo.dataset()[:2])
    assert critic_calls[0] == ([[2.0], [2.0]], [[0.5], [2.0]])
    assert critic_calls[1] == ([[2.0], [2.0]], [[1.0], [-1.0]])


# ----------------------------------------------------------------------------- the centralized critic's loss


def test_centralized_critic_loss_is_the_mean_over_its_outputs(demo_team):
    """A centralized critic (one output per agent) learns sum_samples mean_outputs L / |mini-batch| (mutation: the
    sum over the outputs, N times the loss and gradient; the other critic tests use one output, where both agree).
    A fresh critic (zero head: V = 0) on 2 samples, targets y = [[1, 3], [-1, 1]], V_old = 0, no clip:
    L = .5 y^2 = [[.5, 4.5], [.5, .5]]; per sample mean over outputs [2.5, .5]; / 2 samples: value_loss 1.5
    (mutation: (5 + 1) / 2 = 3). d/d bias_j = sum_s (1/2) (V - y)_sj / 2: j = 0: (-1 + 1) / 4 = 0,
    j = 1: (-3 - 1) / 4 = -1 (mutation: 0 and -2).
    """
    trainer = _demo_trainer(MAACTrainer, demo_team, critic_model=demo_team[0], max_grad_norm=None)
    critic = trainer.critics[0]
    assert critic.head.linear.out_features == 2
    grads, step = [], trainer._step

    def capture(optimizer, parameters, head):
        grads.append(critic.head.linear.bias.grad.tolist())
        return step(optimizer, parameters, head)

    trainer._step = capture
    samples = critic.encode(["agent 0 sees: a\nagent 1 sees: b", "agent 0 sees: b c\nagent 1 sees: a"])
    stats = trainer.update_critic(0, samples, torch.tensor([[1.0, 3.0], [-1.0, 1.0]]), torch.zeros(2, 2))
    assert len(grads) == 1
    assert grads[0] == pytest.approx([0.0, -1.0], abs=1e-6)
    assert stats["value_loss"] == pytest.approx(1.5)


# ----------------------------------------------------------------------------- MADPO with a frozen agent


@pytest.mark.parametrize("dpo_reference", ["none", "initial"])
def test_madpo_frozen_agents_margin_counts_in_the_team_without_a_reference(demo_team, dpo_reference):
    """A frozen agent is not trained, but its margin is part of the team's. Against the initial reference its margin
    is 0 (it is its own reference); reference-free (dpo_reference 'none') it is beta (log pi(w) - log pi(l)), not 0
    (mutation: a frozen agent's margin set to 0 whatever the reference, ``fixed`` without the dpo_reference test).

    One pair (item 0: candidate 0 chosen, 1 rejected), dpo_beta .5, agent 1 frozen; the sequence log-probs are
    fixed by hand: agent 0 [-1, -3], agent 1 [-4, -2]; the reference (dpo_reference 'initial') [-2, -2] for both.
    'none': m_0 = .5 (-1 + 3) = 1, m_1 = .5 (-4 + 2) = -1, team 0: loss -log sigmoid(0) = log 2 = .6931472, margin 0;
    agent 0's row weights d loss / d log pi_0: dloss = -(1 - 1/2) / 1 = -.5, chosen .5 x -.5 = -.25, rejected .25
    (mutation: team 1, loss -log sigmoid(1) = .3132617, chosen weight -.5 (1 - .7310586) = -.1344707).
    'initial': m_0 = .5 ((-1 + 2) - (-3 + 2)) = 1, m_1 = 0, team 1: loss .3132617, chosen weight -.1344707.
    """
    trainer = _demo_trainer(
        MADPOTrainer,
        demo_team,
        prompts_per_step=1,
        dpo_beta=0.5,
        dpo_reference=dpo_reference,
        frozen_agents=[1],
    )
    logp = {0: torch.tensor([-1.0, -3.0]), 1: torch.tensor([-4.0, -2.0])}
    trainer._sequence_logprobs = lambda i, gen, rows, model=None: (
        logp[i][rows] if model is None else torch.tensor([-2.0, -2.0])[rows]
    )
    weights = {}

    def dpo_step(i, gen, rows, weight):
        weights[i] = weight.tolist()
        return {}

    trainer._dpo_step = dpo_step
    ref = [torch.tensor([-2.0, -2.0])] * 2 if dpo_reference == "initial" else None
    metrics = trainer.update_team([None, None], torch.tensor([[0, 0, 1]]), 2, ref)
    assert list(weights) == [0]  # the frozen agent takes no step
    if dpo_reference == "none":
        assert metrics["margin"] == pytest.approx(0.0) and metrics["loss"] == pytest.approx(math.log(2))
        assert weights[0] == pytest.approx([-0.25, 0.25])
    else:
        assert metrics["margin"] == pytest.approx(1.0) and metrics["loss"] == pytest.approx(0.3132617)
        assert weights[0] == pytest.approx([-0.1344707, 0.1344707])
    assert metrics["agent_0/margin"] == pytest.approx(1.0)
