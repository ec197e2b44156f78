"""Trainer configs, CoMLRL aliases, validation messages and YAML run specs."""

import re
import subprocess
import sys

import pytest

from comarl.config import (
    COMLRL_REFUSED,
    TRAINERS,
    ConfigError,
    IACConfig,
    MADPOConfig,
    MAGRPOConfig,
    MAREINFORCEConfig,
    MAReMaxConfig,
    MARLOOConfig,
    RunSpec,
    comlrl_spellings,
    config_class,
    config_help,
    load_run_spec,
)

# ----------------------------------------------------------------------------- defaults


def test_defaults_construct():
    cfg = MAGRPOConfig()
    assert (cfg.prompts_per_step, cfg.num_generations, cfg.learning_rate) == (4, 4, 5e-6)
    assert (cfg.baseline, cfg.scale, cfg.joint_mode, cfg.beta) == ("group_mean", "group", "aligned", 0.0)
    assert cfg.to_dict()["num_generations"] == 4
    assert "per_device_train_batch_size" not in cfg.to_dict()  # an alias, not a field


@pytest.mark.parametrize(
    ("cls", "baseline", "scale"),
    [
        (MAGRPOConfig, "group_mean", "group"),
        (MAREINFORCEConfig, "none", "none"),
        (MARLOOConfig, "leave_one_out", "none"),
        (MAReMaxConfig, "greedy", "none"),
    ],
)
def test_family_defaults(cls, baseline, scale):
    cfg = cls()
    assert (cfg.baseline, cfg.scale) == (baseline, scale)
    assert isinstance(cfg, MAGRPOConfig)


def test_family_defaults_differ_pairwise():
    settings = {
        (c().baseline, c().scale) for c in (MAGRPOConfig, MAREINFORCEConfig, MARLOOConfig, MAReMaxConfig)
    }
    assert len(settings) == 4


def test_config_help_has_a_line_per_field():
    helps = config_help(MAGRPOConfig)
    assert "prompts_per_step" in helps
    assert "group size" in helps["num_generations"]
    assert all(helps[name] for name in ("learning_rate", "baseline", "scale", "joint_mode"))


# ----------------------------------------------------------------------------- CoMLRL aliases


def test_batch_size_aliases():
    assert MAGRPOConfig(per_device_train_batch_size=3).prompts_per_step == 3
    assert MAGRPOConfig(rollout_buffer_size=2).prompts_per_step == 2


def test_learning_rate_alias():
    assert MAGRPOConfig(agent_learning_rate=1e-4).learning_rate == 1e-4


@pytest.mark.parametrize(
    ("mode", "baseline"),
    [("mean", "group_mean"), ("raw", "none"), ("max", "group_max"), ("rloo", "leave_one_out")],
)
def test_advantage_mode_alias(mode, baseline):
    # raw returns are not scaled (see test_advantage_normalization_alias)
    assert MAGRPOConfig(advantage_mode=mode, advantage_normalization=mode != "raw").baseline == baseline


def test_advantage_mode_unknown():
    with pytest.raises(ConfigError, match=r"advantage_mode='median'"):
        MAGRPOConfig(advantage_mode="median")


def test_advantage_normalization_alias():
    assert MAGRPOConfig(advantage_normalization=False).scale == "none"
    assert MAGRPOConfig(advantage_normalization=True).scale == "group"
    # Raw returns divided by their spread: 1e4 for a group that all scored 1. CoMLRL re-standardised (= MAGRPO).
    with pytest.raises(ConfigError, match=r"scale='group' with baseline='none'.*gives baseline='group_mean'"):
        MAREINFORCEConfig(advantage_normalization=True)
    with pytest.raises(ConfigError, match=r"scale='batch' with baseline='greedy'"):
        MAGRPOConfig(baseline="greedy", scale="batch")
    # CoMLRL's advantage_mode="raw" alone is REINFORCE: raw returns, unscaled
    assert (MAGRPOConfig(advantage_mode="raw").baseline, MAGRPOConfig(advantage_mode="raw").scale) == (
        "none",
        "none",
    )
    # IAC / MAAC: CoMLRL's advantage_normalization whitens the batch's advantages
    assert IACConfig(advantage_normalization=False).whiten_advantages is False
    assert IACConfig(advantage_normalization=True).whiten_advantages is True
    assert IACConfig(advantage_normalization=True).scale == "none"


