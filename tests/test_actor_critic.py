"""The critic family (IAC, MAAC, IPPO, MAPPO): TD(lambda) by hand, critic losses, update counts, saving, learning."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from comarl import (
    ConfigError,
    IACConfig,
    IACTrainer,
    IPPOConfig,
    IPPOTrainer,
    MAACConfig,
    MAACTrainer,
    MAPPOConfig,
    MAPPOTrainer,
)
from comarl.algorithms import (
    counterfactual_baseline,
    explained_variance,
    token_entropy,
    tree_lambda_returns,
    value_loss,
    whiten,
)
from comarl.critics import (
    VALUE_HEAD_FILE,
    CriticModel,
    ValueHead,
    hidden_size,
    joint_observation,
    last_token_hidden,
    policy_forward,
)
from comarl.tasks import demo, relay

# ----------------------------------------------------------------------------- TD(lambda) / GAE by hand

# A chain of three turns (K = 1 joint action per node, one agent): rewards 1, 0, 2; values 0.5, 1.0, 1.5.
CHAIN = {
    "rewards": torch.tensor([[[1.0]], [[0.0]], [[2.0]]]),
    "values": torch.tensor([[0.5], [1.0], [1.5]]),
    "child": torch.tensor([[1], [2], [-1]]),
    "done": torch.tensor([[False], [False], [False]]),  # the last node ends at the turn limit
}


@pytest.mark.parametrize(
    ("lam", "expected"),
    [
        # GAE, gamma 0.9, lambda 0.5: delta = [1 + .9*1 - .5, 0 + .9*1.5 - 1, 2 - 1.5] = [1.4, .35, .5]
        # A2 = .5; A1 = .35 + .45*.5 = .575; A0 = 1.4 + .45*.575 = 1.65875; G = A + V
        (0.5, [2.15875, 1.575, 2.0]),
        (0.0, [1.0 + 0.9 * 1.0, 0.0 + 0.9 * 1.5, 2.0]),  # one-step TD targets r + gamma V(next)
        (1.0, [1.0 + 0.9 * 1.8, 0.9 * 2.0, 2.0]),  # Monte-Carlo returns, the values play no part
    ],
)
def test_lambda_returns_on_a_chain_are_gae_by_hand(lam, expected):
    got = tree_lambda_returns(**CHAIN, discount=0.9, lam=lam)
    assert torch.allclose(got.flatten(), torch.tensor(expected))


def test_lambda_returns_on_a_tree_average_the_children_and_bootstrap_pruned_branches():
    # Root: joint action 0 -> node 1 (rewards 1 and 3, last turn); joint action 1 ends (done) with 5.
    rewards = torch.tensor([[[2.0], [5.0]], [[1.0], [3.0]]])
    values = torch.tensor([[0.0], [4.0]])
    child = torch.tensor([[1, -1], [-1, -1]])
    got = tree_lambda_returns(rewards, values, child, torch.tensor([[False, True], [False, False]]), 0.5, 0.5)
    # node 1: G = r = [1, 3], mean 2; root action 0: 2 + .5 * (.5 * V1 + .5 * 2) = 2 + .5 * 3 = 3.5
    assert got[:, :, 0].tolist() == [[3.5, 5.0], [1.0, 3.0]]
    # the same action 1 not done but left out of the budget: bootstrapped like its expanded sibling
    pruned = tree_lambda_returns(
        rewards, values, child, torch.tensor([[False, False], [False, False]]), 0.5, 0.5
    )
    assert pruned[0, 1, 0] == 5.0 + 0.5 * 3.0


def test_counterfactual_baseline_keeps_partners_and_averages_own_other_answers():
    # N = 2, G = 2: joint actions (0,0), (0,1), (1,0), (1,1); Q of agent 0 and of agent 1.
    joint = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    q = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]])
    # agent 0 at (0,0): its other answer with partner 0 -> (1,0): 3; agent 1 at (0,0): (0,1): 20
    expected = torch.tensor([[3.0, 20.0], [4.0, 10.0], [1.0, 40.0], [2.0, 30.0]])
    assert torch.equal(counterfactual_baseline(q, joint, 2), expected)
    order = torch.tensor([2, 0, 3, 1])  # any order of the joint actions gives the same baselines
    assert torch.equal(counterfactual_baseline(q[order], joint[order], 2), expected[order])
    with pytest.raises(ValueError, match=r"needs all G\^N = 4 joint actions"):
        counterfactual_baseline(q[:3], joint[:3], 2)


def test_counterfactual_baseline_with_three_samples_is_the_mean_of_the_other_two():
    joint = torch.tensor([[a, b] for a in range(3) for b in range(3)])
    q = torch.arange(9, dtype=torch.float32).unsqueeze(1).repeat(1, 2)  # Q = 3a + b for both agents
    base = counterfactual_baseline(q, joint, 3)
    # joint (1, 2): agent 0's others are a = 0, 2 -> (2 + 8) / 2 = 5; agent 1's others b = 0, 1 -> (3 + 4) / 2
    k = 1 * 3 + 2
    assert base[k].tolist() == [5.0, 3.5]
    # A = Q - b = G/(G-1) * (Q - mean of Q over the agent's G answers): agent 0 at (1, 2), Q = 5, mean (2+5+8)/3 = 5
    # -> 0; agent 1 at (1, 2), Q = 5, mean (3+4+5)/3 = 4 -> 1.5 * 1
    assert (q[k] - base[k]).tolist() == [0.0, 1.5]


def test_value_head_computes_in_fp32_under_bf16_autocast():
    head = ValueHead(2)
    with torch.no_grad():
        head.linear.bias.fill_(3.3)  # in bf16: 3.296875
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = head(torch.zeros(1, 2, dtype=torch.bfloat16))
    assert value.dtype == torch.float32 and value.item() == pytest.approx(3.3, abs=1e-6)


def test_a_saved_value_head_loads_back_only_with_its_number_of_outputs(tmp_path):
    """A head loads back as saved; a folder without one gives a zero head; a head of another width stops by name
    (it failed inside torch's load_state_dict with a size mismatch)."""
    head = ValueHead(3, outputs=2)
    with torch.no_grad():
        head.linear.weight.copy_(torch.arange(6.0).view(2, 3))
        head.linear.bias.copy_(torch.tensor([0.5, -0.5]))
    head.save(tmp_path / "critic")
    loaded = ValueHead.load_or_new(tmp_path / "critic", 3, 2)
    assert loaded.linear.weight.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert loaded.linear.bias.tolist() == [0.5, -0.5]
    fresh = ValueHead.load_or_new(tmp_path / "no_head_here", 3, 2)
    assert (
        fresh(torch.randn(4, 3)).tolist() == [[0.0, 0.0]] * 4
    )  # starts at 0: early advantages are the returns
    with pytest.raises(
        ValueError, match=r"value_head.pt: the saved value head has 2 outputs but this critic needs 1$"
    ):
        ValueHead.load_or_new(tmp_path / "critic", 3, 1)


def test_hidden_size_of_a_multimodal_config_is_its_text_configs():
    from types import SimpleNamespace

    from transformers import LlavaConfig

    assert getattr(LlavaConfig(), "hidden_size", None) is None  # kept on the text config
    assert hidden_size(SimpleNamespace(config=LlavaConfig())) == 4096
    assert hidden_size(SimpleNamespace(config=SimpleNamespace(hidden_size=24))) == 24


def test_joint_observation_text_by_hand():
    assert joint_observation(["in oslo", "in lima"]) == "agent 0 sees: in oslo\nagent 1 sees: in lima"
    assert joint_observation(["a", "b"], ["x", "y"]) == (
        "agent 0 sees: a\nagent 1 sees: b\nagent 0 answers: x\nagent 1 answers: y"
    )


def test_a_critic_model_values_each_text_as_it_would_alone(qwen_bpe):
    """Left-padded texts in one batch get the values they get alone: position ids follow the mask. A backbone with
    learned absolute positions (GPT-2) shows it; rotary ones (Qwen2, Llama) ignore a constant shift."""
    from transformers import AutoTokenizer, GPT2Config, GPT2Model

    torch.manual_seed(0)
    backbone = GPT2Model(GPT2Config(vocab_size=1024, n_positions=64, n_embd=16, n_layer=1, n_head=2))
    critic = CriticModel(backbone, AutoTokenizer.from_pretrained(qwen_bpe), ValueHead(16, outputs=2))
    torch.nn.init.normal_(critic.head.linear.weight)
    texts = ["alice and", "alice and bob meet at the station at noon"]
    with torch.no_grad():
        ids, mask = critic.encode(texts)
        assert (mask[0] == 0).any()  # the short text is padded on the left
        batched = critic(ids, mask)
        alone = torch.cat([critic(*critic.encode([t])) for t in texts])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-4)
    assert batched.shape == (2, 2) and batched.dtype == torch.float32


