"""MAGRPO and its family (MAREINFORCE, MARLOO, MAReMax): one loop, different advantage settings.

One training step, top to bottom (``training_step``):

1. take ``prompts_per_step`` dataset items;
2. every agent samples ``num_generations`` completions per item in one batched generate;
3. joint actions (aligned or cross) go to the environment, which returns rewards;
4. each completion gets a return (mean reward of the joint actions containing it);
5. advantages per group of G samples (baseline + scale from the config);
6. each agent takes ``num_iterations`` optimizer steps on its own completions:
   token log-probs from one batched forward per micro-batch, clipped policy loss, optional KL.
"""

from __future__ import annotations

import copy
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from comarl.agents import (
    Agent,
    SharedBaseAdapter,
    Team,
    WithoutAdapters,
    add_lora,
    checkpointing_on,
    has_adapters,
    is_adapter_folder,
    set_activation_checkpointing,
    shared_base_lora,
)
from comarl.algorithms import (
    aggregate_loss,
    clipped_surrogate,
    group_advantages,
    kl_k3,
    sequence_kl_k1,
    truncated_completions,
)
from comarl.config import ConfigError, MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig
from comarl.distributed import (
    DataParallel,
    Processes,
    RemoteAgent,
    launch,
    save_own_model,
    sum_and_clip_gradients,
    whole_state_dict,
)
from comarl.engines import Generation, HFEngine, SamplingParams, bf16_autocast, on_device, stream_seed
from comarl.envs import Env, FunctionEnv, comlrl_transition
from comarl.memory import (
    ModelMemory,
    ModelSize,
    canonical_device,
    check_fits,
    device_identity,
    free_memory,
    keep_freed_memory,
    model_memory,
    model_size,
    sharing_devices,
    summary,
)
from comarl.rollout import (
    Rollout,
    collect,
    episode_answers,
    greedy_returns,
    independent_episodes,
    with_rewards,
)


def learned_batches(
    advantages: torch.Tensor, reference: torch.Tensor | None, rows: int
) -> list[torch.Tensor]:
    """The rows of the policy loss's micro-batches (``rows`` at most in each), in order: every row whose advantage
    is not 0, and every row where a KL term is in the loss (``reference`` log-probs given).

    A row of advantage 0 adds 0 to the clipped surrogate, to its gradient and to the clip fraction at any ratio
    (``-min(r * 0, clip(r) * 0)``), and the loss's normalisers count it from the whole batch, so leaving it out
    changes nothing but the time: every sample of a group that scored alike (pass/fail rewards often do) has
    advantage 0 under a group baseline."""
    kept = torch.arange(advantages.shape[0])
    if reference is None:
        kept = kept[(advantages != 0).reshape(advantages.shape[0], -1).any(dim=1).cpu()]
    return [kept[s : s + rows] for s in range(0, len(kept), rows)]


