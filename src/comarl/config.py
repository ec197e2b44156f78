"""Configs: one dataclass per trainer family, YAML run specs and ``--set`` overrides.

Every value is validated when the config is built, before any model loads; an error names the
field and the fix. This module does not import torch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from comarl.choices import AGGREGATIONS, BASELINES, CENTRED_BASELINES, KL_PENALTIES, PAIR_SELECTIONS, SCALES

# The file of a critic's or reward model's head in its folder (comarl.critics saves and loads it).
VALUE_HEAD_FILE = "value_head.pt"


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix."""


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


def _matches(value: Any, annotation: str) -> bool:
    """Whether ``value`` has a type the field annotation ``annotation`` allows (``int | None``, ``list[str]``, ...).
    An int is a float; a bool is neither."""
    for option in annotation.split(" | "):
        if option == "Any" or (option == "None" and value is None):
            return True
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy scalars too
        if (
            (option == "bool" and isinstance(value, bool))
            or (option == "int" and number and isinstance(value, numbers.Integral))
            or (option == "float" and number)
            or (option == "str" and isinstance(value, str))
            or (option.startswith("dict[") and isinstance(value, dict))
        ):
            return True
        if (
            option.startswith("list[")
            and isinstance(value, (list, tuple))
            and all(_matches(v, option[5:-1]) for v in value)
        ):
            return True
    return False


_TYPE_WORDS = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "None": "null",
}


def _type_words(annotation: str) -> str:
    """``int | None`` -> 'an integer or null'; ``list[str]`` -> 'a list of strings'."""
    words = []
    for option in annotation.split(" | "):
        if option.startswith("list["):
            words.append(f"a list of {_type_words(option[5:-1]).removeprefix('a ').removeprefix('an ')}s")
        elif option.startswith("dict["):
            words.append("a mapping")
        else:
            words.append(_TYPE_WORDS.get(option, option))
    return " or ".join(words)