def test_a_critic_model_is_fp32_and_without_dropout_whatever_its_checkpoint_says(qwen_bpe, tmp_path):
    """A checkpoint saved in bf16 with attention dropout: the critic loads in fp32 and scores a text the same in
    train mode every time (the values it learns from must be the ones it is scored on)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen_bpe, dtype=torch.bfloat16, attention_dropout=0.5)
    model.save_pretrained(tmp_path / "bf16")
    AutoTokenizer.from_pretrained(qwen_bpe).save_pretrained(tmp_path / "bf16")
    critic = CriticModel.from_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in critic.parameters()} == {torch.float32}
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.head.linear.weight)
    critic.train()
    inputs = critic.encode(["alice and bob meet at the station at noon"])
    with torch.no_grad():
        assert torch.equal(critic(*inputs), critic(*inputs))


def test_value_loss_clipping_by_hand():
    values, old, targets = (
        torch.tensor([1.5, 0.5, 2.5]),
        torch.tensor([1.0, 1.0, 2.0]),
        torch.tensor([2.0, 0.0, 0.0]),
    )
    # unclipped (V - y)^2 = [.25, .25, 6.25]; clipped V = [1.2, .8, 2.2] -> [.64, .64, 4.84]; half the max
    assert torch.allclose(value_loss(values, old, targets, 0.2), torch.tensor([0.32, 0.32, 3.125]))
    assert torch.allclose(value_loss(values, old, targets, None), torch.tensor([0.125, 0.125, 3.125]))


def test_entropy_whitening_and_explained_variance():
    assert torch.allclose(token_entropy(torch.zeros(1, 1, 4)), torch.tensor(math.log(4)))
    assert torch.allclose(token_entropy(torch.tensor([[[0.0, math.log(3.0)]]])), torch.tensor(0.5623351446))
    white = whiten(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert abs(float(white.mean())) < 1e-6 and abs(float(white.std()) - 1) < 1e-6
    # Equal advantages (every sample scored as its state's value predicts) teach nothing: exactly 0, not the
    # +-0.7 that (x - mean) / (std + 1e-8) gives when the float32 mean of six 0.3s rounds.
    assert torch.equal(whiten(torch.full((6,), 0.3)), torch.zeros(6))
    assert torch.equal(whiten(torch.full((7,), 1.3)), torch.zeros(7))
    y = torch.tensor([1.0, 2.0, 3.0])
    assert explained_variance(y, y) == 1.0
    assert explained_variance(torch.full((3,), 2.0), y) == 0.0
    assert math.isnan(explained_variance(y, torch.ones(3)))


# ----------------------------------------------------------------------------- configs


def test_config_defaults_and_errors():
    assert (IACConfig().centralized_critic, MAACConfig().centralized_critic) == (False, True)
    ppo = MAPPOConfig()
    assert (ppo.num_iterations, ppo.num_mini_batches, ppo.value_clip, ppo.centralized_critic) == (
        4,
        2,
        0.2,
        True,
    )
    with pytest.raises(ConfigError, match="baseline='group_mean': actor-critic trainers use the critic"):
        IACConfig(baseline="group_mean")
    with pytest.raises(ConfigError, match="critic_type='q' needs centralized_critic=True"):
        IACConfig(critic_type="q")
    with pytest.raises(
        ConfigError, match="critic_type='q' needs joint_mode='cross' without max_joint_actions"
    ):
        MAACConfig(critic_type="q")
    with pytest.raises(ConfigError, match=r"num_mini_batches=3: must divide .* 4 x 4 = 16"):
        IPPOConfig(num_mini_batches=3)
    with pytest.raises(
        ConfigError, match=r"micro_batch_size=8: must divide the completions of one mini-batch"
    ):
        IPPOConfig(prompts_per_step=2, num_generations=4, num_mini_batches=2, micro_batch_size=8)
    with pytest.raises(ConfigError, match=r"gae_lambda=1.5: must be in \[0, 1\]"):
        IPPOConfig(gae_lambda=1.5)
    # tree_lambda_returns averages a node's joint actions: 'max' was accepted and ignored
    with pytest.raises(
        ConfigError, match=r"tree_backup='max': the critic trainers' TD\(lambda\) targets average"
    ):
        IPPOConfig(tree_backup="max", num_turns=2)
    # CoMLRL's IAC / MAAC spellings: two map onto comarl's fields, the others are refused with the fix
    comlrl = IACConfig(value_clip_range=0.3, value_loss_coef=0.6, advantage_normalization=False)
    assert (comlrl.value_clip, comlrl.value_coef, comlrl.whiten_advantages) == (0.3, 0.6, False)
    # use_separate_critic=True needs a critic model, which the trainer may still pass: checked with the team
    with pytest.raises(ConfigError, match=r"^use_separate_critic=True but no critic model was given"):
        IACConfig(use_separate_critic=True).check_team(2, 8)
    with pytest.raises(
        ConfigError, match=r"^critic_devices=\['cuda:0'\]: a CoMLRL field comarl does not take"
    ):
        MAACConfig(critic_devices=["cuda:0"])


# ----------------------------------------------------------------------------- trainers on tiny models


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    return [str(p) for p in demo.build_team(tmp_path_factory.mktemp("ac") / "models")]


def test_comlrl_critic_arguments_of_the_trainer(team):
    """CoMLRL's IACTrainer(critic_model=...) / critics=[...] set the config's critic_model; what comarl cannot do is
    refused by name before any model loads."""

    def build(**kw):
        return IACTrainer(
            agents=team,
            train_dataset=demo.dataset(),
            reward_func=demo.meeting_reward,
            formatters=[demo.formatter(0), demo.formatter(1)],
            args=IACConfig(max_steps=1, num_generations=2, max_new_tokens=2, progress_bar=False),
            **kw,
        )

    trainer = build(critic_model=team[0])
    assert trainer.args.critic_model == team[0] and trainer.value_heads is None and len(trainer.critics) == 2
    assert build(critics=[team[1], team[1]]).args.critic_model == team[1]
    with pytest.raises(
        ConfigError, match=r"^IACTrainer\(critics=\): comarl gives every agent a copy of one critic"
    ):
        build(critics=team)
    with pytest.raises(
        ConfigError, match=r"^IACTrainer\(critic_model=.*, critics=\[.*\]\): they name different"
    ):
        build(critic_model=team[0], critics=[team[1], team[1]])
    # the config given by position, as MAGRPOTrainer's 8th parameter
    positional = IACTrainer(
        None,
        None,
        None,
        demo.dataset(),
        None,
        demo.meeting_reward,
        [demo.formatter(0), demo.formatter(1)],
        IACConfig(max_steps=1, num_generations=2, max_new_tokens=2, progress_bar=False),
        agents=team,
        critic_model=team[1],
    )
    assert positional.args.critic_model == team[1] and positional.args.max_new_tokens == 2
    with pytest.raises(
        ConfigError, match=r"^IACTrainer\(metrics_callback=\): comarl has no per-rollout callback"
    ):
        build(metrics_callback=lambda rollouts: {})


def answer_length(alice, bob, **_):
    """A reward that varies with every sample (the game's is 0 for most answers of an untrained team)."""
    return [(len(a) + 2 * len(b)) / 10 for a, b in zip(alice, bob)]


def _trainer(cls, config_cls, paths, reward=demo.meeting_reward, **overrides):
    settings = dict(
        max_steps=1,
        prompts_per_step=2,
        num_generations=4,
        joint_mode="cross",
        max_new_tokens=3,
        learning_rate=1e-3,
        critic_learning_rate=1e-3,
        reward_call="batched",
        success_threshold=1.0,
        progress_bar=False,
        seed=0,
    )
    settings.update(overrides)
    return cls(
        agents=paths,
        train_dataset=demo.dataset(),
        eval_dataset=demo.dataset(),
        reward_func=reward,
        formatters=[demo.formatter(0), demo.formatter(1)],
        args=config_cls(**settings),
    )


def _count_steps(optimizer):
    calls = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(1))
    return calls