def test_reference_kl_aliases():
    assert MAGRPOConfig(reference_kl_enabled=True, reference_kl_coef=0.05).beta == 0.05
    assert MAGRPOConfig(reference_kl_enabled=False, reference_kl_coef=0.05).beta == 0.0
    assert MAGRPOConfig(reference_kl_enabled=True).beta == 0.1  # CoMLRL's default coefficient
    # CoMLRL subtracts the KL from the returns: a reward term (k1 here, see docs/algorithms.md)
    assert MAGRPOConfig(reference_kl_enabled=True).kl_penalty == "reward"
    assert MAGRPOConfig(reference_kl_enabled=False).kl_penalty == "loss"
    # CoMLRL's reference_kl_enabled defaults to False: the coefficient alone turns nothing on
    assert MAGRPOConfig(reference_kl_coef=0.05).beta == 0.0


@pytest.mark.parametrize(
    ("given", "mode"),
    [("align", "aligned"), ("aligned", "aligned"), ("crossed", "cross"), ("cross", "cross")],
)
def test_joint_mode_aliases(given, mode):
    assert MAGRPOConfig(joint_mode=given).joint_mode == mode


def test_parallel_training_alias():
    assert MAGRPOConfig(parallel_training="mp", agent_devices=["cpu", "cpu"]).agent_devices == ["cpu", "cpu"]
    MAGRPOConfig(parallel_training=" None ")  # CoMLRL normalises case and spaces
    with pytest.raises(ConfigError, match=r"parallel_training='ddp'"):
        MAGRPOConfig(parallel_training="ddp")


# ----------------------------------------------------------------------------- validation errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_generations": 0}, r"num_generations=0: must be an integer >= 1"),
        ({"temperature": 0}, r"temperature=0: must be a finite number > 0"),
        ({"learning_rate": -1.0}, r"learning_rate=-1.0: must be a finite number > 0"),
        ({"top_p": 1.5}, r"top_p=1.5: must be in \(0, 1\]"),
        ({"joint_mode": "diagonal"}, r"joint_mode='diagonal': choose one of \['aligned', 'cross'\]"),
        ({"baseline": "foo"}, r"baseline='foo': choose one of"),
        ({"scale": "tokens"}, r"scale='tokens': choose one of"),
        ({"loss_aggregation": "sum"}, r"loss_aggregation='sum': choose one of"),
        ({"discount": 1.5}, r"discount=1.5: must be in \[0, 1\]"),
        ({"beta": -0.1}, r"beta=-0.1: must be >= 0"),
        ({"kl_penalty": "advantage"}, r"kl_penalty='advantage': choose one of \['loss', 'reward'\]"),
        ({"kl_penalty": "reward"}, r"kl_penalty='reward' with beta=0 penalises nothing: set beta > 0"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, r"min_new_tokens=10 > max_new_tokens=5"),
        ({"max_joint_actions": 8}, r"max_joint_actions only applies to joint_mode='cross'"),
        (
            {"joint_mode": "cross", "max_joint_actions": 3},
            r"max_joint_actions=3: must be >= num_generations=4",
        ),
        (
            {"num_generations": 1},
            r"num_generations=1: baseline='group_mean' with scale='group'.*needs num_generations >= 2",
        ),
    ],
)
def test_validation_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MAGRPOConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # a negative norm would reverse every clipped gradient; 0 would zero them
        (
            {"max_grad_norm": -1.0},
            r"max_grad_norm=-1.0: must be a finite number > 0 \(or None for no clipping\)",
        ),
        ({"max_grad_norm": 0}, r"max_grad_norm=0: must be a finite number > 0"),
        ({"weight_decay": -0.1}, r"weight_decay=-0.1: must be a finite number >= 0"),
        ({"adam_beta1": 2}, r"adam_beta1=2: must be in \[0, 1\)"),
        ({"adam_beta2": 1.0}, r"adam_beta2=1.0: must be in \[0, 1\)"),
        ({"adam_epsilon": 0.0}, r"adam_epsilon=0.0: must be a finite number > 0"),
        ({"top_k": -3}, r"top_k=-3: must be >= 0 \(0 or None = off\)"),
        ({"eval_num_samples": 0}, r"eval_num_samples=0: must be >= 1 \(or None for all\)"),
        ({"lora_alpha": 0}, r"lora_alpha=0: must be a finite number > 0"),
        # NumPy refused these only once the trainer seeded it, after the models were built
        ({"seed": -1}, r"^seed=-1: must be an integer in \[0, 2\*\*31 - 1\]$"),
        ({"seed": 2**31}, r"^seed=2147483648: must be an integer in \[0, 2\*\*31 - 1\]$"),
        ({"success_threshold": float("nan")}, r"success_threshold=nan: must be a finite number \(or None\)"),
        (
            {"reward_weights": [1.0, float("inf")]},
            r"reward_weights=\[1.0, inf\]: every weight must be a finite",
        ),
    ],
)
def test_range_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MAGRPOConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # each of these reached a comparison or the trainer and failed there, with no field named
        ({"top_p": "abc"}, r"^top_p='abc': must be a number$"),
        ({"max_steps": "abc"}, r"^max_steps='abc': must be an integer$"),
        ({"seed": 1.5}, r"^seed=1.5: must be an integer$"),
        ({"temperature": True}, r"^temperature=True: must be a number$"),
        ({"progress_bar": "no"}, r"^progress_bar='no': must be true or false$"),
        ({"frozen_agents": 1}, r"^frozen_agents=1: must be a list of integers$"),
        ({"reward_weights": 3}, r"^reward_weights=3: must be a list of numbers or null$"),
        ({"success_threshold": "abc"}, r"^success_threshold='abc': must be a number or null$"),
        ({"agent_devices": 0}, r"^agent_devices=0: must be a list of strings or a string or null$"),
        (
            {"advantage_normalization": "yes"},
            r"^advantage_normalization='yes': must be true or false or null$",
        ),
    ],
)
def test_type_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MAGRPOConfig(**kwargs)


