"""CoMLRL 1.4.3 config fields comarl lacks: accepted at the values that change nothing here, refused with the fix
otherwise (the refusals of every field: tests/test_config.py::test_every_refused_comlrl_field_is_a_config_error...)."""

from dataclasses import replace

import pytest

from comarl import Agent, IACTrainer, MAACTrainer
from comarl.config import (
    ConfigError,
    IACConfig,
    IPPOConfig,
    MAACConfig,
    MADPOConfig,
    MAGRPOConfig,
    MARLHFConfig,
    config_class,
)

# CoMLRL 1.4.3's config defaults, field by field (comlrl/trainers/*/...Config): a launcher that passes a whole
# CoMLRL YAML gives these.
COMLRL_MAGRPO = {
    "num_train_epochs": 20,
    "agent_learning_rate": 5e-06,
    "logging_steps": 50,
    "num_agents": 2,
    "parallel_training": "none",
    "agent_devices": None,
    "num_generations": 4,
    "max_new_tokens": 256,
    "temperature": 0.6,
    "top_p": 0.6,
    "top_k": 50,
    "num_turns": 2,
    "discount": 1.0,
    "joint_mode": "aligned",
    "early_termination_threshold": -0.2,
    "external_prompt_passthrough": False,
    "eval_interval": 16,
    "eval_num_samples": 4,
    "eval_batch_size": 1,
    "rollout_buffer_size": 2,
    "train_batch_size": None,
    "advantage_normalization": True,
    "advantage_mode": "mean",
    "reference_kl_enabled": False,
    "reference_kl_coef": 0.1,
    "reference_devices": None,
}
COMLRL_IAC = {
    "agent_learning_rate": 5e-06,
    "critic_learning_rate": 5e-06,
    "rollout_buffer_size": 8,
    "train_batch_size": None,
    "value_clip_range": 0.2,
    "value_loss_coef": 0.6,
    "advantage_normalization": True,
    "max_new_tokens": 256,
    "temperature": 0.6,
    "top_p": 0.6,
    "top_k": None,
    "num_train_epochs": 40,
    "use_separate_critic": True,
    "critic_type": "v",
    "critic_value_head_hidden_dim": None,
    "value_head_hidden_dim": None,
    "num_agents": 2,
    "num_turns": 2,
    "parallel_training": "none",
    "agent_devices": None,
    "critic_devices": None,
    "external_prompt_passthrough": False,
    "discount": 1.0,
    "num_generations": 1,
    "eval_interval": 16,
    "eval_num_samples": 4,
    "eval_batch_size": 1,
    "early_termination_threshold": -0.2,
    "logging_steps": 1,
    "reference_kl_enabled": False,
    "reference_kl_coef": 0.1,
    "reference_devices": None,
}
COMLRL_MAAC = {
    k: v
    for k, v in COMLRL_IAC.items()
    if k
    not in (
        "value_clip_range",
        "use_separate_critic",
        "critic_value_head_hidden_dim",
        "value_head_hidden_dim",
    )
}
COMLRL_MADPO = {
    **{k: v for k, v in COMLRL_MAGRPO.items() if k != "num_generations"},
    "num_turns": 1,
    "early_termination_threshold": None,
    "collaboration_mode": "decentralized",
    "preference_num_candidates": 80,
    "preference_pairs_per_sample": 16,
    "pair_selection": "reward_gap",
    "dpo_beta": 0.1,
    "use_environment_step": True,
    "environment_steps_per_pair": 2,
}
COMLRL_MARLHF = {
    **COMLRL_MADPO,
    "rl_algorithm": "magrpo",
    "num_generations": 4,
    "reward_model_name": None,
    "reward_model_device": "cuda:0",
    "reward_learning_rate": 1e-05,
    "reward_num_train_epochs": 1,
    "reward_train_batch_size": 1,
    "reward_max_length": None,
    "reward_freeze_backbone": False,
    "critic_model_name": None,
    "critic_learning_rate": None,
    "critic_devices": None,
    "use_separate_critic": True,
    "critic_type": "v",
    "value_loss_coef": 0.6,
    "value_clip_range": 0.2,
    "critic_value_head_hidden_dim": None,
    "value_head_hidden_dim": None,
}


@pytest.mark.parametrize(
    ("trainer", "fields"),
    [
        ("magrpo", COMLRL_MAGRPO),
        ("iac", COMLRL_IAC),
        ("maac", COMLRL_MAAC),
        ("madpo", COMLRL_MADPO),
        ("marlhf", COMLRL_MARLHF),
    ],
)
def test_a_config_copied_whole_from_comlrl_loads(trainer, fields):
    cfg = config_class(trainer)(**fields)
    assert cfg.num_train_epochs == fields["num_train_epochs"]
    # CoMLRL's __post_init__ sets train_batch_size to rollout_buffer_size: a dump of a built config carries that
    built = config_class(trainer)(**{**fields, "train_batch_size": fields["rollout_buffer_size"]})
    assert built.prompts_per_step == fields["rollout_buffer_size"]