@pytest.mark.parametrize(
    ("cls", "config_cls", "per_update"), [(MAACTrainer, MAACConfig, 1), (MAPPOTrainer, MAPPOConfig, 8)]
)
def test_centralized_critic_steps_once_per_update_not_once_per_agent(team, cls, config_cls, per_update):
    trainer = _trainer(cls, config_cls, team, weight_decay=0.1, adam_epsilon=1e-6)
    assert len(trainer.critics) == 1 and trainer.value_heads is None
    # the critic's AdamW takes the config's settings (not torch's weight_decay=0.01, eps=1e-8)
    group = trainer.critic_optimizers[0].param_groups[0]
    assert (group["weight_decay"], group["eps"]) == (0.1, 1e-6)
    critic_steps = _count_steps(trainer.critic_optimizers[0])
    agent_steps = [_count_steps(opt) for opt in trainer.optimizers]
    trainer.train()
    # num_iterations x num_mini_batches: MAAC 1 x 1, MAPPO 4 x 2 — for the team, whatever its size
    assert len(critic_steps) == per_update
    assert [len(s) for s in agent_steps] == [per_update, per_update]


def test_a_critic_with_fewer_samples_than_mini_batches_steps_only_on_samples(team):
    """prompts_per_step=1: MAPPO's V critic has one sample (one node) for num_mini_batches=2. The empty
    mini-batch takes no step, and value_loss is the loss of the one sample, not half of it."""
    trainer = _trainer(
        MAPPOTrainer, MAPPOConfig, team, reward=answer_length, prompts_per_step=1, num_iterations=1
    )
    critic_steps = _count_steps(trainer.critic_optimizers[0])
    seen = {}
    update_critic = trainer.update_critic

    def spy(c, samples, targets, old_values):  # noqa: ANN001, ANN202
        with torch.no_grad():
            values = trainer.critics[c](*samples)
        seen["loss"] = float(value_loss(values, old_values, targets, trainer.args.value_clip).mean())
        return update_critic(c, samples, targets, old_values)

    trainer.update_critic = spy
    metrics = trainer.train()
    assert len(critic_steps) == 1
    assert metrics["critic/value_loss"] == pytest.approx(seen["loss"], rel=1e-5)