def test_subclass_fields_are_type_checked_too():
    with pytest.raises(ConfigError, match=r"^dpo_beta='x': must be a number$"):
        MADPOConfig(dpo_beta="x")


def test_micro_batch_rows_follow_the_token_budget():
    # 100 padded tokens per row: a 2048 budget holds 20 rows, micro_batch_size caps it, a long row still runs alone.
    assert MAGRPOConfig().micro_batch_rows(rows=32, row_tokens=100) == 20
    assert MAGRPOConfig(micro_batch_size=8, prompts_per_step=4).micro_batch_rows(rows=32, row_tokens=100) == 8
    assert MAGRPOConfig(micro_batch_tokens=None).micro_batch_rows(rows=32, row_tokens=100) == 32
    assert MAGRPOConfig(micro_batch_tokens=50).micro_batch_rows(rows=32, row_tokens=100) == 1
    with pytest.raises(
        ConfigError, match=r"micro_batch_tokens=0: must be an integer >= 1 \(or None for no budget\)"
    ):
        MAGRPOConfig(micro_batch_tokens=0)


def test_micro_batch_size_must_divide_completions():
    with pytest.raises(
        ConfigError, match=r"micro_batch_size=5: .*prompts_per_step x num_generations = 4 x 4 = 16"
    ):
        MAGRPOConfig(micro_batch_size=5, prompts_per_step=4, num_generations=4)
    assert MAGRPOConfig(micro_batch_size=8, prompts_per_step=4, num_generations=4).micro_batch_size == 8


def test_single_generation_allowed_without_group_statistics():
    cfg = MAGRPOConfig(num_generations=1, baseline="none", scale="none")
    assert cfg.num_generations == 1
    assert MAREINFORCEConfig(num_generations=1).num_generations == 1


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match="nonsense"):
        MAGRPOConfig(nonsense=1)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------------------- check_team


def test_check_team_num_agents_mismatch():
    with pytest.raises(ConfigError, match=r"num_agents=3 in the config, but the trainer was given 2 agents"):
        MAGRPOConfig(num_agents=3).check_team(2, 100)
    MAGRPOConfig(num_agents=2).check_team(2, 100)


def test_check_team_dataset_too_small():
    with pytest.raises(ConfigError, match=r"prompts_per_step=4 but the training dataset has 3 items"):
        MAGRPOConfig(prompts_per_step=4).check_team(2, 3)
    MAGRPOConfig(prompts_per_step=4).check_team(2, 4)
    MAGRPOConfig(prompts_per_step=4).check_team(2, None)  # unknown length: nothing to check


def test_check_team_cross_mode_too_many_joint_actions():
    # 4 ** 7 = 16384 > 4096
    with pytest.raises(
        ConfigError, match=r"num_generations \*\* num_agents = 4 \*\* 7 = 16384 joint actions"
    ):
        MAGRPOConfig(joint_mode="cross").check_team(7, None)
    MAGRPOConfig(joint_mode="cross").check_team(6, None)  # 4 ** 6 = 4096 is still fine
    MAGRPOConfig(joint_mode="cross", max_joint_actions=16).check_team(7, None)