def test_train_batch_size_is_accepted_where_it_is_the_whole_collected_batch():
    assert MAGRPOConfig(rollout_buffer_size=2, train_batch_size=2).prompts_per_step == 2
    assert IACConfig(per_device_train_batch_size=8, train_batch_size=8).prompts_per_step == 8
    assert MAGRPOConfig(prompts_per_step=3, train_batch_size=3).prompts_per_step == 3
    # several optimizer steps per buffer: comarl takes one
    with pytest.raises(
        ConfigError,
        match=r"^train_batch_size=1: a CoMLRL field comarl does not take; comarl takes one optimizer step per "
        r"collected batch of prompts_per_step=2 items \(train_batch_size equal to it",
    ):
        MAGRPOConfig(rollout_buffer_size=2, train_batch_size=1)


def test_eval_batch_size_changes_nothing_at_any_value():
    # CoMLRL's evaluate() generates one item at a time whatever eval_batch_size is
    assert MAGRPOConfig(eval_batch_size=8).to_dict() == MAGRPOConfig().to_dict()
    with pytest.raises(ConfigError, match=r"^eval_batch_size=0: must be an integer >= 1 \(CoMLRL's check"):
        MAGRPOConfig(eval_batch_size=0)


def test_reference_devices_is_accepted_without_a_kl_penalty():
    assert MAGRPOConfig(reference_devices=["cuda:1"]).beta == 0.0
    with pytest.raises(
        ConfigError, match=r"^reference_devices='cuda:1': a CoMLRL field comarl does not take"
    ):
        MAGRPOConfig(reference_devices="cuda:1", reference_kl_enabled=True)


@pytest.mark.parametrize("cls", [MAGRPOConfig, IACConfig, MADPOConfig])
def test_parallel_training_mp_needs_agent_devices_as_in_comlrl(cls):
    with pytest.raises(
        ConfigError,
        match=r"^parallel_training='MP' needs agent_devices= \(CoMLRL: 'requires explicit agent_devices'\): give "
        r"one device per agent, e\.g\. agent_devices=\['cuda:0', 'cuda:1'\], or remove parallel_training",
    ):
        cls(parallel_training="MP")
    assert cls(parallel_training="mp", agent_devices="cpu").agent_devices == "cpu"


# ----------------------------------------------------------------------------- IAC / MAAC


def test_critic_learning_rate_none_is_the_rate_of_the_agent_it_serves(qwen_bpe):
    """None was replaced by learning_rate when the config was built: a later replace(learning_rate=) kept the old
    rate for the critics, and a value head ignored its agent's own rate (agent_settings)."""
    assert IACConfig(critic_learning_rate=None).critic_rate(5e-6) == 5e-6
    assert IACConfig().critic_rate(5e-6) == 1e-4  # comarl's default is unchanged
    config = replace(IACConfig(critic_learning_rate=None, max_new_tokens=4), learning_rate=3e-5)
    common = dict(
        model=qwen_bpe, num_agents=2, reward_func=lambda a, b: [0.0], train_dataset=[{"prompt": "hi"}] * 4
    )
    settings = [{}, {"learning_rate": 1e-3}]
    heads = IACTrainer(**common, args=replace(config, agent_settings=settings))
    # the value head is the last parameter group of its agent's optimizer
    assert [opt.param_groups[-1]["initial_lr"] for opt in heads.optimizers] == [3e-5, 1e-3]
    critics = IACTrainer(**common, critic_model=qwen_bpe, args=replace(config, agent_settings=settings))
    assert [opt.param_groups[0]["lr"] for opt in critics.critic_optimizers] == [3e-5, 1e-3]
    own = Agent.from_pretrained(qwen_bpe, learning_rate=2e-4)  # an Agent's own rate wins, for its head too
    heads = IACTrainer(
        agents=[own, qwen_bpe],
        reward_func=common["reward_func"],
        train_dataset=common["train_dataset"],
        args=config,
    )
    assert [opt.param_groups[-1]["initial_lr"] for opt in heads.optimizers] == [2e-4, 3e-5]
    central = MAACTrainer(**common, args=replace(MAACConfig(critic_learning_rate=None), learning_rate=2e-5))
    assert central.critic_optimizers[0].param_groups[0]["lr"] == 2e-5
    with pytest.raises(ConfigError, match=r"^critic_learning_rate=0: must be > 0 \(or None\)$"):
        IACConfig(critic_learning_rate=0)


def test_use_separate_critic_false_is_the_value_head_comarl_uses_without_a_critic_model():
    cfg = IACConfig(use_separate_critic=False)
    assert cfg.critic_model is None
    cfg.check_team(2, 8)
    with pytest.raises(
        ConfigError,
        match=r"^use_separate_critic=False with critic_model='c': CoMLRL refuses a critic model then too; remove "
        r"critic_model=",
    ):
        IACConfig(use_separate_critic=False, critic_model="c")
    # the trainer's critic_model= reaches the config through dataclasses.replace: checked there too
    with pytest.raises(ConfigError, match=r"^use_separate_critic=False with critic_model='c'"):
        replace(cfg, critic_model="c")
    with pytest.raises(
        ConfigError, match=r"^use_separate_critic=False: the centralized critic \(MAAC, MAPPO\)"
    ):
        MAACConfig(use_separate_critic=False)