@pytest.mark.parametrize(
    ("cls", "config_cls", "overrides"),
    [
        (IPPOTrainer, IPPOConfig, {"entropy_coef": 0.01}),
        # Q starts at 0, so the first step's advantages are all 0: the actors move from the second step on
        (MAACTrainer, MAACConfig, {"critic_type": "q", "max_steps": 2}),
    ],
)
def test_every_actor_and_critic_parameter_changes(team, cls, config_cls, overrides):
    trainer = _trainer(cls, config_cls, team, reward=answer_length, **overrides)
    modules = [a.model for a in trainer.team] + list(trainer.value_heads or []) + list(trainer.critics)
    before = [[p.detach().clone() for p in m.parameters()] for m in modules]
    metrics = trainer.train()
    for m, saved in zip(modules, before):
        for (name, p), old in zip(m.named_parameters(), saved):
            assert not torch.equal(p, old), f"{type(m).__name__}.{name} did not change"
    expected = ("value_loss", "explained_variance", "clip_fraction", "approx_kl", "entropy")
    prefix = "agent_0/" if cls is IPPOTrainer else "critic/"
    assert all(f"{prefix}{k}" in metrics or f"agent_0/{k}" in metrics for k in expected)
    assert all(math.isfinite(metrics[f"agent_{i}/entropy"]) for i in range(2))


def test_each_actor_is_scored_at_its_own_temperature_in_its_own_micro_batches(team, monkeypatch):
    import comarl.trainers.actor_critic as actor_critic

    calls = []
    forward = actor_critic.policy_forward

    def recording(model, head, prompt_ids, *rest, **kw):
        calls.append(
            (model, len(prompt_ids), rest[3])
        )  # rest: prompt mask, completion ids and mask, temperature
        return forward(model, head, prompt_ids, *rest, **kw)

    monkeypatch.setattr(actor_critic, "policy_forward", recording)
    settings = [{"temperature": 0.5, "micro_batch_size": 2}, {}]
    trainer = _trainer(IPPOTrainer, IPPOConfig, team, reward=answer_length, agent_settings=settings)
    trainer.train()
    models = [a.model for a in trainer.team]
    seen = {i: {(rows, t) for model, rows, t in calls if model is models[i]} for i in range(2)}
    # 2 prompts x 4 samples per agent in IPPO's 2 mini-batches of 4: agent 0 in micro-batches of 2 at temperature
    # 0.5, agent 1 a mini-batch per forward at 1.0
    assert seen == {0: {(2, 0.5)}, 1: {(4, 1.0)}}
    # the values of the rollout's nodes too: agent 0's value head reads them in its micro-batches (it took the
    # shared micro-batch settings: all 2 nodes at once)
    rows = {0: [], 1: []}
    for i, head in enumerate(trainer.value_heads):
        head.register_forward_hook(lambda module, inputs, out, i=i: rows[i].append(len(inputs[0])))
    trainer._critic_values(trainer._collect(demo.dataset()[:4]))
    assert rows == {0: [2, 2], 1: [4]}