def test_check_team_tree_budget():
    # aligned, G=4, T=3: 1 + 4 + 16 = 21 nodes per item
    assert MAGRPOConfig(num_turns=3).tree_nodes(2) == 21
    # cross, G=4, N=2 -> K=16 children per node, T=3: 1 + 16 + 256 = 273 > max_nodes=256
    cfg = MAGRPOConfig(num_turns=3, joint_mode="cross")
    with pytest.raises(
        ConfigError, match=r"has 1 \+ 16 \+ 256 = 273 nodes .* > max_nodes=256: set max_children"
    ):
        cfg.check_team(2, 100)
    # a budget of 3 children per node: 1 + 3 + 9 = 13
    cfg = MAGRPOConfig(num_turns=3, joint_mode="cross", max_children=3)
    cfg.check_team(2, 100)
    assert cfg.tree_nodes(2) == 13
    MAReMaxConfig(num_turns=2).check_team(2, 100)  # multi-turn ReMax: greedy paths from every node


# ----------------------------------------------------------------------------- step arithmetic


def test_total_steps_and_steps_per_epoch():
    cfg = MAGRPOConfig(prompts_per_step=4, num_train_epochs=3)
    assert cfg.steps_per_epoch(10) == 2  # 10 // 4
    assert cfg.total_steps(10) == 6  # 2 steps x 3 epochs
    assert (
        MAGRPOConfig(prompts_per_step=4, num_train_epochs=3, max_steps=5).total_steps(10) == 5
    )  # max_steps wins
    # max_steps=0 is not a limit of zero steps: only max_steps > 0 overrides the epochs
    assert MAGRPOConfig(prompts_per_step=4, num_train_epochs=3, max_steps=0).total_steps(10) == 6


# ----------------------------------------------------------------------------- run specs


SPEC = """\
trainer: marloo
num_agents: 2
args:
  num_generations: 2
  prompts_per_step: 2
"""