def check_field_types(config: Any) -> None:
    """Raise ConfigError naming the first field of dataclass ``config`` whose value its annotation does not allow,
    before any range check compares it (``'abc' < 1`` would fail with no field named)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(f.type, str) and not _matches(value, f.type):
            raise ConfigError(f"{f.name}={value!r}: must be {_type_words(f.type)}")


# What agent_settings may set per agent: sampling, the update's micro-batches and the learning rate.
AGENT_SETTINGS = (
    "learning_rate",
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "min_new_tokens",
    "micro_batch_size",
    "micro_batch_tokens",
    "bf16",
)
JOINT_MODES = ("aligned", "cross")
REWARD_CALLS = ("per_joint_action", "batched")
LR_SCHEDULES = ("constant", "linear", "cosine")
# NumPy takes seeds below 2**32 and the trainer seeds further streams with seed + offsets (up to
# seed + 200 + agent + 1000 * data shard): the top half of that range is left to the offsets.
MAX_SEED = 2**31 - 1

# CoMLRL spellings accepted by `joint_mode` and `advantage_mode`.
_JOINT_MODE_ALIASES = {"align": "aligned", "aligned": "aligned", "cross": "cross", "crossed": "cross"}
_ADVANTAGE_MODES = {"mean": "group_mean", "raw": "none", "max": "group_max", "rloo": "leave_one_out"}


@dataclass
class MAGRPOConfig:
    """Settings of the MAGRPO family (MAGRPO, MAREINFORCE, MARLOO, MAReMax).

    Batch arithmetic, per agent and per optimizer step::

        completions per agent = prompts_per_step x num_generations
        rows per micro-batch  = min(micro_batch_size, micro_batch_tokens // padded row length)  (>= 1;
                                gradient accumulation, the loss normalised over the whole batch)
        joint actions / item  = num_generations            (joint_mode="aligned")
                              = num_generations ** N       (joint_mode="cross", or max_joint_actions)

    CoMLRL 1.4.3 field names are accepted where they mean the same thing (see ``docs/comlrl.md``).
    """

    # --- data and schedule
    num_train_epochs: int = _help("Passes over the training dataset.", default=1)
    max_steps: int = _help(
        "Stop after this many optimizer steps (overrides num_train_epochs when > 0).", default=-1
    )
    prompts_per_step: int = _help(
        "Dataset items per training step; every agent answers each of them num_generations times. "
        "(CoMLRL: per_device_train_batch_size / rollout_buffer_size.)",
        default=4,
    )
    micro_batch_size: int | None = _help(
        "Completions per forward/backward pass in the update; None = all completions of the step at once. "
        "Must divide prompts_per_step x num_generations.",
        default=None,
    )
    micro_batch_tokens: int | None = _help(
        "Token budget of one forward/backward pass: at most this many padded prompt+completion tokens "
        "(rows x row length, at least one row); caps micro_batch_size. Peak memory of the update grows with "
        "it. None = no budget.",
        default=2048,
    )
    shuffle: bool = _help("Reshuffle the dataset every epoch (seeded).", default=True)
    seed: int = _help(
        "Seed for model init, data order and sampling: item j of step s samples from streams keyed (seed, j, s).",
        default=42,
    )

    # --- optimizer
    learning_rate: float = _help(
        "AdamW learning rate of every agent without its own (CoMLRL: agent_learning_rate).", default=5e-6
    )
    weight_decay: float = _help("AdamW weight decay.", default=0.0)
    adam_beta1: float = _help("AdamW beta1.", default=0.9)
    adam_beta2: float = _help("AdamW beta2.", default=0.999)
    adam_epsilon: float = _help("AdamW epsilon.", default=1e-8)
    max_grad_norm: float | None = _help(
        "Clip each agent's gradient to this global norm; None disables.", default=1.0
    )
    lr_scheduler_type: str = _help(
        "Learning-rate schedule after warmup: constant, linear (to 0) or cosine (to 0).", default="constant"
    )
    warmup_steps: int = _help(
        "Linear warmup over this many optimizer steps: step s (from 0) uses (s + 1) / (warmup_steps + 1) of "
        "learning_rate, so no step is taken at rate 0.",
        default=0,
    )
    warmup_ratio: float = _help(
        "Warmup as a fraction of the optimizer steps, rounded up as in transformers (used when warmup_steps is 0).",
        default=0.0,
    )

    # --- generation
    num_generations: int = _help("Completions each agent samples per prompt (the group size G).", default=4)
    max_new_tokens: int = _help("Maximum tokens per completion.", default=128)
    min_new_tokens: int = _help(
        "Minimum tokens per completion (EOS is suppressed before it). The loss scores the whole tempered "
        "distribution, EOS included, as for top_k / top_p.",
        default=0,
    )
    temperature: float = _help(
        "Sampling temperature; log-probs in the loss use the same temperature.", default=1.0
    )
    top_p: float = _help(
        "Nucleus sampling threshold (1.0 = off). The loss scores the whole tempered distribution, as TRL does.",
        default=1.0,
    )
    top_k: int | None = _help(
        "Top-k sampling (None or 0 = off). The loss scores the whole tempered distribution, as TRL does.",
        default=None,
    )

    # --- joint actions, turns, rewards
    joint_mode: str = _help(
        "'aligned': G joint actions (sample j of every agent together); 'cross': every combination (G^N), "
        "each completion's return = mean reward of the joint actions containing it.",
        default="aligned",
    )
    max_joint_actions: int | None = _help(
        "Cross mode: evaluate at most this many joint actions per item: the G aligned ones plus a seeded "
        "uniform sample of the others. None = all G^N.",
        default=None,
    )
    num_turns: int = _help(
        "Turn limit per episode; > 1 builds a rollout tree (needs an environment with transitions).",
        default=1,
    )
    discount: float = _help(
        "Discount gamma between turns: R = r + gamma * V(child) (used, unlike CoMLRL's).", default=1.0
    )
    max_children: int | None = _help(
        "Multi-turn budget: joint actions per node that get a child next turn (a seeded sample of those not done); "
        "None = all.",
        default=None,
    )
    max_nodes: int = _help(
        "Multi-turn budget: most nodes one item's rollout tree may have; checked before training.",
        default=256,
    )
    tree_backup: str = _help(
        "Value of a node for its parent's return: 'mean' (expected value under the sampling policy) or 'max' "
        "(best continuation).",
        default="mean",
    )
    early_termination_threshold: float | None = _help(
        "Stop expanding a node whose mean team reward exceeds this (CoMLRL's field; None = off, the default; "
        "episodes end when the environment says done). Its episodes end there (no future reward): use it with "
        "rewards paid once, at success (docs/multiturn.md).",
        default=None,
    )
    external_prompt_passthrough: bool = _help(
        "CoMLRL external_transition: use its prompts as they are instead of passing them through the formatters.",
        default=False,
    )
    reward_call: str = _help(
        "How a reward function is called: 'per_joint_action' (CoMLRL: once per joint action with one-element "
        "lists) or 'batched' (once per step with every joint action of every item; faster).",
        default="per_joint_action",
    )
    reward_weights: list[float] | None = _help(
        "Weights of several reward functions (default: all 1.0).", default=None
    )
    success_threshold: float | None = _help(
        "A joint action counts as a success when its (weighted) reward >= this; None = report no success rate "
        "unless the environment does.",
        default=None,
    )

    # --- advantages and loss
    baseline: str = _help(
        "Advantage baseline: group_mean (MAGRPO), none (MAREINFORCE), leave_one_out (MARLOO), greedy (MAReMax), group_max.",
        default="group_mean",
    )
    scale: str = _help(
        "Divide advantages by the std of the returns of the 'group', the 'batch', the same 'turn' (multi-turn: "
        "per agent and per turn across the batch), or 'none'.",
        default="group",
    )
    loss_aggregation: str = _help(
        "grpo (mean per sequence, then over sequences), dr_grpo (sum / (sequences x max_new_tokens)), "
        "dapo (mean over all tokens of the batch).",
        default="dapo",
    )
    mask_truncated_completions: bool = _help(
        "Leave completions that reach max_new_tokens without EOS out of the policy loss (DAPO's overlong "
        "filtering; TRL's field of the same name). They keep their rewards, so they still count in their "
        "group's baseline and scale; only their own tokens are not scored (nor counted in dapo's token mean).",
        default=False,
    )
    num_iterations: int = _help("Updates per collected batch; > 1 uses the PPO clipped ratio.", default=1)
    epsilon: float = _help("PPO lower clip: ratio >= 1 - epsilon.", default=0.2)
    epsilon_high: float | None = _help(
        "PPO upper clip: ratio <= 1 + epsilon_high (None = epsilon).", default=None
    )
    beta: float = _help(
        "Weight of the KL penalty to a frozen copy of each initial agent (0 = no reference model); where it "
        "applies: kl_penalty.",
        default=0.0,
    )
    kl_penalty: str = _help(
        "Where beta x KL goes: 'loss' (k3 per token, added to the policy loss, as GRPO and TRL) or 'reward' (k1 of "
        "each whole completion, log pi(y) - log pi_ref(y), subtracted from its agent's reward before returns and "
        "advantages, as PPO-RLHF).",
        default="loss",
    )

    agent_settings: list[dict[str, Any]] | None = _help(
        "Per-agent overrides, one dict per agent ({} keeps the shared values), of: "
        + ", ".join(AGENT_SETTINGS)
        + ". E.g. a helper that answers briefly and a main agent that samples cooler: "
        "[{max_new_tokens: 64}, {temperature: 0.7}]. Each agent's log-probs use its own temperature.",
        default=None,
    )

    # --- which agents learn
    frozen_agents: list[int] = _help(
        "Indices of agents that act but never update (a fixed partner or opponent); the others learn.",
        default_factory=list,
    )
    alternate_agents_every: int = _help(
        "k > 0: the learning agents take turns, one at a time for k steps each (agent order), while the others keep "
        "their weights (less non-stationarity for the learner); 0 = every learning agent updates every step.",
        default=0,
    )

    # --- evaluation, logging, output
    eval_interval: int = _help(
        "Evaluate every this many steps (0 = only when evaluate() is called).", default=0
    )
    eval_at_end: bool = _help(
        "Also evaluate at the last training step when eval_interval does not (needs eval_dataset): the trained "
        "team's eval/ metrics reach every sink and train()'s return. `comarl train` turns it on unless the "
        "config sets it.",
        default=False,
    )
    eval_num_samples: int | None = _help("Items of the eval dataset to evaluate (None = all).", default=None)
    num_generations_eval: int = _help("Completions per agent per item at evaluation.", default=1)
    eval_do_sample: bool = _help("Sample at evaluation instead of greedy decoding.", default=False)
    logging_steps: int = _help("Write metrics every this many steps.", default=1)
    log_completions: int = _help("Sample joint actions written to samples.jsonl per logged step.", default=2)
    output_dir: str | None = _help(
        "Run folder for config, metrics, plot, samples and agents (None = no files).", default=None
    )
    progress_bar: bool = _help("Show a progress bar with the live reward.", default=True)
    report_to: list[str] = _help(
        "Metric sinks besides metrics.jsonl: 'tensorboard' (output_dir/tensorboard), 'wandb' and/or 'trackio'.",
        default_factory=list,
    )
    run_name: str | None = _help(
        "Run name for the sinks (W&B and trackio run name); None = the sink's default.", default=None
    )
    wandb_project: str = _help("W&B project when report_to has 'wandb'.", default="comarl")
    trackio_project: str = _help(
        "trackio project when report_to has 'trackio' (stored locally; `trackio show` opens the dashboard).",
        default="comarl",
    )
    save_steps: int = _help(
        "Write a resumable checkpoint (weights, optimizers, schedulers, RNG streams, step) every this many steps "
        "into output_dir/checkpoints/ (0 = none). Resume with train(resume_from_checkpoint=True).",
        default=0,
    )
    save_total_limit: int = _help("Checkpoints kept in output_dir/checkpoints/ (the newest).", default=2)

    # --- devices and precision
    agent_devices: list[str] | str | None = _help(
        "Device per agent ('cpu', 'cuda:1', ...), one for all, or None = auto (agent i on GPU i mod #GPUs, else CPU; "
        "every agent on the first GPU with share_weights or lora_shared_base, whose agents share one model).",
        default=None,
    )
    agent_parallel: bool = _help(
        "One process per agent under torchrun (rank i trains agent i; completions gathered each turn): agents "
        "generate and update concurrently. Launch with torchrun --nproc-per-node=num_agents. See docs/distributed.md.",
        default=False,
    )
    data_parallel: bool = _help(
        "One process per data shard under torchrun: every process holds the whole team and takes prompts_per_step / "
        "world size of each step's prompts; gradients are summed across processes, so a step equals one process's "
        "step on all the prompts. Every trainer. With agent_parallel=True too: one process per agent and shard "
        "(num_agents x D processes). See docs/distributed.md.",
        default=False,
    )
    shard_optimizer: bool = _help(
        "With data_parallel=True: the D processes that hold copies of a model each keep the AdamW state of 1/D of "
        "its weights and update that share, then send it to the others (ZeRO stage 1, torch's "
        "ZeroRedundancyOptimizer). The same step, with optimizer memory 8 bytes per trained parameter / D.",
        default=False,
    )
    shard_weights: bool = _help(
        "With data_parallel=True: the D processes that hold copies of an agent each keep 1/D of its weights, "
        "gradients and AdamW state (FSDP2, torch's fully_shard, one unit per decoder layer); layers are gathered "
        "for each forward, and whole for each generate call. The same step, with an agent's training memory / D. "
        "Critics and reward models stay whole copies (shard_optimizer shards their AdamW states). See "
        "docs/distributed.md.",
        default=False,
    )
    bf16: bool = _help(
        "bf16 autocast for generation and training forwards (GPU or CPU); weights and AdamW states stay fp32. On CPU "
        "it pays only where the CPU has bf16 instructions (AVX512-BF16, AMX). Per agent through agent_settings "
        "(e.g. a large agent in bf16 beside a small one in fp32); critics with a model of their own follow this one.",
        default=False,
    )
    lora_r: int | None = _help(
        "LoRA rank: train low-rank adapters (peft) on every agent instead of all its weights; the KL reference is "
        "then the agent with its adapters switched off (no copy). None = full fine-tuning. See docs/lora.md.",
        default=None,
    )
    lora_alpha: float = _help(
        "LoRA scaling numerator (the update is scaled by lora_alpha / lora_r).", default=32.0
    )
    lora_target_modules: list[str] | str = _help(
        "Modules that get adapters: 'all-linear' (every linear layer but the LM head) or a list of names.",
        default="all-linear",
    )
    share_weights: bool = _help(
        "One model plays every role: the agents (which must name the same model) are one set of weights with one "
        "optimizer, told apart only by their prompts; each step is one update on the sum of their losses. The "
        "single-model baseline to compare a team of distinct agents with. MAGRPO family and MARLHF only.",
        default=False,
    )
    lora_shared_base: bool = _help(
        "With lora_r: the agents keep their own adapters on ONE shared copy of the base model (they must name the "
        "same model and device): memory for one base instead of one per agent. See docs/lora.md.",
        default=False,
    )
    check_memory: bool = _help(
        "Before loading any weights, estimate each device's static training memory (fp32 weights, gradients, AdamW "
        "states, KL reference) from the models' configs and stop with the numbers and the fixes when it exceeds the "
        "device's free memory. See docs/memory.md.",
        default=True,
    )
    gradient_checkpointing: bool = _help(
        "Recompute activations in the backward pass to save memory.", default=False
    )
    keep_freed_memory: bool = _help(
        "Where an agent trains on the CPU and the C library is glibc: keep the memory that freed tensors leave in the "
        "process for the next step's (malloc's mmap threshold 32 MiB, trim threshold 1 GiB) instead of taking fresh "
        "pages from the OS at every step: ~200 page faults per step instead of 5,000-20,000, a peer-mode step 5-8% "
        "faster, the same peak memory. Process-wide once set. See docs/memory.md.",
        default=True,
    )

    # --- CoMLRL 1.4.3 spellings (mapped onto the fields above)
    num_agents: int | None = _help(
        "Optional; must match the team the trainer is given (CoMLRL field).", default=None
    )
    per_device_train_batch_size: InitVar[int | None] = None
    rollout_buffer_size: InitVar[int | None] = None
    agent_learning_rate: InitVar[float | None] = None
    advantage_mode: InitVar[str | None] = None
    advantage_normalization: InitVar[bool | None] = None
    reference_kl_enabled: InitVar[bool | None] = None
    reference_kl_coef: InitVar[float | None] = None
    parallel_training: InitVar[str | None] = None

    # CoMLRL 1.4.3 fields that comarl does not take: accepted at the values that change nothing here
    # (comlrl_changes_nothing), otherwise refused with what to do instead (comlrl_refused).
    train_batch_size: InitVar[int | None] = None
    eval_batch_size: InitVar[int | None] = None
    reference_devices: InitVar[Any] = None

    def __post_init__(self, *initvars: Any) -> None:
        self.take_comlrl_spellings(dict(zip(comlrl_spellings(type(self)), initvars)))
        if isinstance(self.joint_mode, str):  # anything else is refused by validate(), with the field named
            self.joint_mode = _JOINT_MODE_ALIASES.get(self.joint_mode, self.joint_mode)
        self.validate()

    def take_comlrl_spellings(self, given: dict[str, Any]) -> None:
        """Map the CoMLRL spellings given (``None``: not given) onto the fields; refuse the ones comarl lacks,
        unless their value changes nothing here."""
        for name, value in given.items():
            annotation = str(self.__dataclass_fields__[name].type).removeprefix("InitVar[").removesuffix("]")
            if not _matches(value, annotation):
                raise ConfigError(f"{name}={value!r}: must be {_type_words(annotation)}")
        per_device_train_batch_size = given["per_device_train_batch_size"]
        rollout_buffer_size = given["rollout_buffer_size"]
        batch_sizes = {v for v in (per_device_train_batch_size, rollout_buffer_size) if v is not None}
        if len(batch_sizes) > 1:
            raise ConfigError(
                "per_device_train_batch_size and rollout_buffer_size both set prompts_per_step; give one"
            )
        if batch_sizes:
            self.prompts_per_step = batch_sizes.pop()
        if given["agent_learning_rate"] is not None:
            self.learning_rate = given["agent_learning_rate"]
        advantage_mode, advantage_normalization = given["advantage_mode"], given["advantage_normalization"]
        if advantage_mode is not None:
            if advantage_mode not in _ADVANTAGE_MODES:
                raise ConfigError(
                    f"advantage_mode={advantage_mode!r}: choose one of {list(_ADVANTAGE_MODES)} (or set baseline=)"
                )
            self.baseline = _ADVANTAGE_MODES[advantage_mode]
            if advantage_normalization is None and self.baseline not in CENTRED_BASELINES:
                self.scale = "none"  # raw returns are not scaled (scale='group' would refuse them below)
        if advantage_normalization is not None:
            self.normalize_advantages(advantage_normalization)
        reference_kl_enabled, reference_kl_coef = given["reference_kl_enabled"], given["reference_kl_coef"]
        if reference_kl_enabled is not None:  # CoMLRL's default is off: reference_kl_coef alone does nothing
            self.beta = (
                (reference_kl_coef if reference_kl_coef is not None else 0.1) if reference_kl_enabled else 0.0
            )
            if reference_kl_enabled:  # CoMLRL subtracts the KL from the returns
                self.kl_penalty = "reward"
        parallel_training = given["parallel_training"]
        # CoMLRL's normalize_parallel_training: case and spaces do not matter, 'null' is 'none'
        mode = None if parallel_training is None else parallel_training.strip().lower()
        if mode not in (None, "none", "null", "mp"):
            raise ConfigError(
                f"parallel_training={parallel_training!r}: use 'none' or 'mp' (or set agent_devices=)"
            )
        if mode == "mp" and self.agent_devices is None:  # CoMLRL raises here too
            raise ConfigError(
                f"parallel_training={parallel_training!r} needs agent_devices= (CoMLRL: 'requires explicit "
                "agent_devices'): give one device per agent, e.g. agent_devices=['cuda:0', 'cuda:1'], or remove "
                "parallel_training (comarl then puts agent i on GPU i mod #GPUs)"
            )
        # CoMLRL's evaluate() generates one item at a time whatever eval_batch_size is: no value >= 1 changes it.
        eval_batch_size = given["eval_batch_size"]
        if eval_batch_size is not None and eval_batch_size < 1:
            raise ConfigError(
                f"eval_batch_size={eval_batch_size!r}: must be an integer >= 1 (CoMLRL's check; comarl evaluates "
                "prompts_per_step items per batch whatever its value): remove it"
            )
        refused = self.comlrl_refused()
        for name, value in given.items():
            if value is not None and name in refused and not self.comlrl_changes_nothing(name, value):
                fix = refused[name].format(prompts_per_step=self.prompts_per_step)
                raise ConfigError(f"{name}={value!r}: a CoMLRL field comarl does not take; {fix}")

    @classmethod
    def comlrl_refused(cls) -> dict[str, str]:
        """CoMLRL fields this config refuses (at values that change something): field -> what to do instead."""
        return COMLRL_REFUSED

    def comlrl_changes_nothing(self, name: str, value: Any) -> bool:
        """Whether a refused CoMLRL field's ``value`` gives CoMLRL 1.4.3 the training comarl does (a config copied
        whole from CoMLRL then still loads); the fields it maps onto are already set."""
        if name == "train_batch_size":  # CoMLRL's default: the rollout buffer, one optimizer step per buffer
            return value == self.prompts_per_step
        if name == "reference_devices":  # CoMLRL places reference models only with reference_kl_enabled
            return self.beta == 0
        return name in COMLRL_DEFAULTS_CHANGING_NOTHING and value == COMLRL_DEFAULTS_CHANGING_NOTHING[name]

    def normalize_advantages(self, on: bool) -> None:
        """CoMLRL's ``advantage_normalization``: the MAGRPO family's group scale."""
        self.scale = "group" if on else "none"

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field on its own and the batch arithmetic; raise ConfigError naming the field."""
        if isinstance(self.report_to, str):  # report_to="wandb" / "none", as in transformers
            self.report_to = [] if self.report_to == "none" else [self.report_to]
        check_field_types(self)
        positive = (
            "num_train_epochs",
            "prompts_per_step",
            "num_generations",
            "max_new_tokens",
            "num_iterations",
            "num_turns",
            "logging_steps",
            "num_generations_eval",
            "save_total_limit",
        )
        for name in positive:
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name}={value!r}: must be an integer >= 1")
        for name in (
            "warmup_steps",
            "eval_interval",
            "min_new_tokens",
            "log_completions",
            "save_steps",
            "alternate_agents_every",
        ):
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"{name}={value!r}: must be an integer >= 0")
        for name in ("learning_rate", "temperature"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ConfigError(f"{name}={value!r}: must be a finite number > 0")
        if self.max_grad_norm is not None and not (
            self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)
        ):
            raise ConfigError(
                f"max_grad_norm={self.max_grad_norm!r}: must be a finite number > 0 (or None for no clipping)"
            )
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ConfigError(f"weight_decay={self.weight_decay!r}: must be a finite number >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be in [0, 1)")
        if not (self.adam_epsilon > 0 and math.isfinite(self.adam_epsilon)):
            raise ConfigError(f"adam_epsilon={self.adam_epsilon!r}: must be a finite number > 0")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError(
                f"micro_batch_size={self.micro_batch_size!r}: must be an integer >= 1 (or None for all at once)"
            )
        if self.output_dir == "":
            raise ConfigError("output_dir='': give a folder, or null for no files")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k!r}: must be >= 0 (0 or None = off)")
        if self.eval_num_samples is not None and self.eval_num_samples < 1:
            raise ConfigError(f"eval_num_samples={self.eval_num_samples!r}: must be >= 1 (or None for all)")
        if not (self.lora_alpha > 0 and math.isfinite(self.lora_alpha)):
            raise ConfigError(f"lora_alpha={self.lora_alpha!r}: must be a finite number > 0")
        for name in ("success_threshold", "early_termination_threshold"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{name}={value!r}: must be a finite number (or None)")
        if self.reward_weights is not None and not all(math.isfinite(w) for w in self.reward_weights):
            raise ConfigError(f"reward_weights={self.reward_weights!r}: every weight must be a finite number")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed={self.seed!r}: must be an integer in [0, 2**31 - 1]")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not 0 <= self.discount <= 1:
            raise ConfigError(f"discount={self.discount!r}: must be in [0, 1]")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio={self.warmup_ratio!r}: must be in [0, 1)")
        if self.beta < 0:
            raise ConfigError(f"beta={self.beta!r}: must be >= 0")
        if self.epsilon <= 0 or (self.epsilon_high is not None and self.epsilon_high <= 0):
            raise ConfigError("epsilon and epsilon_high must be > 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(
                f"min_new_tokens={self.min_new_tokens} > max_new_tokens={self.max_new_tokens}: lower min_new_tokens"
            )
        choices = {
            "joint_mode": JOINT_MODES,
            "reward_call": REWARD_CALLS,
            "loss_aggregation": AGGREGATIONS,
            "kl_penalty": KL_PENALTIES,
            "lr_scheduler_type": LR_SCHEDULES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: choose one of {list(allowed)}")
        self.validate_advantage()
        if self.kl_penalty == "reward" and self.beta == 0:
            raise ConfigError("kl_penalty='reward' with beta=0 penalises nothing: set beta > 0 (e.g. 0.05)")
        G = self.num_generations
        completions = self.prompts_per_step * G
        if self.micro_batch_size is not None and completions % self.micro_batch_size:
            raise ConfigError(
                f"micro_batch_size={self.micro_batch_size}: must divide the completions each agent trains on per "
                f"step, prompts_per_step x num_generations = {self.prompts_per_step} x {G} = {completions}"
            )
        unknown = [sink for sink in self.report_to if sink not in ("tensorboard", "wandb", "trackio")]
        if unknown:
            raise ConfigError(
                f"report_to={self.report_to!r}: unknown {unknown}; choose from ['tensorboard', 'wandb', 'trackio']"
            )
        if "tensorboard" in self.report_to and self.output_dir is None:
            raise ConfigError("report_to=['tensorboard'] writes into output_dir/tensorboard; set output_dir=")
        if self.save_steps and self.output_dir is None:
            raise ConfigError(
                f"save_steps={self.save_steps}: checkpoints go into output_dir; set output_dir="
            )
        if self.lora_r is not None and self.lora_r < 1:
            raise ConfigError(
                f"lora_r={self.lora_r!r}: must be an integer >= 1 (or None for full fine-tuning)"
            )
        if self.shard_optimizer and not self.data_parallel:
            raise ConfigError(
                "shard_optimizer=True shares AdamW's state among the copies that data_parallel=True makes; "
                "set data_parallel=True (or shard_optimizer=False)"
            )
        if self.shard_weights and not self.data_parallel:
            raise ConfigError(
                "shard_weights=True splits each agent among the copies that data_parallel=True makes; "
                "set data_parallel=True (or shard_weights=False)"
            )
        if self.shard_weights and (self.share_weights or self.lora_shared_base):
            shared = "share_weights" if self.share_weights else "lora_shared_base"
            raise ConfigError(
                f"shard_weights=True shards each agent's own model; {shared}=True shares one model between agents, "
                "which is not sharded: turn one off (lora_r= alone keeps every agent's trainable state small)"
            )
        if self.share_weights:
            clash = [
                name
                for name, on in (
                    ("lora_shared_base", self.lora_shared_base),
                    ("agent_parallel", self.agent_parallel),
                    ("frozen_agents", bool(self.frozen_agents)),
                    ("alternate_agents_every", bool(self.alternate_agents_every)),
                )
                if on
            ]
            if clash:
                raise ConfigError(
                    f"share_weights=True: every agent is the same model, so {clash[0]} cannot apply; turn one off"
                )
        if self.lora_shared_base and self.lora_r is None:
            raise ConfigError("lora_shared_base=True shares a base between LoRA adapters: set lora_r= too")
        if self.lora_shared_base and self.agent_parallel:
            raise ConfigError(
                "lora_shared_base=True keeps one base in one process; agent_parallel=True gives every agent its own "
                "process (and base): use one of them"
            )
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError(
                f"micro_batch_tokens={self.micro_batch_tokens!r}: must be an integer >= 1 (or None for no budget)"
            )
        if self.max_joint_actions is not None:
            if self.joint_mode != "cross":
                raise ConfigError(
                    "max_joint_actions only applies to joint_mode='cross'; remove it or set joint_mode='cross'"
                )
            if self.max_joint_actions < G:
                raise ConfigError(
                    f"max_joint_actions={self.max_joint_actions}: must be >= num_generations={G} so that every "
                    "completion is in at least one joint action"
                )
        if self.num_agents is not None and self.num_agents < 1:
            raise ConfigError(f"num_agents={self.num_agents}: must be >= 1")
        if self.tree_backup not in ("mean", "max"):
            raise ConfigError(f"tree_backup={self.tree_backup!r}: choose 'mean' or 'max'")
        if self.max_children is not None and self.max_children < 1:
            raise ConfigError(f"max_children={self.max_children}: must be >= 1 (or None for all)")
        if self.max_nodes < 1:
            raise ConfigError(f"max_nodes={self.max_nodes}: must be >= 1")
        for f in dataclasses.fields(self):  # NaN passes every `< 0` check, inf every `> 0` one
            value = getattr(self, f.name)
            if "float" in f.type and isinstance(value, numbers.Real) and not math.isfinite(value):
                raise ConfigError(f"{f.name}={value!r}: must be a finite number")
        self._validate_agent_settings()

    def for_agent(self, i: int) -> MAGRPOConfig:
        """This config with agent ``i``'s ``agent_settings`` applied (the config itself when there are none)."""
        if not self.agent_settings:
            return self
        try:
            return dataclasses.replace(self, **self.agent_settings[i], agent_settings=None)
        except ConfigError as e:
            raise ConfigError(f"agent_settings[{i}]: {e}") from None

    def _validate_agent_settings(self) -> None:
        if self.agent_settings is None:
            return
        for i, settings in enumerate(self.agent_settings):
            unknown = sorted(set(settings) - set(AGENT_SETTINGS))
            if unknown:
                raise ConfigError(
                    f"agent_settings[{i}]: {unknown} cannot be set per agent; choose from {list(AGENT_SETTINGS)}"
                )
            self.for_agent(i)  # each agent's values pass the same checks as the shared ones
        if self.share_weights and any("learning_rate" in d for d in self.agent_settings):
            raise ConfigError(
                "share_weights=True trains one model with one optimizer: set learning_rate, not a learning_rate in "
                "agent_settings"
            )

    def micro_batch_rows(self, rows: int, row_tokens: int) -> int:
        """Rows per forward/backward pass over ``rows`` rows of ``row_tokens`` padded tokens each.

        ``min(micro_batch_size or rows, micro_batch_tokens // row_tokens)``, at least 1.
        """
        size = self.micro_batch_size or rows
        if self.micro_batch_tokens is not None:
            size = min(size, self.micro_batch_tokens // max(row_tokens, 1))
        return max(size, 1)

    def validate_advantage(self) -> None:
        """The advantage fields: a group baseline and scale (the critic trainers override this)."""
        for name, allowed in (("baseline", BASELINES), ("scale", SCALES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: choose one of {list(allowed)}")
        if self.scale != "none" and self.baseline not in CENTRED_BASELINES:
            raise ConfigError(
                f"scale={self.scale!r} with baseline={self.baseline!r}: the scale divides by the spread of the returns, "
                "and a group whose returns are all equal (every sample right, say) would get its advantages divided "
                f"by ~1e-4. Scale a centred baseline {list(CENTRED_BASELINES)}, or set scale='none'. (CoMLRL's "
                "advantage_normalization=True re-standardised the advantage, which for every baseline gives "
                "baseline='group_mean', scale='group': MAGRPO.)"
            )
        G = self.num_generations
        if G < 2 and (self.baseline in CENTRED_BASELINES or self.scale == "group"):
            raise ConfigError(
                f"num_generations={G}: baseline={self.baseline!r} with scale={self.scale!r} compares the samples of a "
                "group and needs num_generations >= 2 (or use baseline='none', scale='none' / 'batch')"
            )

    def check_team(self, num_agents: int, dataset_size: int | None) -> None:
        """Checks that need the team size and dataset length; called before any model loads."""
        if self.num_agents is not None and self.num_agents != num_agents:
            raise ConfigError(
                f"num_agents={self.num_agents} in the config, but the trainer was given {num_agents} agents"
            )
        if self.agent_settings is not None and len(self.agent_settings) != num_agents:
            raise ConfigError(
                f"agent_settings has {len(self.agent_settings)} entries for {num_agents} agents: give one dict per "
                "agent ({} for an agent that keeps the shared values)"
            )
        wrong = [i for i in self.frozen_agents if not isinstance(i, int) or not 0 <= i < num_agents]
        if wrong:
            raise ConfigError(
                f"frozen_agents={self.frozen_agents}: {wrong} are not agent indices 0..{num_agents - 1}"
            )
        if len(set(self.frozen_agents)) >= num_agents:
            raise ConfigError(
                f"frozen_agents={self.frozen_agents} freezes every agent: leave at least one learning"
            )
        if dataset_size is not None and dataset_size < self.prompts_per_step:
            raise ConfigError(
                f"prompts_per_step={self.prompts_per_step} but the training dataset has {dataset_size} items: "
                "lower prompts_per_step or add data"
            )
        if self.joint_mode == "cross" and self.max_joint_actions is None and num_agents > 1:
            joint = self.num_generations**num_agents
            if joint > 4096:
                raise ConfigError(
                    f"joint_mode='cross' evaluates num_generations ** num_agents = {self.num_generations} ** {num_agents} "
                    f"= {joint} joint actions per item: set max_joint_actions to sample a subset"
                )
        nodes = self.tree_nodes(num_agents)
        if nodes > self.max_nodes:
            per_turn = " + ".join(str(self.children_per_node(num_agents) ** t) for t in range(self.num_turns))
            raise ConfigError(
                f"the rollout tree of one item has {per_turn} = {nodes} nodes (num_turns={self.num_turns}, "
                f"{self.children_per_node(num_agents)} children per node) > max_nodes={self.max_nodes}: "
                "set max_children, lower num_turns / num_generations, or raise max_nodes"
            )

    def joint_actions_per_node(self, num_agents: int) -> int:
        """K: joint actions evaluated at every node."""
        if self.joint_mode == "aligned" or num_agents == 1:
            return self.num_generations
        total = self.num_generations**num_agents
        return total if self.max_joint_actions is None else min(total, self.max_joint_actions)

    def children_per_node(self, num_agents: int) -> int:
        K = self.joint_actions_per_node(num_agents)
        return K if self.max_children is None else min(K, self.max_children)

    def tree_nodes(self, num_agents: int) -> int:
        """Most nodes of one item's rollout tree: sum over turns t of children_per_node ** t."""
        C = self.children_per_node(num_agents)
        return sum(C**t for t in range(self.num_turns))

    def steps_per_epoch(self, dataset_size: int) -> int:
        return dataset_size // self.prompts_per_step

    def total_steps(self, dataset_size: int) -> int:
        if self.max_steps > 0:
            return self.max_steps
        return self.steps_per_epoch(dataset_size) * self.num_train_epochs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class MAREINFORCEConfig(MAGRPOConfig):
    """MAREINFORCE: the raw return as the advantage (no baseline, no scaling)."""

    baseline: str = _help("Advantage baseline (MAREINFORCE: none).", default="none")
    scale: str = _help("Advantage scale (MAREINFORCE: none).", default="none")


@dataclass
class MARLOOConfig(MAGRPOConfig):
    """MARLOO: leave-one-out baseline, the mean return of the other G-1 samples."""

    baseline: str = _help("Advantage baseline (MARLOO: leave_one_out).", default="leave_one_out")
    scale: str = _help("Advantage scale (MARLOO: none).", default="none")


@dataclass
class MAReMaxConfig(MAGRPOConfig):
    """MAReMax: baseline = reward of the team's greedy joint action on the same item."""

    baseline: str = _help("Advantage baseline (MAReMax: greedy).", default="greedy")
    scale: str = _help("Advantage scale (MAReMax: none).", default="none")


@dataclass
class ActorCriticConfig(MAGRPOConfig):
    """Settings of the critic family (IAC, MAAC, IPPO, MAPPO): a learned value replaces the group baseline.

    Advantages are TD(lambda) over turns: ``A = G^lambda - V(state)`` per completion (see
    ``docs/actor_critic.md``). Each of ``num_iterations`` epochs splits every agent's completions
    into ``num_mini_batches`` optimizer steps (PPO); the batch arithmetic of MAGRPOConfig holds per
    mini-batch.
    """

    baseline: str = _help(
        "Actor-critic: the critic's value is the baseline; only 'critic'.", default="critic"
    )
    scale: str = _help("Actor-critic: 'none' (use whiten_advantages).", default="none")
    centralized_critic: bool = _help(
        "One critic that reads every agent's observation (MAAC/MAPPO) instead of one per agent (IAC/IPPO).",
        default=False,
    )
    critic_type: str = _help(
        "'v': state value V(s); 'q': joint-action value Q(s, a) with a COMA-style counterfactual baseline "
        "(centralized only; needs joint_mode='cross' over all G^N joint actions).",
        default="v",
    )
    critic_model: str | None = _help(
        "Hub id or path of a separate critic model. None: a value head on each agent's own model (independent), "
        "or a copy of agent 0's model (centralized, which must read text from every agent).",
        default=None,
    )
    critic_learning_rate: float | None = _help(
        "AdamW learning rate of the critic / value head; None = the rate of the agent it serves (its "
        "Agent(learning_rate=), else its agent_settings rate, else learning_rate; the centralized critic: "
        "learning_rate), CoMLRL's IAC fallback.",
        default=1e-4,
    )
    value_coef: float = _help(
        "Weight of the value loss when the value head shares the agent's model (loss = policy + c * value).",
        default=0.5,
    )
    value_clip: float | None = _help(
        "PPO value clipping: V_old + clip(V - V_old, -c, c); None = plain squared error.", default=None
    )
    entropy_coef: float = _help("Weight of the entropy bonus (loss -= c * token entropy).", default=0.0)
    gae_lambda: float = _help(
        "TD(lambda) over turns: 1 = Monte-Carlo returns, 0 = one-step bootstrap r + gamma * V(next).",
        default=1.0,
    )
    num_mini_batches: int = _help(
        "Optimizer steps per epoch: each agent's completions (and the critic's samples) in this many shuffled "
        "mini-batches.",
        default=1,
    )
    whiten_advantages: bool = _help(
        "Normalise each agent's advantages over the batch to mean 0, std 1 (PPO's usual normalisation).",
        default=True,
    )

    # CoMLRL 1.4.3's IAC / MAAC spellings: two map onto the fields above, use_separate_critic is checked against the
    # critic model, the others are refused with the fix.
    value_clip_range: InitVar[float | None] = None
    value_loss_coef: InitVar[float | None] = None
    use_separate_critic: InitVar[bool | None] = None
    critic_devices: InitVar[Any] = None
    critic_value_head_hidden_dim: InitVar[int | None] = None
    value_head_hidden_dim: InitVar[int | None] = None

    def critic_rate(self, agent_rate: float) -> float:
        """The critic's AdamW learning rate: ``critic_learning_rate``, or when None ``agent_rate``, the rate of the
        agent it serves (CoMLRL's IAC fallback; read when the optimizers are built, so a later change of
        ``learning_rate`` is followed)."""
        return agent_rate if self.critic_learning_rate is None else self.critic_learning_rate

    def take_comlrl_spellings(self, given: dict[str, Any]) -> None:
        super().take_comlrl_spellings(given)
        if given["value_clip_range"] is not None:
            self.value_clip = given["value_clip_range"]
        if given["value_loss_coef"] is not None:
            self.value_coef = given["value_loss_coef"]
        separate = given["use_separate_critic"]
        if separate is None:
            return
        # Kept on the config, so that the copy the trainer makes with its critic_model= (dataclasses.replace reads
        # every InitVar back) checks it again, and check_team sees it.
        self.use_separate_critic = separate
        if separate is False and self.centralized_critic:
            raise ConfigError(
                "use_separate_critic=False: the centralized critic (MAAC, MAPPO) is always a model of its own "
                "(critic_model=, default a copy of agent 0's model); remove use_separate_critic"
            )
        if separate is False and self.critic_model is not None:  # CoMLRL raises here too
            raise ConfigError(
                f"use_separate_critic=False with critic_model={self.critic_model!r}: CoMLRL refuses a critic model "
                "then too; remove critic_model= (a value head on each agent's model) or set use_separate_critic=True"
            )

    def check_team(self, num_agents: int, dataset_size: int | None) -> None:
        super().check_team(num_agents, dataset_size)
        # The trainer's critic_model= has reached the config by now; CoMLRL raises without one too.
        if self.use_separate_critic is True and not self.centralized_critic and self.critic_model is None:
            raise ConfigError(
                "use_separate_critic=True but no critic model was given: pass critic_model= to the trainer (as in "
                "CoMLRL) or to the config; without one comarl puts a value head on each agent's model (CoMLRL's "
                "use_separate_critic=False)"
            )

    def normalize_advantages(self, on: bool) -> None:
        """CoMLRL's ``advantage_normalization`` of IAC / MAAC: whitening over the batch."""
        self.whiten_advantages = on

    def validate_advantage(self) -> None:
        if self.share_weights:
            raise ConfigError(
                "share_weights=True is built for the MAGRPO family and MARLHF; the critic trainers keep one model "
                "per agent"
            )
        if self.tree_backup != "mean":
            raise ConfigError(
                f"tree_backup={self.tree_backup!r}: the critic trainers' TD(lambda) targets average a node's joint "
                "actions (the critic estimates the value under the sampling policy); remove tree_backup="
            )
        if self.baseline != "critic":
            raise ConfigError(
                f"baseline={self.baseline!r}: actor-critic trainers use the critic as the baseline; remove baseline= "
                "(or use a MAGRPO-family trainer for group baselines)"
            )
        if self.scale != "none":
            raise ConfigError(
                f"scale={self.scale!r}: actor-critic trainers normalise with whiten_advantages; remove scale="
            )
        if self.critic_type not in ("v", "q"):
            raise ConfigError(f"critic_type={self.critic_type!r}: choose 'v' or 'q'")
        if self.critic_type == "q":
            if not self.centralized_critic:
                raise ConfigError(
                    "critic_type='q' needs centralized_critic=True (the critic reads the joint action)"
                )
            if self.joint_mode != "cross" or self.max_joint_actions is not None:
                raise ConfigError(
                    "critic_type='q' needs joint_mode='cross' without max_joint_actions: the counterfactual baseline "
                    "averages Q over each agent's other answers with the partners' answers fixed"
                )
            if self.num_generations < 2:
                raise ConfigError(
                    "critic_type='q' needs num_generations >= 2 for the counterfactual baseline"
                )
        if not 0 <= self.gae_lambda <= 1:
            raise ConfigError(f"gae_lambda={self.gae_lambda!r}: must be in [0, 1]")
        if self.critic_learning_rate is not None and not self.critic_learning_rate > 0:
            raise ConfigError(f"critic_learning_rate={self.critic_learning_rate!r}: must be > 0 (or None)")
        if not self.value_coef > 0:
            raise ConfigError(f"value_coef={self.value_coef!r}: must be > 0")
        if self.entropy_coef < 0:
            raise ConfigError(f"entropy_coef={self.entropy_coef!r}: must be >= 0")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ConfigError(f"value_clip={self.value_clip!r}: must be > 0 (or None)")
        completions = self.prompts_per_step * self.num_generations
        if self.num_mini_batches < 1:
            raise ConfigError(f"num_mini_batches={self.num_mini_batches!r}: must be an integer >= 1")
        if completions % self.num_mini_batches:
            raise ConfigError(
                f"num_mini_batches={self.num_mini_batches}: must divide the completions each agent trains on per step, "
                f"prompts_per_step x num_generations = {self.prompts_per_step} x {self.num_generations} = {completions}"
            )
        per_mini = completions // self.num_mini_batches
        if self.micro_batch_size is not None and per_mini % self.micro_batch_size:
            raise ConfigError(
                f"micro_batch_size={self.micro_batch_size}: must divide the completions of one mini-batch, "
                f"{completions} / num_mini_batches={self.num_mini_batches} = {per_mini}"
            )


@dataclass
class IACConfig(ActorCriticConfig):
    """IAC: independent actor-critic, one critic per agent from its own observation; one update per batch."""


@dataclass
class MAACConfig(ActorCriticConfig):
    """MAAC: actor-critic with one centralized critic over every agent's observation."""

    centralized_critic: bool = _help("MAAC: one critic over every agent's observation.", default=True)


@dataclass
class IPPOConfig(ActorCriticConfig):
    """IPPO: PPO with independent critics: several clipped epochs over mini-batches, value clipping."""

    num_iterations: int = _help("PPO epochs over each collected batch.", default=4)
    num_mini_batches: int = _help("PPO: optimizer steps per epoch (shuffled mini-batches).", default=2)
    value_clip: float | None = _help("PPO value clipping range (None = off).", default=0.2)
    gae_lambda: float = _help("GAE lambda over turns.", default=0.95)


@dataclass
class MAPPOConfig(IPPOConfig):
    """MAPPO: PPO with one centralized critic over every agent's observation."""

    centralized_critic: bool = _help("MAPPO: one critic over every agent's observation.", default=True)


def _check_preference_fields(config: MAGRPOConfig, candidates: int, trainer: str) -> None:
    """The pair fields shared by MADPO and MARLHF, and the single turn both need."""
    if candidates < 2:
        raise ConfigError(
            f"{trainer}: {candidates} candidates per prompt cannot form a preference pair; use at least 2"
        )
    pairs = config.preference_pairs_per_sample  # type: ignore[attr-defined]
    if pairs is not None and (not isinstance(pairs, int) or pairs < 1):
        raise ConfigError(f"preference_pairs_per_sample={pairs!r}: must be an integer >= 1 (or None for all)")
    if config.pair_selection not in PAIR_SELECTIONS:  # type: ignore[attr-defined]
        raise ConfigError(
            f"pair_selection={config.pair_selection!r}: choose one of {list(PAIR_SELECTIONS)}"  # type: ignore[attr-defined]
        )
    if config.num_turns != 1:
        raise ConfigError(
            f"num_turns={config.num_turns}: {trainer} compares whole single-turn joint answers; set num_turns=1"
        )


@dataclass
class MADPOConfig(MAGRPOConfig):
    """MADPO: multi-agent DPO on the team's preferences between joint answers.

    Each agent samples ``num_generations`` candidates per prompt; joint candidate ``k`` is every
    agent's k-th answer, scored by the task reward. Pairs (chosen, rejected) with a higher / lower
    team reward train every agent with DPO on the team's joint margin (see ``docs/preference.md``).
    """

    num_generations: int = _help(
        "Candidates each agent samples per prompt (CoMLRL: preference_num_candidates); joint candidate k is every "
        "agent's k-th answer.",
        default=8,
    )
    preference_pairs_per_sample: int | None = _help(
        "Most preference pairs kept per prompt (pair_selection 'reward_gap' or 'random'; None = all).",
        default=16,
    )
    pair_selection: str = _help(
        "Which pairs of a prompt to keep among those with a higher and a lower team reward: 'reward_gap' (largest "
        "gaps first), 'random' (seeded), or 'all'.",
        default="reward_gap",
    )
    dpo_beta: float = _help("DPO's beta: the strength of the pull towards the reference policy.", default=0.1)
    dpo_reference: str = _help(
        "'initial': standard DPO against each agent's initial policy (no copy when candidates_from='initial' or "
        "with LoRA); 'none': reference-free, as CoMLRL's MADPO.",
        default="initial",
    )
    dpo_margin: str = _help(
        "'joint': each agent follows the gradient of the team's loss -log sigmoid(sum of every agent's margin); "
        "'own': each agent its own DPO loss -log sigmoid(own margin) on the team's preferences.",
        default="joint",
    )
    candidates_from: str = _help(
        "'initial': candidates sampled once, before training, from the initial team, for the whole dataset "
        "(CoMLRL's MADPO); 'current': sampled every step from the current team (online, iterative DPO).",
        default="initial",
    )
    baseline: str = _help("MADPO uses no advantages; only 'none'.", default="none")
    scale: str = _help("MADPO uses no advantages; only 'none'.", default="none")
    preference_num_candidates: InitVar[int | None] = None
    # CoMLRL's MADPO fields comarl refuses unless they change nothing (COMLRL_REFUSED says what to do instead).
    collaboration_mode: InitVar[str | None] = None
    use_environment_step: InitVar[bool | None] = None
    environment_steps_per_pair: InitVar[int | None] = None

    def take_comlrl_spellings(self, given: dict[str, Any]) -> None:
        # CoMLRL's MADPOConfig inherits MAGRPO's advantage fields and its MADPOTrainer never reads them: their
        # defaults (which a config copied from CoMLRL carries) change nothing; another value asks for what neither does.
        for name, default in (("advantage_mode", "mean"), ("advantage_normalization", True)):
            value = given[name]
            if value is not None and (value != default or type(value) is not type(default)):
                raise ConfigError(
                    f"{name}={value!r}: MADPO learns from preference pairs, not advantages (CoMLRL's MADPO ignores "
                    f"{name} too; its default {default!r} is accepted); remove it"
                )
        super().take_comlrl_spellings({**given, "advantage_mode": None, "advantage_normalization": None})
        if given["preference_num_candidates"] is not None:
            self.num_generations = given["preference_num_candidates"]

    def validate_advantage(self) -> None:
        if self.share_weights:
            raise ConfigError(
                "share_weights=True is built for the MAGRPO family and MARLHF; MADPO keeps one model per agent"
            )
        if self.baseline != "none" or self.scale != "none":
            raise ConfigError(
                "MADPO learns from preference pairs, not advantages: remove baseline= and scale="
            )
        if self.beta != 0 or self.kl_penalty != "loss":
            raise ConfigError(
                f"beta={self.beta}, kl_penalty={self.kl_penalty!r}: MADPO's pull towards the reference is dpo_beta; "
                "set beta=0 and leave kl_penalty (and set dpo_beta=)"
            )
        _check_preference_fields(self, self.num_generations, "MADPO")
        if self.mask_truncated_completions:
            raise ConfigError(
                "mask_truncated_completions=True masks a policy-gradient loss; MADPO's DPO loss compares whole "
                "answers: remove it (or give truncated answers a low reward)"
            )
        if self.joint_mode != "aligned":
            raise ConfigError(
                f"joint_mode={self.joint_mode!r}: MADPO's joint candidate k is every agent's k-th answer; "
                "set joint_mode='aligned'"
            )
        if not self.dpo_beta > 0:
            raise ConfigError(f"dpo_beta={self.dpo_beta!r}: must be > 0")
        for name, allowed in (
            ("dpo_reference", ("initial", "none")),
            ("dpo_margin", ("joint", "own")),
            ("candidates_from", ("initial", "current")),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: choose one of {list(allowed)}")


@dataclass
class MARLHFConfig(MAGRPOConfig):
    """MARLHF: a joint reward model learned from the team's preference pairs, then MAGRPO on its scores.

    Stage 1 (once, before training): every agent samples ``preference_num_candidates`` answers per
    training prompt; joint candidates are scored by the task reward and paired as in MADPO; a reward
    model (a backbone with a scalar head reading every agent's prompt and answer) is fit with the
    Bradley-Terry loss. Stage 2: the MAGRPO loop, with the reward model's score as the team reward;
    the task reward is still logged (``reward/task``) and used by evaluation.
    """

    preference_num_candidates: int = _help(
        "Stage 1: answers each agent samples per training prompt for the reward model's pairs.", default=8
    )
    preference_pairs_per_sample: int | None = _help(
        "Stage 1: most preference pairs kept per prompt (None = all).", default=16
    )
    pair_selection: str = _help(
        "Stage 1: 'reward_gap' (largest gaps first), 'random' (seeded) or 'all'.", default="reward_gap"
    )
    reward_model: str | None = _help(
        "Hub id or path of the reward model's backbone; None = agent 0's model (its starting weights).",
        default=None,
    )
    reward_learning_rate: float = _help("AdamW learning rate of the reward model.", default=1e-5)
    reward_num_train_epochs: int = _help("Passes of the reward model over the preference pairs.", default=1)
    reward_train_batch_size: int = _help("Preference pairs per reward-model optimizer step.", default=8)
    reward_refit_steps: int = _help(
        "0: fit the reward model once, on the initial team's candidates (CoMLRL's MARLHF). k > 0: also refit it every "
        "k steps on fresh candidates of the current team (iterative MARLHF), so that it keeps judging the answers "
        "the team now gives instead of being exploited outside the data it saw.",
        default=0,
    )
    fit_reward_model: bool = _help(
        "Fit the reward model before the first step (stage 1); False uses reward_model= as it is (e.g. the "
        "reward_model/ folder an earlier MARLHF run saved).",
        default=True,
    )
    # CoMLRL's name for reward_model.
    reward_model_name: InitVar[str | None] = None
    # CoMLRL fields comarl refuses unless they change nothing (comlrl_refused says what to do instead).
    rl_algorithm: InitVar[str | None] = None
    reward_model_device: InitVar[Any] = None
    reward_max_length: InitVar[int | None] = None
    reward_freeze_backbone: InitVar[bool | None] = None
    dpo_beta: InitVar[float | None] = None
    collaboration_mode: InitVar[str | None] = None
    use_environment_step: InitVar[bool | None] = None
    environment_steps_per_pair: InitVar[int | None] = None
    # CoMLRL's MARLHF reads these only with rl_algorithm='iac' / 'maac'.
    critic_model_name: InitVar[str | None] = None
    critic_learning_rate: InitVar[float | None] = None
    critic_devices: InitVar[Any] = None
    use_separate_critic: InitVar[bool | None] = None
    critic_type: InitVar[str | None] = None
    value_loss_coef: InitVar[float | None] = None
    value_clip_range: InitVar[float | None] = None
    critic_value_head_hidden_dim: InitVar[int | None] = None
    value_head_hidden_dim: InitVar[int | None] = None

    def take_comlrl_spellings(self, given: dict[str, Any]) -> None:
        name = given["reward_model_name"]
        if name is not None and self.reward_model not in (None, name):
            raise ConfigError(
                f"reward_model_name={name!r} and reward_model={self.reward_model!r} both name the reward model's "
                "backbone; give one (reward_model= is comarl's name)"
            )
        if name is not None:
            self.reward_model = name
        super().take_comlrl_spellings(given)

    @classmethod
    def comlrl_refused(cls) -> dict[str, str]:
        return {**COMLRL_REFUSED, **MARLHF_COMLRL_REFUSED}

    def comlrl_changes_nothing(self, name: str, value: Any) -> bool:
        if name == "rl_algorithm":  # CoMLRL's default; its MARLHF then sets advantage_mode='mean'
            return value.strip().lower() == "magrpo" and self.baseline == "group_mean"
        # CoMLRL's default 'cuda:0' is where comarl's automatic placement puts agent 0
        if name == "reward_model_device":
            devices = self.agent_devices
            first = "auto" if devices is None else devices if isinstance(devices, str) else devices[0]
            # 'auto' puts agent 0 on the first GPU, and a bare 'cuda' is the first GPU too
            same = {"auto": "cuda:0", "cuda": "cuda:0"}
            return same.get(str(value), str(value)) == same.get(str(first), str(first))
        return super().comlrl_changes_nothing(name, value)

    def validate_advantage(self) -> None:
        super().validate_advantage()
        _check_preference_fields(self, self.preference_num_candidates, "MARLHF")
        if not self.reward_learning_rate > 0:
            raise ConfigError(f"reward_learning_rate={self.reward_learning_rate!r}: must be > 0")
        if self.reward_refit_steps < 0:
            raise ConfigError(f"reward_refit_steps={self.reward_refit_steps!r}: must be an integer >= 0")
        for name in ("reward_num_train_epochs", "reward_train_batch_size"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name}={value!r}: must be an integer >= 1")
        # Without a fitted head every score would be 0, every advantage 0, and nothing would learn.
        if not self.fit_reward_model and not (
            self.reward_model is not None and (Path(self.reward_model) / VALUE_HEAD_FILE).is_file()
        ):
            where = (
                "reward_model is not set"
                if self.reward_model is None
                else f"{self.reward_model} has no {VALUE_HEAD_FILE}"
            )
            raise ConfigError(
                f"fit_reward_model=False scores with reward_model= as it is, but {where}: point reward_model= at a "
                "fitted one (the reward_model/ folder a MARLHF run saves) or set fit_reward_model=True"
            )


def config_help(config_cls: type) -> dict[str, str]:
    """Field name -> help line, for docs and the CLI."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(config_cls)}


# ---------------------------------------------------------------------------- run specs (YAML / CLI)

TRAINERS = ("magrpo", "mareinforce", "marloo", "maremax", "iac", "maac", "ippo", "mappo", "madpo", "marlhf")
TASKS = ("demo", "function", "code", "writing")


@dataclass
class RunSpec:
    """What `comarl train CONFIG.yaml` runs: a team, a task and the trainer's args."""

    trainer: str = "magrpo"
    task: str = "demo"
    model: str | None = None
    agents: list[str] | None = None
    num_agents: int | None = None  # default: len(agents), or 2 with one model
    dataset: str | None = None
    eval_dataset: str | None = None
    reward_funcs: list[str] | None = None
    prompt_column: str = "prompt"
    source: str | None = None  # code / writing: the data source (default: humaneval / local)
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ConfigError(f"trainer={self.trainer!r}: choose one of {list(TRAINERS)}")
        if self.task not in TASKS:
            raise ConfigError(
                f"task={self.task!r}: choose 'demo', 'function' (a dataset plus reward_funcs), 'code' (HumanEval "
                "helper + main) or 'writing'"
            )
        if self.task in ("code", "writing") and not self.model and not self.agents:
            raise ConfigError(f"task={self.task!r} needs model: (a hub id or path) or agents: [...]")
        if self.task == "function":
            if not self.dataset:
                raise ConfigError("task='function' needs dataset: a .json/.jsonl path or a datasets hub name")
            if not self.reward_funcs:
                raise ConfigError("task='function' needs reward_funcs: a list of 'module:function' names")
            if not self.model and not self.agents:
                raise ConfigError("task='function' needs model: (a hub id or path) or agents: [...]")
        if not isinstance(self.args, dict):
            raise ConfigError(
                f"args={self.args!r}: must be a mapping of {self.trainer} fields, e.g. {{max_steps: 10}}"
            )
        unknown = sorted(set(self.args) - trainer_fields(self.trainer))
        if unknown:
            raise ConfigError(
                f"args.{unknown[0]}: unknown {self.trainer} field (see `comarl fields {self.trainer}`)"
            )
        check_field_types(self)
        if self.num_agents is not None and self.num_agents < 1:
            raise ConfigError(f"num_agents={self.num_agents}: must be an integer >= 1")
        if self.agents and self.num_agents is not None and self.num_agents != len(self.agents):
            raise ConfigError(
                f"num_agents={self.num_agents}, but agents: names {len(self.agents)} models; remove num_agents (the "
                "team is one agent per entry of agents:) or make them agree"
            )
        self._refuse_unused_fields()
        if self.num_agents is None:
            self.num_agents = len(self.agents) if self.agents else 2
        config_class(self.trainer)(**self.args)  # validates args now, with the field names in the errors

    def _refuse_unused_fields(self) -> None:
        """A field the task does not read is a mistake, not something to ignore silently."""
        if self.task == "demo":
            if self.num_agents not in (None, 2):
                raise ConfigError(
                    f"num_agents={self.num_agents}: task='demo' builds its own two agents; remove it"
                )
            unused = ("model", "agents", "dataset", "eval_dataset", "reward_funcs", "source")
            instead = "the demo builds its own team and game; remove it (or choose another task:)"
        elif self.task == "function":
            unused, instead = ("source",), "its data comes from dataset: and eval_dataset:; remove it"
        else:
            unused = ("dataset", "eval_dataset", "reward_funcs")
            instead = "its data comes from source: and its rewards are the task's; remove it"
        given = [name for name in unused if getattr(self, name) is not None]
        if self.task != "function" and self.prompt_column != "prompt":
            given.append("prompt_column")
        if given:
            name = given[0]
            raise ConfigError(
                f"{name}={getattr(self, name)!r}: task={self.task!r} does not use it; {instead}"
            )

    def trainer_args(self) -> MAGRPOConfig:
        """The trainer's config; a run from the CLI evaluates its trained team at the end unless told not to."""
        return config_class(self.trainer)(**{"eval_at_end": True, **self.args})


def config_class(trainer: str) -> type[MAGRPOConfig]:
    return {
        "magrpo": MAGRPOConfig,
        "mareinforce": MAREINFORCEConfig,
        "marloo": MARLOOConfig,
        "maremax": MAReMaxConfig,
        "iac": IACConfig,
        "maac": MAACConfig,
        "ippo": IPPOConfig,
        "mappo": MAPPOConfig,
        "madpo": MADPOConfig,
        "marlhf": MARLHFConfig,
    }[trainer]


def trainer_fields(trainer: str) -> set[str]:
    """The names a ``trainer``'s args take: its config's fields and the CoMLRL spellings mapped onto them."""
    cls = config_class(trainer)
    return {f.name for f in dataclasses.fields(cls)} | set(comlrl_spellings(cls))


def comlrl_spellings(cls: type) -> list[str]:
    """A config class's CoMLRL spellings (its ``InitVar`` pseudo-fields), in the order ``__post_init__`` gets them."""
    return [name for name, f in cls.__dataclass_fields__.items() if str(f.type).startswith("InitVar")]


# CoMLRL fields comarl does not take: what to do instead. Where a value changes nothing here it is accepted
# (MAGRPOConfig.comlrl_changes_nothing); the fix says which.
COMLRL_REFUSED = {
    "train_batch_size": "comarl takes one optimizer step per collected batch of prompts_per_step={prompts_per_step} "
    "items (train_batch_size equal to it, CoMLRL's default, is accepted); micro_batch_size and micro_batch_tokens "
    "bound memory. Remove it",
    "reference_devices": "the KL reference lives on its agent's device (agent_devices); remove it (it is accepted "
    "without a KL penalty, where CoMLRL ignores it)",
    "critic_devices": "a critic lives on its agent's device (the centralized one on agent 0's); remove it",
    "critic_value_head_hidden_dim": "comarl's value heads are linear; remove it",
    "value_head_hidden_dim": "comarl's value heads are linear; remove it",
    "collaboration_mode": "comarl's agents each answer their own prompt (CoMLRL's 'decentralized', accepted); there "
    "is no mode where one model writes every agent's answer. Remove it",
    "use_environment_step": "it only sets the step CoMLRL logs at; comarl logs by optimizer step (CoMLRL's default "
    "True is accepted). Remove it",
    "environment_steps_per_pair": "it only sets the step CoMLRL logs at; comarl logs by optimizer step (CoMLRL's "
    "default 2 is accepted). Remove it",
}
_MARLHF_CRITIC_FIX = (
    "CoMLRL's MARLHF reads it only with rl_algorithm='iac' / 'maac', and comarl's MARLHF trains with the MAGRPO "
    "family (CoMLRL's default value, which changes nothing there, is accepted); for a critic trainer, wrap its env in "
    "RewardModelEnv (docs/preference.md). Remove it"
)
MARLHF_COMLRL_REFUSED = {
    "rl_algorithm": "MARLHF trains with the MAGRPO family, as CoMLRL's default 'magrpo' (accepted with "
    "baseline='group_mean', the advantage_mode CoMLRL then sets); set baseline= / scale= for another, and for a "
    "critic trainer wrap its env in RewardModelEnv (docs/preference.md). Remove it",
    "reward_model_device": "the reward model lives on agent 0's device (agent_devices; a value naming that device is "
    "accepted); remove it",
    "reward_max_length": "comarl's reward model reads the whole joint text, untruncated (CoMLRL's default None); "
    "remove it",
    "reward_freeze_backbone": "comarl fits the whole reward model, backbone included (CoMLRL's default False, "
    "accepted); remove it",
    "dpo_beta": "MARLHF has no DPO loss (CoMLRL's MARLHF never reads it; its default 0.1 is accepted); remove it",
    **dict.fromkeys(
        (
            "critic_model_name",
            "critic_learning_rate",
            "critic_devices",
            "use_separate_critic",
            "critic_type",
            "value_loss_coef",
            "value_clip_range",
            "critic_value_head_hidden_dim",
            "value_head_hidden_dim",
        ),
        _MARLHF_CRITIC_FIX,
    ),
}
# CoMLRL defaults of refused fields that change nothing here: a config copied whole from CoMLRL carries them.
COMLRL_DEFAULTS_CHANGING_NOTHING: dict[str, Any] = {
    "collaboration_mode": "decentralized",
    "use_environment_step": True,
    "environment_steps_per_pair": 2,
    # MARLHF (CoMLRL's MARLHFConfig defaults; the critic ones are read only by its IAC / MAAC backends)
    "reward_freeze_backbone": False,
    "dpo_beta": 0.1,
    "use_separate_critic": True,
    "critic_type": "v",
    "value_loss_coef": 0.6,
    "value_clip_range": 0.2,
}


def yaml_load(text: str) -> Any:
    """``yaml.safe_load`` that also reads ``1e-3`` as a float (YAML 1.2; PyYAML's 1.1 reads it as a string) and
    refuses a key given twice in one mapping (PyYAML keeps the last); ConfigError with the line if it fails."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            # Checked before merge keys (<<) are flattened: an explicit key may override a merged one.
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    if key_node.value in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                        )
                    seen.add(key_node.value)
            return super().construct_mapping(node, deep)

    float_pattern = re.compile(
        r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
        r"|\.(?:inf|Inf|INF))$|^\.(?:nan|NaN|NAN)$"
    )
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", float_pattern, list("-+0123456789."))
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"not valid YAML: {where}{getattr(exc, 'problem', None) or exc}") from None


def parse_value(text: str) -> Any:
    """Parse an override value as YAML (so 1e-3, true, [1, 2] and null mean what they look like)."""
    return yaml_load(text) if text != "" else ""


def _parse_override(item: str) -> tuple[str, Any]:
    """``--set key=value`` -> (key, value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, text = item.split("=", 1)
    try:
        return key.strip(), parse_value(text)
    except ConfigError as exc:
        raise ConfigError(f"--set {item}: {exc}") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` overrides; ``args.<field>`` or a bare trainer field reaches the trainer args."""
    spec_fields = {f.name for f in dataclasses.fields(RunSpec)}
    parsed = [_parse_override(item) for item in overrides]
    # The trainer (a --set trainer= included) decides which fields the other overrides may name.
    trainer = next(
        (value for key, value in reversed(parsed) if key == "trainer"), raw.get("trainer", "magrpo")
    )
    if trainer not in TRAINERS:
        raise ConfigError(f"trainer={trainer!r}: choose one of {list(TRAINERS)}")
    arg_fields = trainer_fields(trainer)
    args = raw.get("args")
    if args is not None and not isinstance(args, dict):
        raise ConfigError(f"args={args!r}: must be a mapping of {trainer} fields, e.g. {{max_steps: 10}}")
    raw = {**raw, "args": dict(args or {})}
    for key, value in parsed:
        name = key.removeprefix("args.")
        if key.startswith("args.") or (key not in spec_fields and name in arg_fields):
            if name not in arg_fields:
                raise ConfigError(
                    f"--set {key}: unknown trainer field {name!r} (see `comarl fields {trainer}`)"
                )
            raw["args"][name] = value
        elif key in spec_fields:
            raw[key] = value
        else:
            raise ConfigError(
                f"--set {key}: unknown key; use a run field {sorted(spec_fields)} or a trainer field"
            )
    return raw


def load_run_spec(path: str | Path | None, overrides: list[str] | None = None) -> RunSpec:
    """Read a YAML run spec (or start from defaults), apply overrides and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            problem = "is a folder" if Path(path).is_dir() else "does not exist"
            raise ConfigError(f"{path} {problem}; give a YAML run spec (see examples/)")
        try:
            loaded = yaml_load(Path(path).read_text())
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read it as text ({exc}); give a YAML run spec") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of run fields")
        raw = loaded
    raw = apply_overrides(raw, overrides or [])
    known = {f.name for f in dataclasses.fields(RunSpec)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown run field {unknown[0]!r}; known fields: {sorted(known)}")
    try:
        return RunSpec(**raw)
    except TypeError as exc:  # e.g. an unknown trainer field inside args
        raise ConfigError(str(exc).replace("__init__()", "args")) from None