def test_entropy_bonus_alone_raises_the_policy_entropy(team):
    """A constant reward and a zero critic give equal advantages, which whiten to zero: only the entropy term
    moves the policy (a separate critic, so that no value loss reaches the actor's weights)."""

    def mean_entropy(trainer, gen):
        with torch.no_grad():
            _, entropy, _ = policy_forward(
                trainer.team[0].model,
                None,
                gen.prompt_ids,
                gen.prompt_mask,
                gen.completion_ids,
                gen.completion_mask,
                with_entropy=True,
            )
        return float((entropy * gen.completion_mask).sum() / gen.completion_mask.sum())

    results = {}
    for coef in (0.0, 1.0):
        trainer = IPPOTrainer(
            agents=team,
            train_dataset=demo.dataset(),
            reward_func=lambda a, b: [0.5] * len(a),
            formatters=[demo.formatter(0), demo.formatter(1)],
            args=IPPOConfig(
                max_steps=1,
                critic_model=team[0],
                prompts_per_step=2,
                num_generations=4,
                max_new_tokens=3,
                learning_rate=1e-2,
                entropy_coef=coef,
                reward_call="batched",
                progress_bar=False,
                seed=0,
            ),
        )
        gen = trainer.engine.generate(
            trainer.team[0], [demo.formatter(0)(demo.dataset()[0])], 8, trainer._sampling()[0]
        )
        before = mean_entropy(trainer, gen)
        trainer.train()
        results[coef] = mean_entropy(trainer, gen) - before
    assert results[0.0] == pytest.approx(0.0, abs=1e-5)  # zero advantages, no bonus: the policy does not move
    assert results[1.0] > 0.01


def test_mask_truncated_completions_leaves_cut_answers_out_of_the_actor_loss(team):
    """IAC with separate critics (the actor loss is the policy loss alone): a cut completion (no EOS) adds nothing to the policy gradient when masked."""
    import dataclasses

    from comarl import Agent
    from comarl.engines import HFEngine, SamplingParams

    def actor_gradients(gen, advantages, **kw):
        trainer = _trainer(IACTrainer, IACConfig, team, reward=answer_length, critic_model=team[0], **kw)
        grads, step = [], trainer._step

        def capture(optimizer, params, head):
            params = list(params)
            grads.extend(p.grad.clone() for p in params if p.grad is not None)
            return step(optimizer, params, head)

        trainer._step = capture
        zeros = torch.zeros(len(advantages))
        metrics = trainer.update_actor(0, gen, advantages, zeros, zeros)
        return grads, metrics

    agent = Agent.from_pretrained(team[0])
    eos, pad = agent.eos_token_ids[0], agent.tokenizer.pad_token_id
    gen = HFEngine().generate(agent, ["alice and bob"], 2, SamplingParams(max_new_tokens=3))
    ids = torch.tensor([[5, eos, pad], [5, 6, 7]])  # ended; cut at max_new_tokens
    both = dataclasses.replace(gen, completion_ids=ids, completion_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    ended = dataclasses.replace(
        both,
        prompt_ids=both.prompt_ids[:1],
        prompt_mask=both.prompt_mask[:1],
        completion_ids=ids[:1],
        completion_mask=both.completion_mask[:1],
    )
    masked, metrics = actor_gradients(both, torch.tensor([1.0, -1.0]), mask_truncated_completions=True)
    alone, _ = actor_gradients(ended, torch.tensor([1.0]))
    scored, _ = actor_gradients(both, torch.tensor([1.0, -1.0]))
    assert len(masked) == len(alone) > 0
    for a, b in zip(masked, alone):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert not all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(scored, alone)
    )  # off: the cut row is scored
    assert metrics["truncated_fraction"] == 0.5 and metrics["completion_length"] == 2.5


def test_actor_update_is_the_gradient_of_the_hand_written_policy_loss(team):
    """IAC with separate critics, dapo, one epoch (ratio 1): L = -(1/5) sum_i A_i sum_t m_it logp_it over
    [x, EOS] and [x, y, z]: EOS scored, padding not, advantages with their sign."""
    import dataclasses

    from comarl.engines import HFEngine, SamplingParams

    trainer = _trainer(
        IACTrainer, IACConfig, team, reward=answer_length, critic_model=team[0], max_grad_norm=None
    )
    agent = trainer.team[0]
    eos, pad = agent.eos_token_ids[0], agent.tokenizer.pad_token_id
    gen = HFEngine().generate(agent, ["alice and bob"], 2, SamplingParams(max_new_tokens=3))
    ids, mask = torch.tensor([[5, eos, pad], [5, 6, 7]]), torch.tensor([[1, 1, 0], [1, 1, 1]])
    gen = dataclasses.replace(gen, completion_ids=ids, completion_mask=mask)
    adv = torch.tensor([2.0, 1.0])
    params = [p for p in agent.model.parameters() if p.requires_grad]
    logp = agent.completion_logprobs(gen.prompt_ids, gen.prompt_mask, ids, mask)
    expected = torch.autograd.grad(-(adv[:, None] * logp * mask).sum() / 5, params)
    got, step = [], trainer._step

    def capture(optimizer, parameters, head):
        got.extend(p.grad.clone() for p in params)
        return step(optimizer, parameters, head)

    trainer._step = capture
    zeros = torch.zeros(2)
    metrics = trainer.update_actor(0, gen, adv, zeros, zeros)
    assert metrics["loss"] == pytest.approx(-7 / 5, abs=1e-6)  # -(2 * 2 + 1 * 3) / 5
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-4)


def test_discount_reaches_the_actor_critic_targets(team):
    """Two turns paid 1 then 4, discount 0.5, lambda 1: every first-turn target is 1 + 0.5 * 4 = 3 (ignored: 5)."""
    trainer = IACTrainer(
        agents=team,
        train_dataset=demo.dataset(),
        reward_func=lambda a, b, prompts: [4.0 if p.startswith("again") else 1.0 for p in prompts[0]],
        formatters=[demo.formatter(0), demo.formatter(1)],
        transition=lambda item, completions, history: ["again", "again"],
        args=IACConfig(
            max_steps=1,
            prompts_per_step=1,
            num_generations=2,
            max_new_tokens=2,
            num_turns=2,
            discount=0.5,
            reward_call="batched",
            progress_bar=False,
            seed=0,
        ),
    )
    targets = []
    update = trainer.update_actor

    def capture(i, gen, advantages, value_targets, old_values):
        targets.append(value_targets.clone())
        return update(i, gen, advantages, value_targets, old_values)

    trainer.update_actor = capture
    trainer.train()
    assert len(targets) == 2
    for t in targets:  # the root's G = 2 completions first, then the second turn's, paid 4 and done
        torch.testing.assert_close(t[:2], torch.tensor([3.0, 3.0]))
        torch.testing.assert_close(t[2:], torch.full_like(t[2:], 4.0))