@pytest.fixture
def spec_path(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(SPEC)
    return path


def test_load_run_spec_reads_yaml(spec_path):
    spec = load_run_spec(spec_path)
    assert isinstance(spec, RunSpec)
    assert (spec.trainer, spec.num_agents, spec.args) == (
        "marloo",
        2,
        {"num_generations": 2, "prompts_per_step": 2},
    )
    args = spec.trainer_args()
    assert isinstance(args, MARLOOConfig)
    assert (args.num_generations, args.baseline) == (2, "leave_one_out")


@pytest.mark.parametrize("override", ["args.learning_rate=0.001", "learning_rate=0.001"])
def test_overrides_reach_args(spec_path, override):
    spec = load_run_spec(spec_path, [override])
    assert spec.args == {"num_generations": 2, "prompts_per_step": 2, "learning_rate": 0.001}
    assert spec.trainer_args().learning_rate == 0.001


def test_override_scientific_notation_is_a_number(spec_path):
    # parse_value promises that `1e-3` means what it looks like: the float 0.001, not the string '1e-3'
    spec = load_run_spec(spec_path, ["learning_rate=1e-3"])
    assert spec.args["learning_rate"] == 0.001
    assert spec.trainer_args().learning_rate == 0.001


def test_override_run_fields_and_alias(spec_path):
    spec = load_run_spec(spec_path, ["task=code", "model=m", "num_agents=3", "args.advantage_mode=raw"])
    assert (spec.task, spec.model, spec.num_agents) == ("code", "m", 3)
    assert spec.trainer_args().baseline == "none"


def test_override_unknown_key(spec_path):
    with pytest.raises(ConfigError, match=r"--set nonsense: unknown key"):
        load_run_spec(spec_path, ["nonsense=1"])
    with pytest.raises(ConfigError, match=r"--set args.nonsense: unknown trainer field 'nonsense'"):
        load_run_spec(spec_path, ["args.nonsense=1"])
    with pytest.raises(ConfigError, match=r"--set 'learning_rate': expected key=value"):
        load_run_spec(spec_path, ["learning_rate"])


def test_override_bad_value_names_the_field(spec_path):
    with pytest.raises(ConfigError, match=r"num_generations=0: must be an integer >= 1"):
        load_run_spec(spec_path, ["num_generations=0"])


def test_unknown_top_level_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(SPEC + "lerning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown run field 'lerning_rate'"):
        load_run_spec(path)


def test_unknown_field_inside_args(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(SPEC + "  nonsense: 1\n")
    with pytest.raises(
        ConfigError, match=r"^args.nonsense: unknown marloo field \(see `comarl fields marloo`\)$"
    ):
        load_run_spec(path)


def test_cli_bad_values_are_one_line_errors_with_exit_2(spec_path, capsys):
    """A bad value stops `comarl train` before any model loads: one line naming the field, exit status 2."""
    from comarl.cli import main

    for override, message in [
        ("args.top_p=abc", "top_p='abc': must be a number"),
        ("args.max_grad_norm=-1", "max_grad_norm=-1: must be a finite number > 0 (or None for no clipping)"),
        ("num_agents=two", "num_agents='two': must be an integer or null"),
    ]:
        assert main(["train", str(spec_path), "--set", override]) == 2
        assert capsys.readouterr().err == f"comarl: error: {message}\n"


def test_run_spec_without_file_uses_defaults():
    spec = load_run_spec(None, ["trainer=maremax"])
    assert (spec.trainer, spec.task, spec.args) == ("maremax", "demo", {})
    assert spec.trainer_args().baseline == "greedy"


def test_run_spec_validation():
    with pytest.raises(ConfigError, match=r"trainer='ppo'"):
        RunSpec(trainer="ppo")
    with pytest.raises(ConfigError, match=r"task='function' needs dataset"):
        RunSpec(task="function")
    # The team is one agent per entry of agents:; a num_agents that says otherwise was ignored before.
    code = {"task": "code", "agents": ["a", "b"]}
    with pytest.raises(
        ConfigError,
        match=r"^num_agents=3, but agents: names 2 models; remove num_agents \(the team is one agent",
    ):
        RunSpec(**code, num_agents=3)
    assert RunSpec(**code).num_agents == RunSpec(**code, num_agents=2).num_agents == 2
    assert RunSpec(task="code", agents=["a"]).num_agents == 1
    assert RunSpec(task="code", model="m").num_agents == 2


# ----------------------------------------------------------------------------- imports stay light


def test_config_does_not_import_torch():
    code = "import comarl.config, sys; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_package_import_is_light():
    code = (
        "import comarl, sys; "
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'vllm', 'wandb') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_cli_train_and_demo_refuse_what_they_cannot_use(tmp_path, capsys):
    from comarl.cli import main

    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert (
        capsys.readouterr().err
        == f"comarl: error: {tmp_path / 'nope.yaml'} does not exist; give a YAML run spec (see examples/)\n"
    )
    # --steps 0 trained the default 300 steps, and -2 one epoch
    for steps in ("0", "-2"):
        assert main(["demo", "--steps", steps, "--out", str(tmp_path / "demo")]) == 2
        assert capsys.readouterr().err.startswith(
            f"comarl: error: --steps {steps}: give a number of training steps >= 1"
        )
    assert main(["demo", "--out", "/proc/demo"]) == 2
    assert capsys.readouterr().err.startswith("comarl: error: --out /proc/demo: cannot create it (")


def test_cli_output_into_a_closed_pipe_ends_without_a_traceback():
    """`comarl fields magrpo | head -1`: the reader leaves before comarl has written; comarl stops quietly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "comarl", "fields", "magrpo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # closed before the child writes a byte: its first flush meets a broken pipe
    stderr = proc.stderr.read()
    assert proc.wait(timeout=60) == 1
    assert stderr == ""


# ----------------------------------------------------------------------------- what a new user gets wrong


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        # NaN passed `beta < 0` and `epsilon <= 0`; inf passed every `> 0` check
        (MAGRPOConfig, {"beta": float("nan")}, r"^beta=nan: must be a finite number$"),
        (MAGRPOConfig, {"beta": float("inf")}, r"^beta=inf: must be a finite number$"),
        (MAGRPOConfig, {"epsilon": float("nan")}, r"^epsilon=nan: must be a finite number$"),
        (MAGRPOConfig, {"epsilon_high": float("nan")}, r"^epsilon_high=nan: must be a finite number$"),
        (IACConfig, {"entropy_coef": float("nan")}, r"^entropy_coef=nan: must be a finite number$"),
        (IACConfig, {"critic_learning_rate": float("inf")}, r"^critic_learning_rate=inf: must be a finite"),
        (MADPOConfig, {"dpo_beta": float("inf")}, r"^dpo_beta=inf: must be a finite number$"),
        (
            MAGRPOConfig,
            {"agent_settings": [{}, {"micro_batch_size": 0}]},
            r"^agent_settings\[1\]: micro_batch",
        ),
        # a list reached a dict lookup (unhashable type: 'list', no field named)
        (MAGRPOConfig, {"joint_mode": ["aligned"]}, r"^joint_mode=\['aligned'\]: must be a string$"),
        # the critic trainers divided by it (ZeroDivisionError)
        (IACConfig, {"micro_batch_size": 0}, r"^micro_batch_size=0: must be an integer >= 1 \(or None"),
        # '' passed the checks for a missing output_dir (save_steps, tensorboard), yet the trainer writes no files
        (MAGRPOConfig, {"output_dir": ""}, r"^output_dir='': give a folder, or null"),
    ],
)
def test_values_that_slipped_through_are_refused(cls, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        cls(**kwargs)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # PyYAML's own exceptions reached the user as tracebacks
        ("args:\n\tmax_steps: 2\n", r"run.yaml: not valid YAML: line 2, column 1: found character '\\t'"),
        ("args: {max_steps: 2\n", r"run.yaml: not valid YAML: line 2, column 1: expected ',' or '}'"),
        # the later value silently won
        (
            "args:\n  max_steps: 2\n  max_steps: 3\n",
            r"run.yaml: not valid YAML: line 3, column 3: duplicate key ",
        ),
        ("task: demo\ntask: code\n", r"run.yaml: not valid YAML: line 2, column 1: duplicate key 'task'"),
        # dict() of a list or a string: TypeError / ValueError
        ("args: [1, 2]\n", r"^args=\[1, 2\]: must be a mapping of magrpo fields"),
        ("args: hello\n", r"^args='hello': must be a mapping of magrpo fields"),
        # settings of other tasks were silently ignored
        (
            "task: demo\nmodel: Qwen/Qwen2.5-0.5B\n",
            r"^model='Qwen/Qwen2.5-0.5B': task='demo' does not use it",
        ),
        ("task: demo\nnum_agents: 3\n", r"^num_agents=3: task='demo' .* two agents"),
        (
            "task: code\nmodel: m\ndataset: d.jsonl\n",
            r"^dataset='d.jsonl': task='code' does not use it; .*source:",
        ),
        ("num_agents: 0\n", r"^num_agents=0: must be an integer >= 1"),
    ],
)
def test_yaml_mistakes_are_config_errors(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_run_spec(path)


def test_yaml_anchors_and_merge_keys_still_work(tmp_path):
    path = tmp_path / "run.yaml"
    # an explicit key overrides a merged one
    path.write_text("args: &a\n  <<: {max_steps: 2, seed: 1}\n  seed: 3\n")
    assert load_run_spec(path).args == {"max_steps": 2, "seed": 3}


def test_a_run_spec_that_is_not_a_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match=r"is a folder; give a YAML run spec"):
        load_run_spec(tmp_path)
    (tmp_path / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ConfigError, match=r"plot.png: cannot read it as text"):
        load_run_spec(tmp_path / "plot.png")


def test_overrides_parse_errors_and_the_trainer_they_set(spec_path):
    with pytest.raises(ConfigError, match=r"^--set args.learning_rate={: not valid YAML: line 1, column 2"):
        load_run_spec(spec_path, ["args.learning_rate={"])
    # fields of the trainer chosen by --set were refused as unknown fields of the YAML's trainer
    for overrides in (["trainer=ippo", "num_mini_batches=4"], ["args.num_mini_batches=4", "trainer=ippo"]):
        assert load_run_spec(spec_path, overrides).trainer_args().num_mini_batches == 4


# A value of each refused CoMLRL field that changes something here (CoMLRL's defaults are accepted: see
# tests/test_comlrl_fields.py), with the settings that make it refused.
REFUSED = {
    "train_batch_size": (3, {}),
    "reference_devices": (["cuda:1"], {"reference_kl_enabled": True}),
    "critic_devices": (["cuda:0"], {}),
    "critic_value_head_hidden_dim": (3, {}),
    "value_head_hidden_dim": (3, {}),
    "collaboration_mode": ("centralized", {}),
    "use_environment_step": (False, {}),
    "environment_steps_per_pair": (1, {}),
    "rl_algorithm": ("iac", {}),
    "reward_model_device": ("cuda:1", {}),
    "reward_max_length": (512, {}),
    "reward_freeze_backbone": (True, {}),
    "dpo_beta": (0.2, {}),
    "critic_model_name": ("critic", {}),
    "critic_learning_rate": (1e-5, {}),
    "use_separate_critic": (False, {}),
    "critic_type": ("q", {}),
    "value_loss_coef": (0.5, {}),
    "value_clip_range": (0.1, {}),
}


def _refusals():
    return sorted(
        (trainer, name)
        for trainer in TRAINERS
        for name in config_class(trainer).comlrl_refused()
        if name in comlrl_spellings(config_class(trainer))
    )


def test_every_refused_comlrl_field_has_a_refused_value_here():
    assert {name for _, name in _refusals()} == set(REFUSED)
    assert set(COMLRL_REFUSED) <= set(REFUSED)


@pytest.mark.parametrize(("trainer", "name"), _refusals())
def test_every_refused_comlrl_field_is_a_config_error_that_says_what_to_do(trainer, name):
    """MARLHF's rl_algorithm and reward_model_device (CoMLRL fields docs/preference.md lists) raised a bare
    TypeError; every refused CoMLRL field must reach the ConfigError that names the fix."""
    value, settings = REFUSED[name]
    fix = config_class(trainer).comlrl_refused()[name].format(prompts_per_step=4)
    with pytest.raises(
        ConfigError, match=rf"^{name}={re.escape(repr(value))}: a CoMLRL field comarl does not take; "
    ) as error:
        config_class(trainer)(**{name: value}, **settings)
    assert str(error.value).endswith(fix)


# ----------------------------------------------------------------------------- boundaries of the range checks


@pytest.mark.parametrize(
    "name",
    [
        "num_train_epochs",
        "prompts_per_step",
        "num_generations",
        "max_new_tokens",
        "num_iterations",
        "num_turns",
        "logging_steps",
        "num_generations_eval",
        "save_total_limit",
    ],
)
def test_counts_that_must_be_at_least_one_refuse_zero_and_take_one(name):
    """Zero epochs, turns, iterations or kept checkpoints would train, log or keep nothing; one is the least."""
    with pytest.raises(ConfigError, match=rf"^{name}=0: must be an integer >= 1$"):
        MAGRPOConfig(**{name: 0})
    alone = {"baseline": "none", "scale": "none"} if name == "num_generations" else {}  # no group to compare
    assert getattr(MAGRPOConfig(**{name: 1, **alone}), name) == 1


@pytest.mark.parametrize(
    "name",
    [
        "warmup_steps",
        "eval_interval",
        "min_new_tokens",
        "log_completions",
        "save_steps",
        "alternate_agents_every",
    ],
)
def test_counts_that_may_be_zero_refuse_negatives(name):
    """These may be 0 (off); a negative count is a mistake, refused with the field named."""
    with pytest.raises(ConfigError, match=rf"^{name}=-1: must be an integer >= 0$"):
        MAGRPOConfig(**{name: -1})
    assert getattr(MAGRPOConfig(**{name: 0}), name) == 0


def test_the_edges_of_the_ranges_are_taken_or_refused_as_documented():
    """Each range's closed end is a value a user may give (seed 0 and 2**31 - 1, top_k 0 = off, min_new_tokens equal
    to max_new_tokens, max_joint_actions equal to num_generations); its open end is refused."""
    assert MAGRPOConfig(seed=0).seed == 0
    assert MAGRPOConfig(seed=2**31 - 1).seed == 2**31 - 1
    assert MAGRPOConfig(top_k=0).top_k == 0
    assert MAGRPOConfig(min_new_tokens=5, max_new_tokens=5).min_new_tokens == 5
    assert MAGRPOConfig(joint_mode="cross", max_joint_actions=4).max_joint_actions == 4  # G = 4
    with pytest.raises(ConfigError, match=r"^top_p=0: must be in \(0, 1\]$"):
        MAGRPOConfig(top_p=0)
    with pytest.raises(ConfigError, match=r"^warmup_ratio=1.0: must be in \[0, 1\)$"):
        MAGRPOConfig(warmup_ratio=1.0)
    with pytest.raises(ConfigError, match=r"^epsilon and epsilon_high must be > 0$"):
        MAGRPOConfig(epsilon_high=0.0)
    with pytest.raises(ConfigError, match=r"^num_agents=0: must be >= 1$"):
        MAGRPOConfig(num_agents=0)
    with pytest.raises(ConfigError, match=r"^max_children=0: must be >= 1"):
        MAGRPOConfig(max_children=0)
    with pytest.raises(ConfigError, match=r"^max_nodes=0: must be >= 1$"):
        MAGRPOConfig(max_nodes=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"agent_parallel": True}, r"^share_weights=True: every agent is the same model, so agent_parallel"),
        (
            {"alternate_agents_every": 2},
            r"^share_weights=True: every agent is the same model, so alternate_agents_every",
        ),
        (
            {"data_parallel": True, "shard_weights": True},
            r"^shard_weights=True shards each agent's own model; ",
        ),
    ],
)
def test_share_weights_refuses_what_cannot_apply_to_one_model(kwargs, message):
    """One model in every role has no agent to freeze, alternate, give its own process or shard as its own."""
    with pytest.raises(ConfigError, match=message):
        MAGRPOConfig(share_weights=True, **kwargs)


# ----------------------------------------------------------------------------- per-agent settings


def test_for_agent_applies_that_agents_settings_only():
    """Agent i samples and learns with agent_settings[i] over the shared values; the others keep the shared ones."""
    cfg = MAGRPOConfig(agent_settings=[{"temperature": 0.5}, {}, {"learning_rate": 1e-3, "top_k": 7}])
    assert (cfg.for_agent(0).temperature, cfg.for_agent(0).learning_rate) == (0.5, 5e-6)
    assert (cfg.for_agent(1).temperature, cfg.for_agent(1).learning_rate) == (1.0, 5e-6)
    assert (cfg.for_agent(2).learning_rate, cfg.for_agent(2).top_k, cfg.for_agent(2).temperature) == (
        1e-3,
        7,
        1.0,
    )
    assert cfg.for_agent(2).agent_settings is None and cfg.temperature == 1.0


# ----------------------------------------------------------------------------- check_team edges


def test_check_team_refuses_extra_agent_settings_and_counts_frozen_agents_once():
    """One dict per agent, no more; an agent named twice in frozen_agents is still one frozen agent."""
    with pytest.raises(ConfigError, match=r"^agent_settings has 3 entries for 2 agents"):
        MAGRPOConfig(agent_settings=[{}, {}, {}]).check_team(2, None)
    MAGRPOConfig(frozen_agents=[1, 1]).check_team(2, None)  # agent 0 still learns


def test_check_team_takes_a_tree_of_exactly_max_nodes():
    """aligned, G=4, 4 turns: 1 + 4 + 16 + 64 = 85 nodes per item, within max_nodes=85 and over 84."""
    MAGRPOConfig(num_turns=4, max_nodes=85).check_team(2, None)
    with pytest.raises(ConfigError, match=r"1 \+ 4 \+ 16 \+ 64 = 85 nodes .* > max_nodes=84"):
        MAGRPOConfig(num_turns=4, max_nodes=84).check_team(2, None)


def test_budgets_above_what_exists_do_not_grow_the_tree():
    """max_joint_actions above G**N (2**2 = 4) and max_children above the joint actions per node cap nothing: every
    node has 4 children, so 3 turns give 1 + 4 + 16 = 21 nodes."""
    cfg = MAGRPOConfig(num_generations=2, joint_mode="cross", max_joint_actions=8, num_turns=3)
    assert (cfg.joint_actions_per_node(2), cfg.tree_nodes(2)) == (4, 21)
    cfg = MAGRPOConfig(num_generations=4, max_children=10, num_turns=3)  # aligned: 4 joint actions per node
    assert (cfg.children_per_node(2), cfg.tree_nodes(2)) == (4, 21)


# ----------------------------------------------------------------------------- CoMLRL spellings


def test_comlrl_batch_size_spellings_must_agree():
    """per_device_train_batch_size and rollout_buffer_size both set prompts_per_step: the same value is one setting,
    two values are refused rather than one silently winning."""
    assert MAGRPOConfig(per_device_train_batch_size=3, rollout_buffer_size=3).prompts_per_step == 3
    with pytest.raises(ConfigError, match=r"^per_device_train_batch_size and rollout_buffer_size both set"):
        MAGRPOConfig(per_device_train_batch_size=3, rollout_buffer_size=2)


def test_comlrl_parallel_training_null_is_none():
    """CoMLRL's normalize_parallel_training reads 'null' (any case) as 'none': no model parallelism, no devices."""
    assert MAGRPOConfig(parallel_training="Null").agent_devices is None