class MAGRPOTrainer:
    """Multi-agent GRPO: group-relative advantages per agent from a joint (or per-agent) reward.

    A team is given as ``model=`` (a hub id, a path or a model object) with ``num_agents``
    copies, as ``agents=[...]`` (different models, strings or objects or ``Agent``), or as
    ``team=Team([...])``. The task is ``reward_func`` + ``formatters`` (wrapped in a
    ``FunctionEnv``) or an ``env=``. ``num_agents=1`` is single-agent GRPO.
    """

    config_class: type[MAGRPOConfig] = MAGRPOConfig

    def __init__(
        self,
        model: Any = None,
        num_agents: int | None = None,
        tokenizer: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        reward_func: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
        formatters: Callable[[Any], Any] | Sequence[Callable[[Any], Any]] | None = None,
        args: MAGRPOConfig | None = None,
        *,
        agents: Sequence[Any] | None = None,
        agent_model: Any = None,
        team: Team | None = None,
        env: Env | None = None,
        reward_processor: Callable[[float], float] | None = None,
        model_config: dict[str, Any] | None = None,
        transition: Callable[..., Any] | None = None,
        external_transition: Callable[..., Any] | None = None,
        wandb_config: dict[str, Any] | None = None,
        eval_logger: Callable[..., Any] | None = None,
        eval_aggregator: Callable[..., Any] | None = None,
    ) -> None:
        args = self.config_class() if args is None else args
        if not isinstance(args, self.config_class):
            raise ConfigError(
                f"{type(self).__name__} needs args={self.config_class.__name__}(...), got {type(args).__name__}"
            )
        # CoMLRL's wandb_config (project, entity, name, dir, tags, ...) turns on the W&B sink with those settings
        # (in this trainer's copy of the config: the caller's may configure another trainer).
        self.wandb_config = dict(wandb_config) if wandb_config is not None else None
        if self.wandb_config is not None and "wandb" not in args.report_to:
            args = replace(args, report_to=[*args.report_to, "wandb"])
        self.args = args
        # CoMLRL's evaluation hooks, used together: see evaluate().
        if (eval_logger is None) != (eval_aggregator is None):
            raise ConfigError(
                "give eval_logger= and eval_aggregator= together (CoMLRL's evaluation hooks), or neither"
            )
        self.eval_logger, self.eval_aggregator = eval_logger, eval_aggregator

        # Everything that can be checked without loading a model is checked first.
        _check_model_config(model_config)
        # CoMLRL's IAC / MAAC take the team size from args.num_agents alone.
        sources = _team_sources(
            model,
            agent_model,
            agents,
            team,
            num_agents if num_agents is not None else args.num_agents,
            shared=args.share_weights or args.lora_shared_base,
        )
        n = len(sources)
        if isinstance(tokenizer, (list, tuple)) and len(tokenizer) != n:
            raise ConfigError(
                f"tokenizer= holds {len(tokenizer)} tokenizers for {n} agents: give one per agent (None where an agent "
                "brings its own), or one for the team"
            )
        for i, source in enumerate(sources):
            if isinstance(source, Agent) and (_agent_tokenizer(tokenizer, i) is not None or model_config):
                raise ConfigError(
                    f"agent {i} is a built Agent, which holds its tokenizer and model: tokenizer= and model_config= "
                    "apply to models loaded from a hub id or path and would be ignored; give them to "
                    "Agent.from_pretrained(...) (a tokenizer= list may hold None for the built agents)"
                )
            if not isinstance(source, (str, Path, Agent)) and _agent_tokenizer(tokenizer, i) is None:
                raise ConfigError(
                    f"agent {i} is a model object ({type(source).__name__}) without a tokenizer: give tokenizer= (one "
                    "for the team, or a list with one per agent); only a hub id or a path loads its own"
                )
        if train_dataset is None:
            raise ConfigError(
                f"{type(self).__name__}: train_dataset is required (a datasets.Dataset or a list of dicts)"
            )
        for name, data in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if data is not None and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
                # An epoch's permutation and the step count need the size; evaluation picks items by index.
                raise ConfigError(
                    f"{name}: {type(data).__name__} has no length or indexing (a streaming dataset?); give a "
                    "datasets.Dataset (load_dataset without streaming=True) or a list of dicts"
                )
        args.check_team(n, len(train_dataset))
        # Each agent's view of the config: the shared values with its agent_settings applied.
        self.agent_args = [args.for_agent(i) for i in range(n)]
        own_formatters = [s.formatter if isinstance(s, Agent) else None for s in sources]
        if any(f is not None for f in own_formatters):
            if formatters is not None or env is not None:
                raise ConfigError(
                    "Agent(formatter=) and formatters=/env= both say how the agents read an item: give the "
                    "formatters in one place (an env= makes its own prompts)"
                )
            formatters = own_formatters  # an agent without one reads item["prompt"]
        if env is None:
            if reward_func is None:
                raise ConfigError(f"{type(self).__name__}: give reward_func= (with formatters=) or env=")
            if transition is not None and external_transition is not None:
                raise ConfigError("give transition= or external_transition= (CoMLRL's), not both")
            if external_transition is not None:
                transition = comlrl_transition(
                    external_transition, n, formatters, args.external_prompt_passthrough
                )
            if args.num_turns > 1 and transition is None:
                raise ConfigError(
                    f"num_turns={args.num_turns} needs transition= (or CoMLRL's external_transition=) to turn each "
                    "joint answer into the next prompts, or an env= with transitions"
                )
            env = FunctionEnv(
                reward_func,
                formatters,
                n,
                args.reward_weights,
                args.reward_call,
                reward_processor,
                args.success_threshold,
                transition,
                args.num_turns,
            )
        elif any(x is not None for x in (reward_func, formatters, transition, external_transition)):
            raise ConfigError("give either env= or reward_func=/formatters=/transition=, not both")
        if getattr(env, "num_agents", n) != n:
            raise ConfigError(f"env.num_agents={env.num_agents} but the team has {n} agents")
        if getattr(env, "num_turns", None) not in (None, args.num_turns):
            raise ConfigError(
                f"env.num_turns={env.num_turns} but args.num_turns={args.num_turns}: set the trainer's num_turns to "
                "the environment's turn limit"
            )
        # task_env scores evaluations; env is what training steps in (MARLHF swaps in a learned reward).
        self.env = self.task_env = env
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.num_agents = n

        set_seed(args.seed)
        devices = _agent_devices(args.agent_devices, n, args.share_weights or args.lora_shared_base)
        # Agent parallelism: this process loads and trains one agent; the others are RemoteAgents here. Data
        # parallelism: every process holds the whole team (with agent parallelism too: its agent) and takes a shard
        # of each step's prompts. Both together: a grid, one process per agent and shard.
        self.parallel, self.data, self.processes = launch(
            n,
            args.agent_parallel,
            args.data_parallel,
            # where the agents are: a team of objects stays where it was loaded
            [str(a.device) for a in team.agents] if team is not None else devices,
            shard_weights=args.shard_weights,
        )
        self.local = [self.parallel.rank] if self.parallel is not None else list(range(n))
        if self.processes is not None and self.processes.rank > 0:
            # Agents sample from their own generators (below); the processes' global torch streams differ too, so
            # that no other random numbers are shared between agents or shards.
            torch.manual_seed(args.seed + self.processes.rank)
        # This process's data shard (0 without data parallelism): the random streams below are per shard.
        shard = self.data.rank if self.data is not None else 0
        if shard > 0:
            # Python's and NumPy's streams, which environments may draw from, differ between data shards (their
            # items are different episodes) but not between the processes of one episode (agent_parallel), which
            # must step their copies of the environment alike.
            set_seed_python_numpy(args.seed + 1000 * shard)
        if self.parallel is not None:
            devices[self.parallel.rank] = self.parallel.device(devices)
        if self.data is not None:
            if args.prompts_per_step % self.data.world_size:
                raise ConfigError(
                    f"data_parallel=True: prompts_per_step={args.prompts_per_step} must be a multiple of the "
                    f"{self.data.world_size} data shards (each takes an equal share)"
                )
            devices = self.data.device(devices)
        members = list(team.agents) if team is not None else sources
        # Before any weights load: a team that cannot fit stops here, with the numbers; one that fits is told
        # its numbers when training starts.
        self.memory_summary: str | None = None
        if args.check_memory:
            self.memory_summary = self._check_memory(members, devices)
        if team is not None and team.share_weights != args.share_weights:
            raise ConfigError(
                f"team=Team(..., share_weights={team.share_weights}) but share_weights={args.share_weights} in "
                f"the config: set both to {team.share_weights} (share_weights=True: one model, one optimizer, one "
                "update on the sum of the agents' losses)"
            )
        if args.lora_shared_base:
            self.team = Team(_shared_base_agents(members, tokenizer, devices, model_config, args))
        elif args.share_weights and team is not None:
            self.team = team  # its agents hold one model object (checked by Team)
        elif args.share_weights:
            first = _load_agent(
                _one_model(members, devices, "share_weights"), tokenizer, 0, devices[0], model_config
            )
            others = [
                Agent(first.model, _tokenizer(tokenizer, i, first), source=first.source) for i in range(1, n)
            ]
            self.team = Team([first, *others], share_weights=True)
        else:
            self.team = Team(
                [
                    (
                        _load_agent(src, tokenizer, i, devices[i], model_config)
                        if i in self.local
                        else _remote_agent(src, tokenizer, i, model_config)
                    )
                    for i, src in enumerate(members)
                ]
            )
        for i in self.local:
            agent = self.team[i]
            if args.lora_r is not None and not has_adapters(agent.model):
                # Adapters start from the agent's own seed: the same whichever process builds them.
                with torch.random.fork_rng():
                    torch.manual_seed(args.seed + 100 + i)
                    agent.model = add_lora(
                        agent.model, args.lora_r, args.lora_alpha, args.lora_target_modules
                    )
                if args.share_weights:  # one model, one set of adapters for every role
                    for other in self.team:
                        other.model = agent.model
            if args.gradient_checkpointing:
                set_activation_checkpointing(agent.model, True)
            agent.model.train()
            # train() seeds each item's draws (see _batches); a training_step called without seeds draws from the
            # agent's own stream, seeded by its index (the same in one process or one per agent), per data shard.
            agent.generator = torch.Generator(agent.device).manual_seed(args.seed + 200 + i + 1000 * shard)
        for i, agent in enumerate(self.team):
            agent.bf16 = self.agent_args[i].bf16  # generation and scoring in the agent's precision
        self.engine = HFEngine()
        distinct = {str(self.team[i].device) for i in self.local}
        if args.keep_freed_memory and any(self.team[i].device.type == "cpu" for i in self.local):
            keep_freed_memory()  # a CPU step's tensors then reuse the last step's pages (docs/benchmarks.md)
        # Agents on separate accelerators generate and update concurrently; on one device they take turns.
        self.pool = (
            ThreadPoolExecutor(max_workers=n)
            if self.parallel is None and n > 1 and len(distinct) == n and "cpu" not in distinct
            else None
        )
        self.total_steps = args.total_steps(len(train_dataset))
        if args.share_weights:  # one model: one optimizer, one schedule, one reference, held by every agent
            optimizer = self._optimizer(0)
            self.optimizers = [optimizer] * n
            self.schedulers = [self._schedule(optimizer, self.total_steps)] * n
            self.references = [_reference(self.team[0].model)] * n if self._keeps_reference() else None
        else:
            self.references = (
                [
                    _reference(a.model) if i in self.local and i not in args.frozen_agents else None
                    for i, a in enumerate(self.team)
                ]
                if self._keeps_reference()
                else None
            )
            if args.shard_weights:  # before the optimizers: they hold the shards
                for i in self.local:
                    self.data.shard_model(self.team[i].model)
                    reference = self.references[i] if self.references is not None else None
                    # a frozen copy is sharded too (LoRA's reference is the model itself)
                    if isinstance(reference, torch.nn.Module):
                        self.data.shard_model(reference, frozen=True)
            self.optimizers = [self._optimizer(i) if i in self.local else None for i in range(n)]
            self.schedulers = [
                self._schedule(opt, self.training_steps_of(i)) if opt is not None else None
                for i, opt in enumerate(self.optimizers)
            ]
        # Joint-action subsets and max_children picks of a training_step called without seeds: a stream per data
        # shard (equal within an episode's processes).
        self.joint_generator = torch.Generator().manual_seed(args.seed + 1 + 1000 * shard)
        self.step = 0
        self._step_indices: list[int] = []  # the dataset indices of the step train() is taking (see _batches)

    def _keeps_reference(self) -> bool:
        """Whether each learning agent keeps a reference policy (the KL term's): a frozen copy, or itself without
        its LoRA adapters."""
        return self.args.beta > 0

    def _check_memory(self, members: Sequence[Any], devices: Sequence[str]) -> str | None:
        """Stop with the numbers when the models that all processes plan on one of this process's devices need
        more than it has free; else the plan's one-line summary (None when nothing is planned). Under torchrun
        every process stops when any does (one that went on would wait for the others forever)."""
        plan = self._memory_plan(members, devices)
        if self.processes is None:
            # One memory under two names ('cpu' and 'cpu:0', 'cuda' and 'cuda:0') holds both names' models.
            plan = [replace(m, device=canonical_device(m.device)) for m in plan]
            free = {d: free_memory(d) for d in {m.device for m in plan}}
            check_fits(plan, free, self._memory_fixes(members, devices))
            return summary(plan, free) if plan else None
        # Processes that share a device (a GPU, the host's memory) check it together.
        mine = [(device_identity(m.device), m) for m in plan]
        plan = sharing_devices(self.processes.gather(mine), self.processes.rank)
        free = {d: free_memory(d) for d in {m.device for m in plan}}
        failed = None
        try:
            check_fits(plan, free, self._memory_fixes(members, devices))
        except ConfigError as error:
            failed = str(error)
        messages = self.processes.gather(failed)
        if failed is not None:
            raise ConfigError(failed)
        for rank, message in enumerate(messages):
            if message is not None:
                raise ConfigError(f"process {rank}: {message}")
        return summary(plan, free) if plan else None

    def _memory_plan(self, members: Sequence[Any], devices: Sequence[str]) -> list[ModelMemory]:
        """The static memory of the agents this process loads from a hub id or path (objects are already loaded)."""
        a = self.args
        lora = (a.lora_r, a.lora_alpha, a.lora_target_modules) if a.lora_r is not None else None
        sizes: dict[str, ModelSize | None] = {}
        plan = []
        for i in self.local:
            if not isinstance(members[i], (str, Path)):
                continue
            source = str(members[i])
            if source not in sizes:  # agents naming one model count it once
                sizes[source] = model_size(source, lora)
            size = sizes[source]
            if size is None:
                continue
            # With a shared base or one shared model the first agent holds the weights.
            shares = (a.lora_shared_base or a.share_weights) and i != self.local[0]
            if a.share_weights and shares:
                continue  # one model in every role: its first user holds all of it
            trains = i not in a.frozen_agents
            plan.append(
                model_memory(
                    f"agent {i}",
                    devices[i],
                    size,
                    owns_weights=not shares,
                    trains=trains,
                    reference=self._keeps_reference() and lora is None and trains,
                    optimizer_shards=1 if a.shard_weights else self._optimizer_shards(self.data),
                    weight_shards=self.data.world_size if a.shard_weights else 1,
                    # one model in every role: its first user holds the casts if any role runs in bf16
                    bf16=any(x.bf16 for x in self.agent_args) if a.share_weights else self.agent_args[i].bf16,
                    generates_on_cpu=torch.device(devices[i]).type == "cpu",
                )
            )
        return plan

    def _optimizer_group(self, copies: Processes | None) -> Processes | None:
        """The processes that share the AdamW state of a model that ``copies`` hold copies of: ``copies`` with
        ``shard_optimizer``, else None (each process keeps all of it)."""
        return copies if self.args.shard_optimizer else None

    def _optimizer_shards(self, copies: Processes | None) -> int:
        """How many processes share the AdamW state of a model that ``copies`` hold copies of (1: not shared)."""
        group = self._optimizer_group(copies)
        return group.world_size if group is not None else 1

    def _memory_fixes(self, members: Sequence[Any], devices: Sequence[str]) -> list[str]:
        """What would shrink the plan, for the error of check_fits."""
        a = self.args
        fixes = []
        if a.lora_r is None:
            fixes.append("lora_r=16 (train LoRA adapters: no gradients or AdamW states for the base weights)")
        if self._keeps_reference() and a.lora_r is None:
            fixes.append(self._reference_fix())
        # Only fixes the config accepts with the settings it has: one model on one device cannot be spread out,
        # and a shared model is not sharded.
        one_model = a.lora_shared_base or a.share_weights
        if len(set(devices)) < len(devices) and torch.cuda.device_count() > 1 and not one_model:
            fixes.append("agent_devices=[one device per agent], or agent_parallel=True under torchrun")
        if self.data is not None and self.data.world_size > 1 and not a.shard_weights:
            D = self.data.world_size
            if not one_model:
                fixes.append(
                    f"shard_weights=True (each of the {D} data shards keeps 1/{D} of every agent's weights, "
                    "gradients and AdamW states)"
                )
            if not a.shard_optimizer:
                fixes.append(
                    f"shard_optimizer=True (each of the {D} data shards keeps 1/{D} of every AdamW state)"
                )
        named = {str(m) for m in members if isinstance(m, (str, Path))}
        if len(members) > 1 and len(named) == 1 and not (one_model or a.agent_parallel or a.shard_weights):
            fixes.append("lora_shared_base=True with lora_r= (one copy of the base for every agent)")
        return fixes

    def _reference_fix(self) -> str:
        """The setting that drops the KL reference copies (named in the out-of-memory error)."""
        return f"beta=0 (no KL reference copy; now beta={self.args.beta})"

    # ------------------------------------------------------------------ training
    def train(self, resume_from_checkpoint: str | Path | bool | None = None) -> dict[str, float]:
        """Run ``total_steps`` training steps; log, evaluate, checkpoint (``save_steps``), and save the agents into
        ``output_dir``. Returns the last step's metrics (with its ``eval/`` ones when it evaluated).

        ``resume_from_checkpoint``: a checkpoint folder, or True for the newest in ``output_dir/checkpoints``;
        the run then continues from that step exactly as if it had never stopped (same weights, optimizer
        moments, schedules, random streams and data order).
        """
        from comarl.checkpoint import (
            completed_checkpoints,
            load_checkpoint,
            remove_checkpoints,
            save_checkpoint,
            truncate_log,
        )
        from comarl.tracking import METRICS_FILE, SAMPLES_FILE, RunLogger, write_run_config

        args = self.args
        run_dir = Path(args.output_dir) if args.output_dir else None
        # Under agent parallelism every process trains and evaluates; process 0 logs and writes the run folder.
        writer = self.processes is None or self.processes.rank == 0
        if resume_from_checkpoint is True:
            found = completed_checkpoints(run_dir) if run_dir is not None else []
            if not found:
                raise ConfigError(
                    f"resume_from_checkpoint=True: no finished checkpoint in {run_dir}/checkpoints (output_dir="
                    f"{args.output_dir!r}); pass a checkpoint folder or start without resuming"
                )
            resume_from_checkpoint = found[-1]
        if resume_from_checkpoint:
            self.step = load_checkpoint(self, resume_from_checkpoint)
        if run_dir is not None and writer:
            # A run replaces an earlier run's checkpoints past its step at once (all of them when it does not resume):
            # one that stopped before its first save would otherwise leave them for a later resume to pick up.
            remove_checkpoints(run_dir, past=self.step)
            # Rows a stopped run wrote after its checkpoint are redone; a new run into a folder that holds an
            # earlier run's logs replaces them (step 0), as it replaces that run's checkpoints past its own.
            for name in (METRICS_FILE, SAMPLES_FILE):
                truncate_log(run_dir / name, self.step)
            run_dir.mkdir(parents=True, exist_ok=True)
            agents = [
                {"source": a.source, "role": a.role, "learning_rate": a.learning_rate} for a in self.team
            ]
            write_run_config(
                run_dir, {"trainer": type(self).__name__, "agents": agents, "args": args.to_dict()}
            )
        last: dict[str, float] = {}
        with RunLogger(
            run_dir if writer else None,
            total_steps=self.total_steps,
            console=args.progress_bar and writer,
            description=type(self).__name__.removesuffix("Trainer"),
            sinks=self._sinks(run_dir, self.step) if writer else (),
        ) as logger:
            if self.memory_summary is not None and args.progress_bar and writer:
                logger.print(self.memory_summary)
            for items, seeds in self._batches():
                self.step += 1
                try:
                    metrics, samples = self.training_step(items, seeds)
                except torch.OutOfMemoryError as error:
                    raise torch.OutOfMemoryError(f"{error}\n{OUT_OF_MEMORY_FIXES}") from error
                last = metrics
                logger.advance(self.step)
                if self.step % args.logging_steps == 0 or self.step == self.total_steps:
                    logger.log(self.step, metrics)
                    logger.log_samples(self.step, samples)
                evaluates = (args.eval_interval and self.step % args.eval_interval == 0) or (
                    args.eval_at_end and self.step == self.total_steps
                )
                if evaluates and self.eval_dataset is not None:
                    evaluation = self.evaluate()
                    logger.log(self.step, evaluation)
                    last = {**metrics, **evaluation}
                if args.save_steps and self.step % args.save_steps == 0 and run_dir is not None:
                    save_checkpoint(self, run_dir, args.save_total_limit)
        if run_dir is not None:
            if writer:
                # agent_2/ of an earlier three-agent team in this folder is not one of this team's agents.
                own = {f"agent_{i}" for i in range(self.num_agents)}
                for stale in (run_dir / "agents").glob("agent_*"):
                    if stale.name not in own:
                        shutil.rmtree(stale, ignore_errors=True)
            self.save_model(run_dir / "agents")
            if self.processes is not None:
                # Every process writes its own agents: none returns (and none reads run_dir/agents) before all have.
                self.processes.barrier()
        return last

    def training_step(
        self, items: Sequence[Any], seeds: Sequence[int] | None = None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Collect one batch of joint experience and update every agent once (``num_iterations`` steps).

        ``seeds``, one per item, fix each item's draws (``train()`` passes them, see ``_batches``); None: the agents'
        own streams."""
        args = self.args
        t0 = time.perf_counter()
        rollout = self._collect(items, seeds)
        generate_seconds = rollout.generate_seconds
        greedy = None
        if args.baseline == "greedy":
            # ReMax baseline: each agent's return when the team plays greedily from each node, [nodes, N].
            baselines, seconds = greedy_returns(
                self.env,
                self.team.agents,
                rollout,
                engine=self.engine,
                params=self._sampling(do_sample=False),
                num_turns=args.num_turns,
                discount=args.discount,
                early_termination_threshold=args.early_termination_threshold,
                pool=self.pool,
                parallel=self.parallel,
                shards=self._weight_shards(),
            )
            generate_seconds += seconds
            greedy = [baselines[:, i] for i in range(self.num_agents)]
        t1 = time.perf_counter()
        metrics = rollout_metrics(rollout, self.data)  # the task's rewards
        task_rewards = rollout.rewards  # what samples.jsonl shows, as the metrics: not less the KL penalty
        if args.kl_penalty == "reward" and self.references is not None:
            rollout = self._penalised(rollout, metrics)
        advantages = []
        learning = self.learning_agents()
        for i in range(self.num_agents):
            local, zero = self._advantages(
                rollout.returns[i], None if greedy is None else greedy[i], rollout.depth
            )
            advantages.append(local)
            if i in learning:
                # A completion with advantage 0 teaches nothing (all G samples of its group scored the same): at 1.0
                # the policy loss and its gradient are 0, which is the usual reason a run "does not learn".
                metrics[f"agent_{i}/zero_advantage_fraction"] = zero

        def update(group: list[int]) -> dict[int, dict[str, float]]:
            gens = {i: rollout.generations[i] for i in group}
            return self.update_agents(group, gens, {i: advantages[i] for i in group})

        # Agents sharing one model (share_weights) update together, on the sum of their losses; others each on its own.
        if args.share_weights:
            results = [update(learning)] if learning else []
        else:
            results = self.each_agent(lambda i: update([i]), learning)
        for updated in results:
            for i, stats in updated.items():
                metrics.update({f"agent_{i}/{k}": v for k, v in stats.items()})
        # every process reports every agent's update metrics
        metrics.update(self._merged({k: v for k, v in metrics.items() if k.startswith("agent_")}))
        t2 = time.perf_counter()
        completions = self._step_completions(rollout)
        metrics.update(
            {
                "time/generate": generate_seconds,
                "time/environment": t1 - t0 - generate_seconds,
                "time/update": t2 - t1,
                "time/step": t2 - t0,
                "completions_per_s": completions / (t2 - t0),
            }
        )
        return metrics, self._samples(items, rollout, advantages, task_rewards)

    def _penalised(self, rollout: Rollout, metrics: dict[str, float]) -> Rollout:
        """``rollout`` with each trained agent's rewards less ``beta x KL`` of the completion it played
        (``kl_penalty='reward'``) and its returns recomputed from them: ``KL = log pi_i(y) - log ref_i(y)`` over
        the tokens of y (:func:`sequence_kl_k1`), from the agent's weights that sampled y. Every process ends with
        every agent's penalties; ``metrics`` gets ``agent_i/kl_penalty``, the mean penalty per completion."""
        args, nodes = self.args, len(rollout.depth)
        kl: list[torch.Tensor | None] = [None] * self.num_agents
        for i in self.local:
            if self.references[i] is None:  # a frozen agent is its own reference
                continue
            gen = rollout.generations[i]
            M = gen.completion_ids.shape[0]
            micro = self.agent_args[i].micro_batch_rows(
                M, gen.prompt_ids.shape[1] + gen.completion_ids.shape[1]
            )
            batches = [slice(s, s + micro) for s in range(0, M, micro)]
            logp = self._logprobs(i, gen, batches)
            ref = self._logprobs(i, gen, batches, self.references[i])
            kl[i] = sequence_kl_k1(logp, ref, gen.completion_mask.to(logp.device)).cpu().view(nodes, -1)
        if self.parallel is not None:  # agent i's process scored agent i
            parts = self.parallel.gather(kl)
            kl = [parts[i][i] for i in range(self.num_agents)]
        penalty = torch.zeros_like(rollout.rewards)
        sums = {}
        for i, values in enumerate(kl):
            if values is not None:
                penalty[:, :, i] = args.beta * values.gather(1, rollout.joint_index[:, :, i])
                sums[f"agent_{i}/kl_penalty"] = (args.beta * float(values.sum()), values.numel())
        if self.data is not None:  # the whole batch's mean
            sums = {k: tuple(map(sum, zip(*(part[k] for part in self.data.gather(sums))))) for k in sums}
        metrics.update({k: total / count for k, (total, count) in sums.items()})
        return with_rewards(rollout, rollout.rewards - penalty, args.discount, args.tree_backup)

    def _advantages(
        self, returns: torch.Tensor, greedy: torch.Tensor | None, depth: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """One agent's advantages per completion (flat) of this process, and the fraction of the whole batch's
        advantages that are 0 (|A| < 1e-6). Under data parallelism they are computed on every process's returns, so
        batch-wide statistics (``scale="batch"`` / ``"turn"``) stay batch-wide, and this process keeps its own rows."""
        args = self.args
        if self.data is None:
            everything = group_advantages(returns, args.baseline, args.scale, greedy, turns=depth).flatten()
            return everything, float((everything.abs() < 1e-6).float().mean())
        parts = self.data.gather((returns, greedy, depth))
        everything = group_advantages(
            torch.cat([p[0] for p in parts]),
            args.baseline,
            args.scale,
            None if greedy is None else torch.cat([p[1] for p in parts]),
            turns=torch.cat([p[2] for p in parts]),
        ).flatten()
        start = sum(p[0].numel() for p in parts[: self.data.rank])
        zero = float((everything.abs() < 1e-6).float().mean())
        return everything[start : start + returns.numel()], zero

    def update_agent(self, i: int, gen: Generation, advantages: torch.Tensor) -> dict[str, float]:
        """``num_iterations`` optimizer steps of agent ``i`` on its completions; returns its metrics."""
        return self.update_agents([i], {i: gen}, {i: advantages})[i]

    def update_agents(
        self, agents: Sequence[int], gens: dict[int, Generation], advantages: dict[int, torch.Tensor]
    ) -> dict[int, dict[str, float]]:
        """``num_iterations`` optimizer steps on the sum of the losses of ``agents``, which share one model and
        optimizer (``share_weights``; a single agent otherwise): every agent's loss is normalised over its own
        completions, their gradients add up, and the shared weights take one step. Returns each agent's metrics."""
        args = self.args
        prepared, sizes = {}, {}
        for i in agents:
            agent, gen = self.team[i], gens[i]
            M = gen.completion_ids.shape[0]
            micro = self.agent_args[i].micro_batch_rows(
                M, gen.prompt_ids.shape[1] + gen.completion_ids.shape[1]
            )
            batches = [slice(s, s + micro) for s in range(0, M, micro)]
            # Reference and behaviour log-probs only when the loss needs them; the behaviour ones of its rows alone.
            refs = self.references if args.kl_penalty == "loss" else None  # 'reward': already in the returns
            ref = self._logprobs(i, gen, batches, refs[i]) if refs is not None else None
            adv = advantages[i].to(agent.device)
            learned = learned_batches(adv, ref, micro)
            old = self._behaviour_logprobs(i, gen, learned) if args.num_iterations > 1 else None
            cut = truncated_completions(gen.completion_ids, gen.completion_mask, agent.eos_token_ids)
            scored = self.loss_mask(i, gen, cut)
            # The loss is normalised over the whole batch: every process's completions under data parallelism.
            size = (M, gen.num_tokens, float(adv.abs().sum()), int(scored.sum()), int(cut.sum()))
            sizes[i] = size if self.data is None else tuple(map(sum, zip(*self.data.gather(size))))
            prepared[i] = (learned, old, ref, adv, scored, sizes[i][0], sizes[i][3])
        for _ in range(args.num_iterations):
            # metrics of the last iteration
            totals = {i: self._backward(i, gens[i], *prepared[i]) for i in agents}
            grad_norm, lr = self._apply_gradients(agents[0])
        if self.data is not None:  # each process holds its part of the batch-normalised sums: add them up
            parts = self.data.gather(totals)
            totals = {i: {k: sum(part[i][k] for part in parts) for k in t} for i, t in totals.items()}
        return {
            i: {
                **totals[i],
                "grad_norm": grad_norm,
                "lr": lr,
                "completion_length": sizes[i][1] / sizes[i][0],
                "advantage_abs": sizes[i][2] / sizes[i][0],
                "truncated_fraction": sizes[i][4] / sizes[i][0],
            }
            for i in agents
        }

    def loss_mask(self, i: int, gen: Generation, truncated: torch.Tensor) -> torch.Tensor:
        """The tokens of ``gen`` that agent ``i``'s policy loss scores: its completion mask, less the rows
        ``truncated`` (cut by ``max_new_tokens``, ``truncated_completions``) when ``mask_truncated_completions``."""
        if not self.agent_args[i].mask_truncated_completions:
            return gen.completion_mask
        return gen.completion_mask * (~truncated).unsqueeze(1).to(gen.completion_mask.dtype)

    def _apply_gradients(self, i: int) -> tuple[float, float]:
        """Agent ``i``'s optimizer step on the gradients its backward passes left (summed over the processes under
        data parallelism, then clipped), and a schedule step; returns the gradient norm before clipping and the
        learning rate the step used."""
        optimizer = self.optimizers[i]
        params = [p for p in self.team[i].model.parameters() if p.requires_grad]
        # The batch's gradient: the sum of every process's part under data parallelism.
        grad_norm = sum_and_clip_gradients(params, self.data, self.args.max_grad_norm)
        lr = optimizer.param_groups[0]["lr"]  # after the schedule's step it would be the next update's
        optimizer.step()
        self.schedulers[i].step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr

    def _backward(
        self,
        i: int,
        gen: Generation,
        batches: list[torch.Tensor],
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        advantages: torch.Tensor,
        scored: torch.Tensor,
        M: int,
        num_tokens: int,
    ) -> dict[str, float]:
        """Back-propagate agent ``i``'s clipped policy loss (+ KL), one micro-batch at a time (``batches``: their
        rows, :func:`learned_batches`), over the tokens ``scored`` (``loss_mask``); ``M`` completions and
        ``num_tokens`` scored tokens in the whole batch are the loss's normalisers."""
        args, agent = self.agent_args[i], self.team[i]
        totals = {"loss": 0.0, "clip_fraction": 0.0} | ({} if ref is None else {"kl": 0.0})
        # No row to learn from (learned_batches): one row at weight 0 still gives every weight its zero gradient, so
        # that AdamW steps as it would on the whole batch (its moments decay, the weights move by their momentum).
        for sl, real in self._padded(i, batches, filler=slice(0, 1)) or [(slice(0, 1), False)]:
            mask = scored[sl]
            with self._autocast(i):
                logp = agent.completion_logprobs(
                    gen.prompt_ids[sl],
                    gen.prompt_mask[sl],
                    gen.completion_ids[sl],
                    gen.completion_mask[sl],
                    args.temperature,
                )
            behaviour = logp.detach() if old is None else old[sl]
            per_token, clipped = clipped_surrogate(
                logp, behaviour, advantages[sl], args.epsilon, args.epsilon_high, mask
            )
            if ref is not None:
                kl = kl_k3(logp, ref[sl], mask)
                per_token = per_token + args.beta * kl
                if real:
                    totals["kl"] += float((kl.detach() * mask).sum()) / max(num_tokens, 1)
            loss = aggregate_loss(per_token, mask, args.loss_aggregation, M, num_tokens, args.max_new_tokens)
            if not real:  # another shard's extra micro-batch: its collectives, no gradient
                (0.0 * loss).backward()
                continue
            loss.backward()
            totals["loss"] += float(loss.detach())
            totals["clip_fraction"] += float((clipped * mask).sum()) / max(num_tokens, 1)
        return totals

    def each_agent(self, work: Callable[[int], Any], agents: Sequence[int]) -> list[Any]:
        """``[work(i) for i in agents]`` (agent i's update): at the same time when the agents have accelerators of
        their own (``self.pool``, which their generate calls share), each with its agent's device current; one after
        another otherwise. Never at the same time under data parallelism, whose collectives must run in one order on
        every process."""
        if self.pool is None or self.data is not None or len(agents) < 2:
            return [work(i) for i in agents]

        def on_its_device(i: int) -> Any:
            with on_device(self.team[i].device):
                return work(i)

        return list(self.pool.map(on_its_device, agents))

    def learning_agents(self) -> list[int]:
        """The agents this process updates at the current step (:meth:`learners_at`)."""
        return [i for i in self.learners_at(self.step) if i in self.local]

    def learners_at(self, step: int) -> list[int]:
        """The agents that update at training step ``step`` (from 1): every agent but the frozen ones, and with
        ``alternate_agents_every = k`` only the learner whose turn it is (turns of k steps, agent order)."""
        args = self.args
        learners = [i for i in range(self.num_agents) if i not in args.frozen_agents]
        if args.alternate_agents_every:
            learners = [learners[((step - 1) // args.alternate_agents_every) % len(learners)]]
        return learners

    # ------------------------------------------------------------------ evaluation and saving
    @torch.no_grad()
    def evaluate(
        self, dataset: Any = None, *, num_generations: int | None = None, do_sample: bool | None = None
    ) -> dict[str, float]:
        """Mean reward, success rate and reward components on ``dataset`` (default: the eval dataset).

        Greedy unless ``do_sample`` (default ``eval_do_sample``); ``num_generations`` completions per
        agent per item (default ``num_generations_eval``), joined aligned. Multi-turn: ``num_generations``
        independent episodes per item, one answer per agent per turn. Sampling draws from streams fixed by
        ``seed`` and each item's index (not the agents' own streams): every evaluation of a run draws the same
        random numbers, at any batch size, and evaluating never changes what training samples.

        With CoMLRL's hooks (``eval_logger=`` and ``eval_aggregator=`` given to the trainer), also
        ``eval_logger(agent_completions_turns=, batch_items=, prompts=)`` over every evaluated episode
        (``agent_completions_turns[i][e][t]``: agent i's answer at turn t of episode e; ``prompts[e]``:
        the item's ``"prompt"``), then ``eval_aggregator(its result, num_turns=)``, whose keys are
        returned under ``eval/``.
        """
        args = self.args
        dataset = self.eval_dataset if dataset is None else dataset
        if dataset is None:
            raise ConfigError(
                "evaluate() needs a dataset: pass eval_dataset= to the trainer or evaluate(dataset)"
            )
        if len(dataset) == 0:
            raise ConfigError("evaluate(dataset): the dataset is empty")
        G = args.num_generations_eval if num_generations is None else num_generations
        if isinstance(G, bool) or not isinstance(G, int) or G < 1:
            raise ConfigError(f"evaluate(num_generations={G!r}): must be an integer >= 1")
        count = len(dataset) if args.eval_num_samples is None else min(args.eval_num_samples, len(dataset))
        params = self._sampling(do_sample=args.eval_do_sample if do_sample is None else do_sample)
        # Data shards split the items, as training splits a step's prompts: item j's draws are its own (below), so
        # the split changes no number. Processes holding shares of the weights (shard_weights) evaluate every
        # item together instead: each generate call gathers the layers from all of them.
        D, shard = (
            (1, 0) if self.data is None or args.shard_weights else (self.data.world_size, self.data.rank)
        )
        mine, per_call = list(range(count))[shard::D], max(args.prompts_per_step // D, 1)
        parts: list[dict[str, torch.Tensor]] = []  # rollout_values of each batch
        # (index, item, answers[turn][agent]) of every episode, for the CoMLRL hooks
        episodes: list[tuple[int, Any, list[list[str]]]] = []
        for start in range(0, len(mine), per_call):
            indices = mine[start : start + per_call]
            items = [dataset[j] for j in indices]
            # Item j's draws come from streams fixed by the seed and j alone: the same at every evaluation (a
            # change between two is the weights', not the luck's), at any batch size and in any shard.
            seeds = [stream_seed(args.seed, j) for j in indices]
            paths = 1
            if args.num_turns > 1:
                # G independent episodes per item (not a G-ary tree): each path samples one answer per turn.
                (items, seeds), paths = independent_episodes(items, seeds, G), G
            rollout = collect(
                self.task_env,
                self.team.agents,
                items,
                engine=self.engine,
                num_generations=G // paths,
                params=params,
                **self._tree_settings(),
                parallel=self.parallel,
                shards=self._weight_shards(),
                seeds=seeds,
            )
            parts.append(rollout_values(rollout))
            if self.eval_logger is not None:
                played = episode_answers(rollout, items)
                per_item = len(played) // len(indices)
                episodes += [(indices[e // per_item], item, turns) for e, (item, turns) in enumerate(played)]
        if D > 1:  # every shard's samples, and the episodes in item order, as one process plays them
            gathered = self.data.gather((parts, episodes))
            parts = [part for shard_parts, _ in gathered for part in shard_parts]
            episodes = sorted(
                (e for _, shard_episodes in gathered for e in shard_episodes), key=lambda e: e[0]
            )
        pooled = pooled_values(parts)
        metrics = {f"eval/{k}": float(v.nanmean()) for k, v in pooled.items() if v.numel()}
        if self.eval_logger is not None and self.eval_aggregator is not None:
            logged = self.eval_logger(
                agent_completions_turns=[
                    [[turn[i] for turn in turns] for _, _, turns in episodes] for i in range(self.num_agents)
                ],
                batch_items=[item for _, item, _ in episodes],
                prompts=[item.get("prompt", "") if isinstance(item, dict) else "" for _, item, _ in episodes],
            )
            for key, value in self.eval_aggregator(logged, num_turns=args.num_turns).items():
                metrics[f"eval/{key}"] = value
        return metrics

    def checkpoint_state(self) -> dict[str, Any]:
        """What this process holds, for a checkpoint: its agents' weights, optimizers and schedules
        (``comarl.checkpoint`` adds the global random streams; train()'s sampling streams follow from the step).
        A frozen agent's weights are not kept: they never change, and resume loads them from its source again (the
        checkpoint checks that the source is the same), as it does a LoRA agent's base."""
        # shard_weights: each process holds its own share of the weights and of their AdamW state
        sharded = self.args.shard_weights
        return {
            "agents": {
                i: {
                    "model": (
                        None
                        if i in self.args.frozen_agents
                        else self.once(saved_weights(self.team[i].model), sharded)
                    ),
                    "optimizer": self.once(
                        optimizer_state(self.optimizers[i]), sharded or is_sharded(self.optimizers[i])
                    ),
                    "scheduler": self.schedulers[i].state_dict(),
                }
                for i in self.local
            },
        }

    def once(self, state: Any, sharded: bool = False) -> Any:
        """``state`` for this process's part of a checkpoint, if it is sharded or this is the first data shard;
        else ``IN_FIRST_SHARD``: every data shard holds it whole and equal, and the first shard's part keeps it."""
        from comarl.checkpoint import IN_FIRST_SHARD

        return state if sharded or self.data is None or self.data.rank == 0 else IN_FIRST_SHARD

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`checkpoint_state` returned."""
        if sorted(state["agents"]) != sorted(self.local):
            raise ConfigError(
                f"resume_from_checkpoint: the checkpoint holds agents {sorted(state['agents'])}, this process trains "
                f"{self.local}; resume with the same launch (agent_parallel and process count)"
            )
        for i, part in state["agents"].items():
            if part["model"] is not None:  # None: a frozen agent, whose weights are as its source loaded them
                load_weights(
                    self.team[i].model,
                    part["model"],
                    f"agent {i}",
                    "the same model (model= / agents=) and LoRA settings (lora_r, lora_target_modules)",
                )
            load_optimizer_state(self.optimizers[i], part["optimizer"], f"agent {i}")
            self.schedulers[i].load_state_dict(part["scheduler"])

    def save_model(self, output_dir: str | Path) -> None:
        """Write ``output_dir/agent_{i}/`` per agent, each loadable with ``from_pretrained`` (each process its own;
        under data parallelism, where every data shard holds the same agent, the first; a sharded agent is gathered
        from all of them first)."""
        for i in self.local:
            agent = self.team[i]
            first = self.data is None or self.data.rank == 0
            weights = whole_state_dict(agent.model, keep=first)  # None unless sharded
            if not first:
                continue
            path = Path(output_dir) / f"agent_{i}"
            save_own_model(agent.model, path, weights)
            agent.tokenizer.save_pretrained(path)

    # ------------------------------------------------------------------ helpers
    def _step_completions(self, rollout: Rollout) -> float:
        """The completions the team sampled this step: every data shard's (each process holds its own share)."""
        count = float(sum(len(g.completions) for g in rollout.generations))
        return count if self.data is None else self.data.sum_values({"n": count})["n"]

    def _merged(self, held: dict[Any, Any]) -> dict[Any, Any]:
        """``held`` (what this process computed: metrics, values by agent) merged with every other process's;
        ``held`` itself in a single-process run."""
        if self.parallel is None:
            return held
        merged: dict[Any, Any] = {}
        for part in self.parallel.gather(held):
            merged.update(part)
        return merged

    def _batches(self):  # noqa: ANN202
        """Items of each step after ``self.step`` (see ``_batch_indices``, whose indices ``self._step_indices``
        holds meanwhile) and their seeds: item j in step s draws from streams keyed (seed, j, s) alone, so a run
        samples the same completions in one process or split among data shards, and after a resume."""
        for step, indices in enumerate(self._batch_indices(), start=self.step + 1):
            self._step_indices = indices
            yield (
                [self.train_dataset[j] for j in indices],
                [stream_seed(self.args.seed, j, step) for j in indices],
            )

    def _batch_indices(self):  # noqa: ANN202
        """Dataset indices of each step after ``self.step``: a seeded permutation per epoch, ``prompts_per_step``
        at a time (drop last). A resumed run skips the steps it has taken."""
        args, size = self.args, len(self.train_dataset)
        per_epoch = args.steps_per_epoch(size)
        produced, epoch = 0, 0
        while produced < self.total_steps:
            order = torch.arange(size)
            if args.shuffle:
                order = torch.randperm(size, generator=torch.Generator().manual_seed(args.seed + epoch))
            for s in range(per_epoch):
                if produced == self.total_steps:
                    return
                if produced >= self.step:
                    ids = order[s * args.prompts_per_step : (s + 1) * args.prompts_per_step].tolist()
                    yield ids if self.data is None else self.data.shard(ids)
                produced += 1
            epoch += 1

    def _collect(self, items: Sequence[Any], seeds: Sequence[int] | None = None) -> Rollout:
        """Sample every agent's answers to ``items`` and play them in the environment (a tree over turns); ``seeds``:
        see :func:`comarl.rollout.collect`."""
        args = self.args
        return collect(
            self.env,
            self.team.agents,
            items,
            engine=self.engine,
            num_generations=args.num_generations,
            params=self._sampling(),
            joint_mode=args.joint_mode,
            max_joint_actions=args.max_joint_actions,
            **self._tree_settings(),
            generator=self.joint_generator,
            pool=self.pool,
            parallel=self.parallel,
            shards=self._weight_shards(),
            seeds=seeds,
        )

    def _weight_shards(self) -> DataParallel | None:
        """The data shards among which every agent is split (``shard_weights``): they run every generate call and
        every forward of the agents together. None otherwise."""
        return self.data if self.args.shard_weights else None

    def _schedule(self, optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        """Warmup and decay over the optimizer steps of ``steps`` training steps (``num_iterations`` each)."""
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(self.args, steps * self.args.num_iterations)
        )

    def training_steps_of(self, i: int) -> int:
        """The training steps of the run in which agent ``i`` updates (all of them, or with ``alternate_agents_every``
        its turns), so that its schedule (warmup, decay to 0) spans its own updates."""
        if not self.args.alternate_agents_every:
            return self.total_steps
        return sum(i in self.learners_at(step) for step in range(1, self.total_steps + 1))

    def _tree_settings(self) -> dict[str, Any]:
        a = self.args
        return {
            "num_turns": a.num_turns,
            "max_children": a.max_children,
            "discount": a.discount,
            "backup": a.tree_backup,
            "early_termination_threshold": a.early_termination_threshold,
        }

    def _sampling(self, do_sample: bool = True) -> list[SamplingParams]:
        """How each agent samples (its agent_settings over the shared values)."""
        return [
            SamplingParams(a.max_new_tokens, a.min_new_tokens, a.temperature, a.top_p, a.top_k, do_sample)
            for a in self.agent_args
        ]

    @torch.no_grad()
    def _logprobs(
        self, i: int, gen: Generation, batches: Sequence[slice | torch.Tensor], model: Any = None
    ) -> torch.Tensor:
        """Agent ``i``'s token log-probs of the rows of ``gen`` in ``batches`` (slices or row ids), in their order, at
        its sampling temperature (``model``: e.g. its reference)."""
        agent, parts = self.team[i], []
        for sl, real in self._padded(i, batches, filler=slice(0, 1)):
            with self._autocast(i):
                logp = agent.completion_logprobs(
                    gen.prompt_ids[sl],
                    gen.prompt_mask[sl],
                    gen.completion_ids[sl],
                    gen.completion_mask[sl],
                    self.agent_args[i].temperature,
                    model=model,
                )
            if real:
                parts.append(logp)
        return torch.cat(parts) if parts else torch.zeros(0, gen.completion_ids.shape[1], device=agent.device)

    def _behaviour_logprobs(self, i: int, gen: Generation, batches: list[torch.Tensor]) -> torch.Tensor:
        """Agent ``i``'s log-probs of ``gen`` before its ``num_iterations`` steps, ``[M, T]``: computed for the rows of
        ``batches`` (:func:`learned_batches`) alone, the only rows the loss reads; the others hold 0."""
        logp = self._logprobs(i, gen, batches)
        old = logp.new_zeros(gen.completion_ids.shape)
        if batches:
            old[torch.cat(batches).to(old.device)] = logp
        return old

    def _padded(self, i: int | None, parts: Sequence[Any], filler: Any) -> list[tuple[Any, bool]]:
        """``(part, True)`` for each of ``parts``, agent ``i``'s micro-batches, then ``(filler, False)`` until this
        process has as many as the data shard that has the most, when agent ``i`` is sharded (``shard_weights``):
        every forward and backward gathers its layers from all of its shards, so all must run the same number
        (their shares of a batch can differ in rows and widths). ``filler`` picks one row of the caller's batch,
        which the caller runs with weight 0, keeping nothing of it. ``i=None``: a model that is never sharded."""
        real = [(part, True) for part in parts]
        shards = self._weight_shards() if i is not None else None
        if shards is None:
            return real
        most = max(shards.gather(len(real)))
        return real + [(filler, False)] * (most - len(real))

    def _autocast(self, i: int) -> AbstractContextManager[Any]:
        """Agent ``i``'s training forward precision: the engine's rule (its ``bf16``), so that samples are scored as
        drawn."""
        agent = self.team[i]
        return bf16_autocast(agent.device, agent.bf16)

    def _learning_rate(self, i: int) -> float:
        """Agent ``i``'s learning rate: the Agent's own if it has one, else its agent_settings', else the config's."""
        own = self.team[i].learning_rate
        return own if own is not None else self.agent_args[i].learning_rate

    def _optimizer(self, i: int) -> torch.optim.Optimizer:
        """AdamW over agent ``i``'s trainable parameters at its :meth:`_learning_rate`."""
        a, agent = self.args, self.team[i]
        params = [p for p in agent.model.parameters() if p.requires_grad]
        return adamw(
            params,
            None if a.shard_weights else self._optimizer_group(self.data),  # shard_weights: already a share
            lr=self._learning_rate(i),
            betas=(a.adam_beta1, a.adam_beta2),
            eps=a.adam_epsilon,
            weight_decay=a.weight_decay,
        )

    def _samples(
        self, items: Sequence[Any], rollout: Rollout, advantages: list[torch.Tensor], rewards: torch.Tensor
    ) -> list[dict[str, Any]]:
        """The first joint action of the first ``log_completions`` items, with the task's ``rewards``
        ``[nodes, K, N]`` and the advantages."""
        G, samples = self.args.num_generations, []
        for b in range(min(len(items), self.args.log_completions)):
            k = 0
            joint = rollout.joint_index[b, k]
            rows = [b * G + int(joint[i]) for i in range(self.num_agents)]
            samples.append(
                {
                    "prompts": [str(rollout.generations[i].prompts[r]) for i, r in enumerate(rows)],
                    "completions": [rollout.generations[i].completions[r] for i, r in enumerate(rows)],
                    "rewards": rewards[b, k].tolist(),
                    "advantages": [float(advantages[i][r]) for i, r in enumerate(rows)],
                }
            )
        return samples

    def _sinks(self, run_dir: Path | None, start_step: int = 0) -> list[Any]:
        """The metric sinks of ``report_to``: TensorBoard in ``run_dir/tensorboard`` (steps after ``start_step``
        that it holds from before are dropped), a W&B run, a trackio run."""
        from comarl.tracking import TensorBoardSink, TrackioSink, WandbSink

        args, sinks = self.args, []
        if "tensorboard" in args.report_to:
            sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard", start_step))
        if "wandb" in args.report_to:
            given = self.wandb_config or {}
            config = args.to_dict()
            # CoMLRL's config_sections join the run's config; a dataset section's name and type also as
            # dataset_name / dataset_type, as CoMLRL records them.
            sections = given.get("config_sections")
            if isinstance(sections, dict):
                config.update(sections)
                dataset = sections.get("dataset")
                for key in ("name", "type") if isinstance(dataset, dict) else ():
                    if dataset.get(key):
                        config[f"dataset_{key}"] = dataset[key]
            init = {
                "project": given.get("project") or args.wandb_project,
                "name": given.get("name") or given.get("run_name") or args.run_name,
                "config": config,
                **{k: given[k] for k in ("entity", "dir", "tags", "id", "resume") if k in given},
            }
            if "dir" not in init and run_dir is not None:
                init["dir"] = str(run_dir)
            sinks.append(WandbSink(init))
        if "trackio" in args.report_to:
            sinks.append(
                TrackioSink(
                    {"project": args.trackio_project, "name": args.run_name, "config": args.to_dict()}
                )
            )
        return sinks


class MAREINFORCETrainer(MAGRPOTrainer):
    """MAREINFORCE: REINFORCE on the raw joint return (MAREINFORCEConfig: baseline none, scale none)."""

    config_class = MAREINFORCEConfig


class MARLOOTrainer(MAGRPOTrainer):
    """MARLOO: leave-one-out baseline (MARLOOConfig)."""

    config_class = MARLOOConfig


class MAReMaxTrainer(MAGRPOTrainer):
    """MAReMax: the greedy joint action's reward as the baseline (MAReMaxConfig)."""

    config_class = MAReMaxConfig


# ---------------------------------------------------------------------------- module helpers


def rollout_values(rollout: Rollout) -> dict[str, torch.Tensor]:
    """The samples behind each team-level metric (flattened; averaged by the caller).

    - ``reward``: team return of every joint action at the first turn (= the reward when single-turn);
    - ``success``: success of every joint action whose episode ended (done, or at the turn limit); a joint action
      left open without a child (``max_children``, ``max_nodes``) has no outcome and is not counted;
    - ``reward/<name>``: each reward function's value on every joint action;
    - multi-turn: ``turn_t/reward`` immediate team reward at turn t, ``solved_turn`` the turn of each success.
      Every turn up to the limit has its key, empty where no episode reached it: a rollout whose episodes all
      ended at turn 1 still counts in ``turn_1/reward`` when its values are pooled with others' (another data
      shard's, another evaluation batch's).
    """
    root = rollout.depth == 0
    team_returns = rollout.node_returns.mean(dim=-1)  # [nodes, K]
    values = {"reward": team_returns[root].flatten()}
    ended = rollout.done.bool() | (rollout.depth == rollout.num_turns - 1).unsqueeze(1)
    # An ended episode without the flag did not succeed: a rollout in which none reported it (an environment that
    # flags only wins, a batch without one) gives zeros, kept where another rollout it is pooled with reported.
    reported = rollout.success is not None
    values["success"] = rollout.success[ended] if reported else torch.zeros(int(ended.sum()))
    values["success_reported"] = torch.tensor([float(reported)])
    for name, comp in rollout.components.items():
        values[f"reward/{name}"] = comp.flatten()
    N = rollout.rewards.shape[-1]
    if N > 1:
        for i in range(N):
            values[f"agent_{i}/reward"] = rollout.node_returns[root][..., i].flatten()
    if rollout.num_turns > 1:
        team_rewards = rollout.rewards.mean(dim=-1)
        for t in range(rollout.num_turns):
            values[f"turn_{t + 1}/reward"] = team_rewards[rollout.depth == t].flatten()
        if rollout.success is not None:
            solved = ended & rollout.success.bool()
            depth = rollout.depth.unsqueeze(1).expand_as(solved)
            values["solved_turn"] = (depth[solved] + 1).float()
    return values


def pooled_values(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ``rollout_values`` of several rollouts (evaluation batches, data shards), concatenated per key, as one
    rollout of all their items gives them: ``success`` is kept when any of them reported success (the others'
    ended episodes then count as unsolved), dropped when none did (a task without the notion)."""
    keys = dict.fromkeys(k for part in parts for k in part)
    pooled = {k: torch.cat([part[k] for part in parts if k in part]) for k in keys}
    if not pooled.pop("success_reported").any():
        del pooled["success"]
    return pooled


def rollout_metrics(rollout: Rollout, data: DataParallel | None = None) -> dict[str, float]:
    """Team-level training metrics of a rollout (see ``rollout_values``), plus the reward's spread; under data
    parallelism over every process's rollout."""
    parts, depth = [rollout_values(rollout)], rollout.depth
    if data is not None:
        gathered = data.gather((parts[0], depth))
        parts, depth = [part for part, _ in gathered], torch.cat([d for _, d in gathered])
    values = pooled_values(parts)
    metrics = {k: float(v.nanmean()) for k, v in values.items() if v.numel()}
    metrics["reward_std"] = float(values["reward"].std()) if values["reward"].numel() > 1 else 0.0
    if int(depth.max()) > 0:
        metrics["nodes_per_item"] = depth.numel() / int((depth == 0).sum())
    return metrics


def lr_lambda(args: MAGRPOConfig, total: int) -> Callable[[int], float]:
    """Multiplier of the learning rate at optimizer step ``s``: linear warmup, then constant/linear/cosine to 0."""
    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * total)  # rounded up, as transformers does

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        if args.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        if args.lr_scheduler_type == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def adamw(
    params: list[torch.Tensor], shard_over: Processes | None = None, **hyper: Any
) -> torch.optim.Optimizer:
    """AdamW over ``params``, fused where it can run fused. ``shard_over``: the processes that hold copies of
    ``params`` (``shard_optimizer``); each keeps the AdamW state of its share of them, updates that share and
    sends it to the others (torch's ZeroRedundancyOptimizer), so every copy takes the one-process step."""
    hyper["fused"] = fused_adamw(params)
    if shard_over is None:
        return torch.optim.AdamW(params, **hyper)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        params, optimizer_class=torch.optim.AdamW, process_group=shard_over.group, **hyper
    )


def saved_weights(model: Any) -> dict[str, Any]:
    """What a checkpoint keeps of an agent's ``model``: its state dict; of a LoRA model, its adapters alone (the
    weights it trains). The base is frozen and is loaded from the agent's source again on resume, as the KL
    reference is: a 3 B agent's checkpoint is then megabytes, not its 12 GB of fp32 weights."""
    state = model.state_dict()
    if not has_adapters(model):
        return state
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: value for name, value in state.items() if name in trained}


def load_weights(model: Any, state: dict[str, Any], owner: str, fix: str) -> None:
    """Load ``state`` (:func:`saved_weights`) into ``model``; stop naming ``owner`` and ``fix`` when it was saved
    from a model of other names or shapes (another model, other LoRA settings) rather than fail inside torch."""
    own = saved_weights(model)
    if has_adapters(model) and own.keys() != state.keys():
        own = model.state_dict()  # a checkpoint that kept a LoRA model's base too
    wrong = sorted(own.keys() ^ state.keys()) or [
        name for name, value in own.items() if tuple(value.shape) != tuple(state[name].shape)
    ]
    if wrong:
        raise ConfigError(
            f"resume_from_checkpoint: {owner}'s weights in the checkpoint do not fit its model here ({len(wrong)} "
            f"differ, e.g. {wrong[0]!r}); resume with {fix}"
        )
    if has_adapters(model) and not isinstance(model, SharedBaseAdapter):
        model.load_state_dict(state, strict=False)  # the base, not in state, stays as its source loaded it
    else:
        model.load_state_dict(state)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint keeps of ``optimizer``: its state dict; of a sharded one, this process's share (every
    process writes its own part of a checkpoint)."""
    if is_sharded(optimizer):
        state = optimizer.optim.state_dict()
        # The share receives the groups' settings (the schedule's learning rate) only when it steps: take the
        # wrapper's, which the schedule has already moved on.
        for saved, outer in zip(state["param_groups"], optimizer.param_groups):
            saved.update({k: v for k, v in outer.items() if k != "params"})
        return state
    return optimizer.state_dict()


def is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps only this process's share of the AdamW state (``shard_optimizer``)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


# Added to a device's out-of-memory error in a training step: what to turn down, by field.
OUT_OF_MEMORY_FIXES = (
    "comarl: a training step ran out of device memory (activations and generation come on top of the static memory "
    "that check_memory counted). Lower micro_batch_tokens (the update's activations grow with it), prompts_per_step x "
    "num_generations or max_new_tokens (the rows and length generated at once), or set gradient_checkpointing=True, "
    "bf16=True or lora_r; see docs/memory.md"
)


# AdamW settings a checkpoint's optimizer carries, by the config fields that set them. Loading the state puts the
# saved ones back (and the schedule its saved base rates), so a resume that changed them would silently keep the old.
OPTIMIZER_SETTINGS = {
    "initial_lr": "learning_rate (critic_learning_rate, reward_learning_rate, agent_settings)",
    "weight_decay": "weight_decay",
    "betas": "adam_beta1, adam_beta2",
    "eps": "adam_epsilon",
}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any], owner: str) -> None:
    """Restore what :func:`optimizer_state` returned into ``owner``'s optimizer; stop with a ConfigError when its
    settings (:data:`OPTIMIZER_SETTINGS`) differ from the saved ones."""
    for here, saved in zip(optimizer.param_groups, state["param_groups"]):
        for key, fields in OPTIMIZER_SETTINGS.items():
            if key == "initial_lr" and (key in here) != (key in saved):
                continue  # (a schedule's base rate against a scheduled rate: not comparable)
            # A group without a schedule has no initial_lr: its lr is the configured one throughout.
            mine, theirs = here.get(key, here["lr"]), saved.get(key, saved["lr"])
            if (list(mine) if isinstance(mine, (tuple, list)) else mine) != (
                list(theirs) if isinstance(theirs, (tuple, list)) else theirs
            ):
                raise ConfigError(
                    f"resume_from_checkpoint: {owner}'s optimizer was saved with {key.removeprefix('initial_')}="
                    f"{theirs!r}, this run has {mine!r}; resume with the same {fields}, or start a new run from the "
                    "saved agents to change them"
                )
    if is_sharded(optimizer):
        optimizer.optim.load_state_dict(state)
        # The wrapper hands its groups' settings to its share at every step: they must be the saved ones.
        for outer, inner in zip(optimizer.param_groups, optimizer.optim.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})
    else:
        optimizer.load_state_dict(state)


def fused_adamw(params: Sequence[torch.Tensor]) -> bool:
    """Whether AdamW can run fused (one kernel per step): CPU or CUDA tensors. Same update, fewer memory passes
    (3.3 against 9.5 ms per step for the 4.2 M-parameter benchmark model on one CPU core)."""
    return all(p.device.type in ("cpu", "cuda") for p in params)


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    set_seed_python_numpy(seed)


def set_seed_python_numpy(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # numpy is optional for comarl itself
        pass


def _team_sources(
    model: Any, agent_model: Any, agents: Any, team: Any, num_agents: int | None, shared: bool = False
) -> list[Any]:
    """One source per agent (a hub id, a path, a model object or an Agent). ``shared``: the agents share one model
    (``share_weights`` / ``lora_shared_base``), so a model object given as ``model=`` stays one object."""
    given = [
        name
        for name, v in (("model", model), ("agent_model", agent_model), ("agents", agents), ("team", team))
        if v is not None
    ]
    if len(given) > 1 and not (set(given) == {"model", "agent_model"} and model is agent_model):
        raise ConfigError(
            f"give the team one way, not {' and '.join(given)}: model= with num_agents=, agents=[...] or team="
        )
    if not given:
        raise ConfigError("no team: give model= (with num_agents=), agents=[...] or team=Team([...])")
    if team is not None or agents is not None:
        members = list(team.agents if team is not None else agents)
        if num_agents is not None and num_agents != len(members):
            raise ConfigError(f"num_agents={num_agents} but {len(members)} agents were given")
        return members
    base = model if model is not None else agent_model
    n = 2 if num_agents is None else num_agents
    if n < 1:
        raise ConfigError(f"num_agents={n}: must be >= 1")
    if not isinstance(base, (str, Path)) and n > 1 and not shared:
        # One object cannot be n distinct agents: agent 0 trains it in place, the others train deep copies.
        return [base] + [copy.deepcopy(base) for _ in range(n - 1)]
    return [base] * n


LOADING_KEYS = ("attn_implementation", "torch_dtype", "dtype")  # model_config keys passed to from_pretrained
MODEL_CONFIG_KEYS = ("model_kwargs", *LOADING_KEYS)


def _check_model_config(model_config: dict[str, Any] | None) -> None:
    """``model_config`` (CoMLRL's) holds only keys the agents' loading reads: no other is silently dropped."""
    unknown = sorted(set(model_config or {}) - set(MODEL_CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f"model_config: comarl reads {list(MODEL_CONFIG_KEYS)}, not {unknown}. For special_tokens, add them to "
            "the tokenizer (tokenizer.add_special_tokens(...), model.resize_token_embeddings(len(tokenizer))) and "
            "pass tokenizer= and the model; remove the other keys"
        )


def _load_agent(
    source: Any, tokenizer: Any, i: int, device: str, model_config: dict[str, Any] | None
) -> Agent:
    if isinstance(source, Agent):
        source.model.to(device)
        return source
    tok = _agent_tokenizer(tokenizer, i)
    if (
        tok is not None
        and not isinstance(tok, (str, Path))
        and i > 0
        and not isinstance(tokenizer, (list, tuple))
    ):
        tok = copy.deepcopy(tok)  # agents set padding on their tokenizer; keep them independent
    kwargs = dict((model_config or {}).get("model_kwargs", {}))
    for key in LOADING_KEYS:
        if model_config and key in model_config:
            kwargs[key] = model_config[key]
    return Agent.from_pretrained(source, tok, device=device, model_kwargs=kwargs)


def _one_model(members: Sequence[Any], devices: list[str], field: str) -> Any:
    """The model every member names (``lora_shared_base`` / ``share_weights`` need one): the same hub id or path,
    or the same model object, on one device."""
    first = members[0]
    if isinstance(first, (str, Path)):
        same = all(isinstance(m, (str, Path)) and str(m) == str(first) for m in members)
    else:
        same = not isinstance(first, Agent) and all(m is first for m in members)
    if not same:
        raise ConfigError(
            f"{field}=True: every agent must name the same model (a hub id, a path or one model object) so that they "
            f"can share its weights; got {[m if isinstance(m, (str, Path)) else type(m).__name__ for m in members]}"
        )
    if len(set(devices)) != 1:
        raise ConfigError(f"{field}=True: the shared weights live on one device; agent_devices={devices}")
    return members[0]


def _agent_tokenizer(tokenizer: Any, i: int) -> Any:
    """What ``tokenizer=`` gives agent ``i``: its entry of a list (one per agent), else the one for the team."""
    return tokenizer[i] if isinstance(tokenizer, (list, tuple)) else tokenizer


def _tokenizer(tokenizer: Any, i: int, first: Agent) -> Any:
    """Agent ``i``'s tokenizer when the team shares ``first``'s model: its own if given, else a copy of first's."""
    tok = tokenizer[i] if isinstance(tokenizer, (list, tuple)) else copy.deepcopy(first.tokenizer)
    if isinstance(tok, (str, Path)):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok))
    return tok


def _shared_base_agents(
    members: Sequence[Any], tokenizer: Any, devices: list[str], model_config: dict[str, Any] | None, args: Any
) -> list[Agent]:
    """``lora_shared_base``: the model every member names, loaded once, with one LoRA adapter per agent (adapter i
    from seed + 100 + i, as a separate LoRA agent's)."""
    source = _one_model(members, devices, "lora_shared_base")
    if not isinstance(source, (str, Path)) and has_adapters(source):
        raise ConfigError(
            f"lora_shared_base=True: the model object ({type(source).__name__}) already holds peft adapters, and "
            "every agent gets a new adapter on the shared base: give the base model (peft's get_base_model() after "
            "merging or unloading the adapter), or train it without lora_shared_base"
        )
    if isinstance(source, (str, Path)) and is_adapter_folder(
        str(source), dict((model_config or {}).get("model_kwargs", {}))
    ):
        raise ConfigError(
            f"lora_shared_base=True: {source} is a saved LoRA agent (adapter_config.json), and every agent gets a new "
            "adapter on the shared base, so its adapter would be dropped: give the base model (its "
            "base_model_name_or_path), or continue the saved agent without lora_shared_base"
        )
    first = _load_agent(source, tokenizer, 0, devices[0], model_config)
    views = shared_base_lora(
        first.model,
        [f"agent_{i}" for i in range(len(members))],
        args.lora_r,
        args.lora_alpha,
        args.lora_target_modules,
        [args.seed + 100 + i for i in range(len(members))],
    )
    tokenizers = [first.tokenizer] + [_tokenizer(tokenizer, i, first) for i in range(1, len(members))]
    return [Agent(view, tok, source=first.source) for view, tok in zip(views, tokenizers)]


def _remote_agent(source: Any, tokenizer: Any, i: int, model_config: dict[str, Any] | None) -> RemoteAgent:
    """Agent ``i`` as seen by a process that does not train it: its tokenizer only (agent parallelism), loaded as
    the process that trains it loads it."""
    from transformers import AutoTokenizer

    from comarl.agents import model_tokenizer, prepare_tokenizer

    if isinstance(source, Agent):
        return RemoteAgent(source.tokenizer, source.source, source.role, source.learning_rate)
    tok = _agent_tokenizer(tokenizer, i)
    if tok is None:  # a hub id or a path (a model object without a tokenizer was refused at the start)
        tok = model_tokenizer(str(source), (model_config or {}).get("model_kwargs"))
    elif isinstance(tok, (str, Path)):
        tok = AutoTokenizer.from_pretrained(str(tok))
    return RemoteAgent(
        prepare_tokenizer(copy.deepcopy(tok)), str(source) if isinstance(source, (str, Path)) else None
    )


def _agent_devices(spec: Any, n: int, one_model: bool = False) -> list[str]:
    """Each agent's device by ``agent_devices``; automatic placement puts agent i on GPU i mod #GPUs, or every agent
    on the first GPU when the agents share ``one_model`` (share_weights, lora_shared_base)."""
    if spec is None or spec == "auto":
        gpus = torch.cuda.device_count()
        if not gpus:
            return ["cpu"] * n
        return ["cuda:0"] * n if one_model else [f"cuda:{i % gpus}" for i in range(n)]
    spec = [spec] if isinstance(spec, str) else list(spec)
    for device in spec:
        try:
            torch.device(device)
        except RuntimeError:
            raise ConfigError(
                f"agent_devices: {device!r} is not a torch device; use e.g. 'cpu', 'cuda', 'cuda:1' or 'mps'"
            ) from None
    if len(spec) == 1:
        return spec * n
    if len(spec) != n:
        raise ConfigError(
            f"agent_devices has {len(spec)} entries for {n} agents: give one per agent or one for all"
        )
    return spec


def _reference(model: Any) -> Any:
    """The KL reference: the agent with its adapters off (LoRA), else a frozen copy of its starting weights."""
    if has_adapters(model):
        return WithoutAdapters(model)
    ref = copy.deepcopy(model)
    if checkpointing_on(ref):
        # The copy never runs a backward: checkpointing would only cost it the shared-prompt KV cache.
        set_activation_checkpointing(ref, False)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