def test_value_head_reads_the_last_prompt_token_in_the_policy_forward(team):
    trainer = _trainer(IACTrainer, IACConfig, team)
    agent, head = trainer.team[0], trainer.value_heads[0]
    torch.nn.init.normal_(head.linear.weight)
    gen = trainer.engine.generate(
        agent, ["alice is in oslo .", "bob is in lima . where"], 2, trainer._sampling()[0]
    )
    with torch.no_grad():
        _, _, values = policy_forward(
            agent.model, head, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask
        )
        alone = head(last_token_hidden(agent.model, gen.prompt_ids, gen.prompt_mask))
        logp = agent.completion_logprobs(
            gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask
        )
        ours, _, _ = policy_forward(
            agent.model, None, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask
        )
    assert torch.allclose(values, alone, atol=1e-5)  # the value of the state: prompt only
    # the same log-probs as the policy's own forward (completion_logprobs holds 0 after a row's end)
    scored = gen.completion_mask.bool()
    assert torch.allclose(ours[scored], logp[scored], atol=1e-5)


def test_policy_forward_stops_at_each_rows_end(team, monkeypatch):
    """Rows that end at different lengths: the forward runs the columns up to the longest row's end alone; log-probs
    equal completion_logprobs' (each row's own up to its end), and log-probs and entropies are 0 after a row's end."""
    import comarl.critics

    trainer = _trainer(IACTrainer, IACConfig, team)
    agent = trainer.team[0]
    gen = trainer.engine.generate(
        agent, ["alice is in oslo .", "bob is in lima . where"], 2, trainer._sampling()[0]
    )
    width = gen.completion_ids.shape[1]
    ends = torch.tensor([width - 1, 1, 2, width - 1])
    mask = (torch.arange(width) < ends[:, None]).long()
    widths, forward = [], comarl.critics._forward_with_hidden
    monkeypatch.setattr(
        comarl.critics, "_forward_with_hidden", lambda m, k, **kw: widths.append(k) or forward(m, k, **kw)
    )
    with torch.no_grad():
        logp, entropy, _ = policy_forward(
            agent.model, None, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, mask, with_entropy=True
        )
        expected = agent.completion_logprobs(gen.prompt_ids, gen.prompt_mask, gen.completion_ids, mask)
    assert widths == [width]  # the longest row's width - 1 completion positions, + 1
    assert logp.shape == entropy.shape == (4, width)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-4)
    assert not logp[mask == 0].any() and not entropy[mask == 0].any() and (entropy[mask == 1] > 0).all()


def test_critics_and_value_heads_save_and_load(team, tmp_path):
    iac = _trainer(IACTrainer, IACConfig, team, reward=answer_length)
    iac.train()
    iac.save_model(tmp_path / "iac")
    assert (tmp_path / "iac" / "agent_1" / VALUE_HEAD_FILE).is_file()
    again = _trainer(IACTrainer, IACConfig, [str(tmp_path / "iac" / f"agent_{i}") for i in range(2)])
    for old, new in zip(iac.value_heads, again.value_heads):
        assert torch.equal(old.linear.weight, new.linear.weight) and bool(new.linear.weight.abs().sum() > 0)

    maac = _trainer(MAACTrainer, MAACConfig, team)
    maac.train()
    maac.save_model(tmp_path / "maac")
    resumed = _trainer(MAACTrainer, MAACConfig, team, critic_model=str(tmp_path / "maac" / "critic"))
    texts = ["agent 0 sees: a\nagent 1 sees: b"]
    with torch.no_grad():
        assert torch.equal(
            maac.critics[0](*maac.critics[0].encode(texts)),
            resumed.critics[0](*resumed.critics[0].encode(texts)),
        )


def test_critic_arguments_refused_by_name_and_args_by_keyword_after_seven_positional(team):
    """critics= of model objects, a critic_model= that is no hub id or path, and a critic_model= other than the
    config's are refused with the fix; seven arguments by position leave args= to its keyword."""
    common = dict(
        agents=team,
        train_dataset=demo.dataset(),
        reward_func=demo.meeting_reward,
        formatters=[demo.formatter(0), demo.formatter(1)],
    )
    config = IACConfig(max_steps=1, num_generations=2, max_new_tokens=2, progress_bar=False)
    with pytest.raises(
        ConfigError,
        match=r"^IACTrainer\(critics=\): comarl gives every agent a copy of one critic model; pass "
        r"critic_model='<hub id or path>' instead$",
    ):
        IACTrainer(**common, args=config, critics=[object(), object()])
    with pytest.raises(
        ConfigError, match=r"^IACTrainer\(critic_model=\): give a hub id or path, not a dict$"
    ):
        IACTrainer(**common, args=config, critic_model={"path": team[0]})
    with pytest.raises(
        ConfigError,
        match=rf"^IACTrainer\(critic_model='{re.escape(team[0])}'\) but args.critic_model='{re.escape(team[1])}'; "
        "give it once$",
    ):
        IACTrainer(**common, args=dataclasses.replace(config, critic_model=team[1]), critic_model=team[0])
    # MAGRPOTrainer's first seven parameters by position, args= by keyword
    trainer = IACTrainer(
        None,
        None,
        None,
        demo.dataset(),
        None,
        demo.meeting_reward,
        [demo.formatter(0), demo.formatter(1)],
        args=config,
        agents=team,
        critic_model=team[1],
    )
    assert (
        trainer.args.critic_model == team[1]
        and trainer.args.max_new_tokens == 2
        and len(trainer.critics) == 2
    )