def test_use_separate_critic_true_needs_a_critic_model_by_the_time_the_trainer_checks_the_team():
    cfg = IACConfig(use_separate_critic=True)  # the trainer's critic_model= may still come
    with pytest.raises(
        ConfigError,
        match=r"^use_separate_critic=True but no critic model was given: pass critic_model= to the trainer",
    ):
        cfg.check_team(2, 8)
    replace(cfg, critic_model="c").check_team(2, 8)
    IACConfig(use_separate_critic=True, critic_model="c").check_team(2, 8)
    IPPOConfig(use_separate_critic=True, critic_model="c").check_team(2, 8)
    MAACConfig(use_separate_critic=True).check_team(2, 8)  # centralized: a copy of agent 0's model


def test_use_separate_critic_through_the_trainer(qwen_bpe):
    data = [{"prompt": "hi"}] * 4
    common = dict(agent_model=qwen_bpe, train_dataset=data, reward_func=lambda a, b: [1.0])
    with pytest.raises(ConfigError, match=r"^use_separate_critic=True but no critic model was given"):
        IACTrainer(**common, args=IACConfig(use_separate_critic=True, max_new_tokens=4))
    trainer = IACTrainer(
        **common, critic_model=qwen_bpe, args=IACConfig(use_separate_critic=True, max_new_tokens=4)
    )
    assert trainer.args.critic_model == qwen_bpe
    with pytest.raises(ConfigError, match=r"^use_separate_critic=False with critic_model="):
        IACTrainer(**common, critic_model=qwen_bpe, args=IACConfig(use_separate_critic=False))


# ----------------------------------------------------------------------------- MADPO / MARLHF


def test_madpo_takes_comlrls_inherited_advantage_defaults():
    cfg = MADPOConfig(advantage_mode="mean", advantage_normalization=True)
    assert (cfg.baseline, cfg.scale) == ("none", "none")
    for name, value in (("advantage_mode", "rloo"), ("advantage_normalization", False)):
        with pytest.raises(
            ConfigError,
            match=rf"^{name}={value!r}: MADPO learns from preference pairs, not advantages \(CoMLRL's MADPO "
            rf"ignores {name} too",
        ):
            MADPOConfig(**{name: value})


def test_marlhf_reward_model_name_is_reward_model():
    assert MARLHFConfig(reward_model_name="rm").reward_model == "rm"
    assert MARLHFConfig(reward_model_name="rm", reward_model="rm").reward_model == "rm"
    with pytest.raises(
        ConfigError,
        match=r"^reward_model_name='a' and reward_model='b' both name the reward model's backbone",
    ):
        MARLHFConfig(reward_model_name="a", reward_model="b")


def test_marlhf_rl_algorithm_magrpo_is_comarls_marlhf():
    assert MARLHFConfig(rl_algorithm=" MAGRPO ").baseline == "group_mean"
    # CoMLRL's 'magrpo' sets advantage_mode='mean': another baseline is not what it trains
    with pytest.raises(
        ConfigError, match=r"^rl_algorithm='magrpo': a CoMLRL field comarl does not take; MARLHF"
    ):
        MARLHFConfig(rl_algorithm="magrpo", advantage_mode="raw")


def test_marlhf_reward_model_device_naming_agent_0s_device_is_accepted():
    MARLHFConfig(reward_model_device="cuda:0")  # auto placement puts agent 0 on GPU 0
    MARLHFConfig(reward_model_device="cuda:1", agent_devices=["cuda:1", "cuda:0"])
    MARLHFConfig(reward_model_device="cpu", agent_devices="cpu")
    for first in ("auto", "cuda", ["cuda", "cuda:1"]):  # each puts agent 0 on the first GPU
        MARLHFConfig(reward_model_device="cuda:0", agent_devices=first)
    with pytest.raises(
        ConfigError, match=r"^reward_model_device='cuda:0': a CoMLRL field comarl does not take"
    ):
        MARLHFConfig(reward_model_device="cuda:0", agent_devices=["cuda:1", "cuda:0"])


def test_marlhf_critic_fields_say_comarls_marlhf_has_no_critic():
    with pytest.raises(
        ConfigError,
        match=r"^value_loss_coef=0\.5: a CoMLRL field comarl does not take; CoMLRL's MARLHF reads it only with "
        r"rl_algorithm='iac' / 'maac'",
    ):
        MARLHFConfig(value_loss_coef=0.5)
    # IAC maps the same CoMLRL name onto its own field
    assert IACConfig(value_loss_coef=0.5).value_coef == 0.5