def test_a_centralized_critic_needs_critic_model_when_agent_0_is_an_object(team):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comarl import Agent

    agents = [Agent(AutoModelForCausalLM.from_pretrained(p), AutoTokenizer.from_pretrained(p)) for p in team]
    assert agents[0].source is None
    with pytest.raises(
        ConfigError,
        match=r"^centralized_critic: set critic_model= \(agent 0 was given as an object, not a path\)$",
    ):
        _trainer(MAACTrainer, MAACConfig, agents)


def test_a_centralized_critic_loads_from_critic_model(team, tmp_path):
    """critic_model= names the centralized critic's folder (a saved critic/): its head comes back, not agent 0's
    model with a new zero head."""
    from comarl.critics import CriticModel

    saved = CriticModel.from_pretrained(team[1], outputs=2)
    with torch.no_grad():
        saved.head.linear.bias.copy_(torch.tensor([1.0, 2.0]))
    saved.save(tmp_path / "critic")
    trainer = _trainer(MAACTrainer, MAACConfig, team, critic_model=str(tmp_path / "critic"))
    assert trainer.critics[0].head.linear.bias.tolist() == [1.0, 2.0]


def test_separate_critics_are_logged_saved_and_planned_one_per_agent(team, tmp_path):
    """IAC with critic models: critic_c/ metrics and folders for each, AdamW with the config's betas, one memory
    entry per critic; no actor value_loss (no value head) or kl (no KL term); the step's times add up."""
    trainer = _trainer(
        IACTrainer,
        IACConfig,
        team,
        reward=answer_length,
        critic_model=team[0],
        adam_beta1=0.8,
        adam_beta2=0.95,
    )
    assert [opt.param_groups[0]["betas"] for opt in trainer.critic_optimizers] == [(0.8, 0.95)] * 2
    plan = trainer._memory_plan(team, ["cpu", "cpu"])
    assert [m.name for m in plan] == ["agent 0", "agent 1", "critic 0", "critic 1"]
    metrics = trainer.train()
    assert {k for k in metrics if k.startswith("critic")} == {
        f"critic_{c}/{k}"
        for c in range(2)
        for k in ("value_loss", "grad_norm", "explained_variance", "value_mean")
    }
    assert "agent_0/loss" in metrics
    assert not [k for k in metrics if k.startswith("agent_") and k.endswith(("/value_loss", "/kl"))]
    assert metrics["time/step"] == pytest.approx(
        metrics["time/generate"] + metrics["time/environment"] + metrics["time/update"]
    )
    # 2 agents x 2 prompts x 4 samples
    assert metrics["completions_per_s"] * metrics["time/step"] == pytest.approx(16.0)
    trainer.save_model(tmp_path)
    assert not (tmp_path / "critic").exists()
    for c, critic in enumerate(trainer.critics):
        saved = ValueHead.load_or_new(tmp_path / f"critic_{c}", critic.head.linear.in_features, 1)
        assert bool(saved.linear.weight.abs().sum() > 0) and torch.equal(
            saved.linear.weight, critic.head.linear.weight
        )


def test_actor_metrics_are_the_agents_rate_and_the_advantages_and_values_given(team):
    """A value head learns at critic_learning_rate (0.5 here) in the agent's optimizer; lr is the agent's own, as
    its linear decay over 2 steps x 2 mini-batches has it at the update's last mini-batch: 1e-3 * (1 - 1/4), and
    the schedule moves on after each. advantage_abs = mean |[2, -1]| = 1.5, value_mean = mean [0.5, 1.5] = 1.0."""
    trainer = _trainer(
        IACTrainer,
        IACConfig,
        team,
        critic_learning_rate=0.5,
        max_steps=2,
        num_mini_batches=2,
        lr_scheduler_type="linear",
    )
    gen = trainer.engine.generate(trainer.team[0], ["alice and bob"], 2, trainer._sampling()[0])
    metrics = trainer.update_actor(
        0, gen, torch.tensor([2.0, -1.0]), torch.zeros(2), torch.tensor([0.5, 1.5])
    )
    assert metrics["lr"] == pytest.approx(0.75e-3)
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == pytest.approx([0.5e-3, 0.25])
    assert metrics["advantage_abs"] == 1.5 and metrics["value_mean"] == 1.0
    assert "value_loss" in metrics and "kl" not in metrics


def test_critic_metrics_by_hand(team):
    """A fresh centralized critic values everything 0 (a zero head). Targets [[1, 2], [3, 4]], no clipping: value_loss
    = (0.5 * (1 + 4) / 2 + 0.5 * (9 + 16) / 2) / 2 = 3.75; value_mean is the mean of the values it started from."""
    trainer = _trainer(MAACTrainer, MAACConfig, team)
    assert trainer.args.value_clip is None
    critic = trainer.critics[0]
    samples = critic.encode(["agent 0 sees: a\nagent 1 sees: b", "agent 0 sees: c\nagent 1 sees: d"])
    stats = trainer.update_critic(
        0, samples, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[0.5, 0.5], [1.5, 1.5]])
    )
    assert stats["value_loss"] == pytest.approx(3.75, abs=1e-6)
    assert stats["value_mean"] == 1.0


def test_the_centralized_critic_learns_every_agents_return(team):
    """MAAC's critic has one output per agent: its targets are every agent's return (one turn: the reward), each
    node's mean over its joint actions."""
    trainer = _trainer(MAACTrainer, MAACConfig, team, reward=answer_length)
    seen = {}
    collect, update_critic = trainer._collect, trainer.update_critic

    def collecting(items, seeds=None):
        seen["rollout"] = collect(items, seeds)
        return seen["rollout"]

    def spy(c, samples, targets, old_values):
        seen["targets"] = targets
        return update_critic(c, samples, targets, old_values)

    trainer._collect, trainer.update_critic = collecting, spy
    trainer.train()
    rewards = seen["rollout"].rewards  # [nodes, K, N]
    assert seen["targets"].shape == (2, 2)
    torch.testing.assert_close(seen["targets"], rewards.mean(dim=1))


def test_each_independent_critic_reads_its_own_agents_observation(team):
    from comarl.envs import prompt_text

    trainer = _trainer(IACTrainer, IACConfig, team, critic_model=team[0])
    rollout = trainer._collect(demo.dataset()[:2])
    texts = {}
    for c, critic in enumerate(trainer.critics):

        def encode(batch, c=c, encode=critic.encode):
            texts[c] = list(batch)
            return encode(batch)

        critic.encode = encode
    trainer._critic_values(rollout)
    expected = {c: [prompt_text(state[1][c]) for state in rollout.states] for c in range(2)}
    assert texts == expected and expected[0] != expected[1]


# ----------------------------------------------------------------------------- learning (seeded)


@pytest.mark.slow
def test_maac_team_learns_the_demo_game(team):
    """Greedy evaluation on all 36 items. lr 5e-4: seed 2 reaches 1.0 at step 125, seeds 0 and 3 by 150, and all
    three hold it to 250; seed 1 stays at 5/6 from 125 to 200 (one item's miscoordinated convention, frozen while
    the policies turn deterministic) and reaches 1.0 at 225."""
    trainer = _trainer(
        MAACTrainer,
        MAACConfig,
        team,
        max_steps=150,
        prompts_per_step=6,
        num_generations=12,
        learning_rate=5e-4,
        seed=2,
    )
    trainer.train()
    assert trainer.evaluate()["eval/success"] >= 0.9


@pytest.mark.slow
def test_mappo_team_learns_the_demo_game(team):
    """Greedy evaluation on all 36 items: 0 of them before training, at least 27 after. lr 5e-4: at 1e-3 with two
    PPO epochs per batch the policies turn deterministic within ~100 steps while some items are still
    miscoordinated, and greedy success stalls at 2/3. Measured 2026-12-07 with seeds 0-3: 30, 36, 36 and 36 items
    (seed 0 settles on one miscoordinated pair of items and stays at 30 through 250 steps); the threshold of 27
    leaves that seed a margin against rounding-level changes of the trajectory (commit 636bac7, which passed the old
    threshold of 0.9 in CI, gives 30 in a freshly set-up environment of the same day)."""
    trainer = _trainer(
        MAPPOTrainer,
        MAPPOConfig,
        team,
        max_steps=150,
        prompts_per_step=6,
        num_generations=12,
        learning_rate=5e-4,
        num_iterations=2,
        num_mini_batches=1,
    )
    assert trainer.evaluate()["eval/success"] == 0.0
    trainer.train()
    assert trainer.evaluate()["eval/success"] >= 27 / 36


@pytest.mark.slow
def test_critic_bootstraps_over_two_turns_on_the_relay_game(tmp_path):
    """gae_lambda=0: a first-turn answer is judged only by r + gamma * V(second-turn state) — the critic must learn
    the second turn's value for the first turn to improve."""
    paths = [str(p) for p in relay.build_team(tmp_path / "models")]
    args = MAACConfig(
        max_steps=300,  # the game pays only when the episode ends: seed 0 holds >= 5/6 from step 175 here
        prompts_per_step=6,
        num_generations=8,
        joint_mode="cross",
        max_joint_actions=16,
        max_children=4,
        num_turns=2,
        gae_lambda=0.0,
        max_new_tokens=3,
        learning_rate=1e-3,
        critic_learning_rate=1e-3,
        reward_call="batched",
        success_threshold=1.0,
        seed=0,
        progress_bar=False,
    )
    trainer = MAACTrainer(
        agents=paths,
        train_dataset=relay.dataset(),
        eval_dataset=relay.dataset(),
        reward_func=relay.relay_reward,
        formatters=[relay.formatter(0), relay.formatter(1)],
        transition=relay.relay_transition,
        args=args,
    )
    assert trainer.evaluate()["eval/success"] == 0.0  # the untrained team solves none of the 6 items
    trainer.train()
    # Success moves in sixths: 6/6 on the machine this was written on, 5/6 on another CPU (its rounding gives
    # another trajectory; seeds 1 and 2 alike), so the bar is 5 of 6.
    assert trainer.evaluate()["eval/success"] >= 0.8


def test_cli_trains_mappo_from_yaml_and_saves_the_critic(tmp_path, capsys):
    import json

    from comarl.cli import main

    spec = tmp_path / "run.yaml"
    spec.write_text(
        "trainer: mappo\ntask: demo\nargs:\n  max_steps: 1\n  max_new_tokens: 3\n  progress_bar: false\n  prompts_per_step: 2\n"
        "  num_generations: 2\n  reward_call: batched\n  success_threshold: 1.0\n  num_iterations: 2\n"
    )
    out = tmp_path / "out"
    assert main(["train", str(spec), "--set", f"output_dir={out}"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "critic/value_loss" in printed and "agent_1/approx_kl" in printed
    assert (out / "agents" / "critic" / VALUE_HEAD_FILE).is_file()
