"""The critic family: IAC, MAAC (centralized critic), IPPO and MAPPO — one loop, different settings.

One training step, top to bottom (``training_step``):

1. collect a rollout exactly as MAGRPO does (every agent samples G answers per node; a tree over turns);
2. the critic values every node under no_grad, in one batched forward per critic:
   - independent (IAC/IPPO): ``V_i(o_i)`` from a value head on agent i's own model (or a separate
     critic model per agent), reading agent i's observation only;
   - centralized (MAAC/MAPPO): one critic model reads every agent's observation, rendered as text,
     and predicts ``V(s)`` for every agent at once; with ``critic_type='q'`` it also reads the joint
     answer and predicts ``Q(s, a)``;
3. TD(lambda) returns over turns (``tree_lambda_returns``) are the critic's targets; each completion's
   advantage is its credited return minus ``V`` (or ``Q`` minus a COMA counterfactual baseline),
   whitened per agent;
4. each agent takes ``num_iterations`` epochs x ``num_mini_batches`` clipped PPO steps; a value head
   on the agent's model trains in the same forward (``value_coef``); a separate critic takes the
   same number of steps on its own samples — once per update, not once per agent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from comarl.algorithms import (
    aggregate_loss,
    clipped_surrogate,
    counterfactual_baseline,
    cross_returns,
    explained_variance,
    kl_k3,
    tree_lambda_returns,
    truncated_completions,
    value_loss,
    whiten,
)
from comarl.config import ActorCriticConfig, ConfigError, IACConfig, IPPOConfig, MAACConfig, MAPPOConfig
from comarl.critics import (
    CriticModel,
    ValueHead,
    hidden_size,
    joint_observation,
    last_token_hidden,
    policy_forward,
)
from comarl.distributed import sum_and_clip_gradients
from comarl.engines import Generation, bf16_autocast
from comarl.envs import prompt_text
from comarl.memory import ModelMemory, model_memory, model_size
from comarl.rollout import Rollout
from comarl.trainers.magrpo import (
    MAGRPOTrainer,
    adamw,
    is_sharded,
    load_optimizer_state,
    load_weights,
    lr_lambda,
    optimizer_state,
    rollout_metrics,
)

ARGS_POSITION = 7  # MAGRPOTrainer(model, num_agents, tokenizer, train_dataset, eval_dataset, reward_func, formatters, args)


class ActorCriticTrainer(MAGRPOTrainer):
    """Actor-critic over the MAGRPO rollout pipeline; the config chooses independent or centralized critics."""

    config_class: type[ActorCriticConfig] = ActorCriticConfig

    def __init__(
        self,
        *args: Any,
        critic_model: Any = None,
        critics: Any = None,
        metrics_callback: Any = None,
        **kwargs: Any,
    ) -> None:
        """MAGRPOTrainer's arguments, plus CoMLRL's ``critic_model=`` (a hub id or path: the same as the config's
        ``critic_model``) and ``critics=`` (one per agent, all naming the same model)."""
        if metrics_callback is not None:
            raise ConfigError(
                f"{type(self).__name__}(metrics_callback=): comarl has no per-rollout callback; return extra numbers "
                "from your environment's step as StepResult components (logged as reward/<name>)"
            )
        if critics is not None:
            names = {str(c) if isinstance(c, (str, Path)) else None for c in critics}
            if None in names or len(names) != 1:
                raise ConfigError(
                    f"{type(self).__name__}(critics=): comarl gives every agent a copy of one critic model; pass "
                    "critic_model='<hub id or path>' instead"
                )
            named = names.pop()
            if critic_model is not None and str(critic_model) != named:
                raise ConfigError(
                    f"{type(self).__name__}(critic_model={str(critic_model)!r}, critics=[{named!r}, ...]): they name "
                    "different models; give one of them"
                )
            critic_model = named
        if critic_model is not None:
            if not isinstance(critic_model, (str, Path)):
                raise ConfigError(
                    f"{type(self).__name__}(critic_model=): give a hub id or path, not a {type(critic_model).__name__}"
                )
            # args is MAGRPOTrainer's 8th parameter: given by keyword or by position
            positional = len(args) > ARGS_POSITION
            config = (args[ARGS_POSITION] if positional else kwargs.get("args")) or self.config_class()
            if config.critic_model not in (None, str(critic_model)):
                raise ConfigError(
                    f"{type(self).__name__}(critic_model={str(critic_model)!r}) but args.critic_model="
                    f"{config.critic_model!r}; give it once"
                )
            config = replace(config, critic_model=str(critic_model))
            if positional:
                args = (*args[:ARGS_POSITION], config, *args[ARGS_POSITION + 1 :])
            else:
                kwargs["args"] = config
        super().__init__(*args, **kwargs)
        a, N = self.args, self.num_agents
        # Under agent parallelism a process holds the critics of its own agent; the centralized critic
        # lives with agent 0. Entries of critics, heads and optimizers this process does not hold are None.
        self.value_heads: list[ValueHead | None] | None = None
        self.critics: list[CriticModel | None] = []
        if a.centralized_critic:
            source = a.critic_model or self.team[0].source
            if source is None:
                raise ConfigError(
                    "centralized_critic: set critic_model= (agent 0 was given as an object, not a path)"
                )
            self.critics = [
                CriticModel.from_pretrained(source, outputs=N, device=self.team[0].device)
                if 0 in self.local
                else None
            ]
        elif a.critic_model is not None:
            self.critics = [
                CriticModel.from_pretrained(a.critic_model, 1, agent.device) if i in self.local else None
                for i, agent in enumerate(self.team)
            ]
        else:
            self.value_heads = [
                ValueHead.load_or_new(_local_dir(agent.source), hidden_size(agent.model), 1).to(agent.device)
                if i in self.local
                else None
                for i, agent in enumerate(self.team)
            ]
            # The head trains with its agent (same forward, same optimizer step), at the critic's learning rate.
            self.optimizers = [
                self._optimizer(i, head) if i in self.local else None
                for i, head in enumerate(self.value_heads)
            ]
            self.schedulers = [
                self._schedule(opt, self.training_steps_of(i)) if opt is not None else None
                for i, opt in enumerate(self.optimizers)
            ]
        # A critic of one agent learns at that agent's rate when critic_learning_rate is None; the centralized one
        # serves the team, at the team's rate.
        self.critic_optimizers = [
            adamw(
                list(c.parameters()),
                self._optimizer_group(self.data),
                lr=a.critic_rate(a.learning_rate if a.centralized_critic else self._learning_rate(i)),
                betas=(a.adam_beta1, a.adam_beta2),
                eps=a.adam_epsilon,
                weight_decay=a.weight_decay,
            )
            if c is not None
            else None
            for i, c in enumerate(self.critics)
        ]
        # One mini-batch shuffle stream per agent and per critic: a process that holds one of them (agent
        # parallelism) draws the same orders as one process holding all.
        self.actor_shuffles = [torch.Generator().manual_seed(a.seed + 2 + i) for i in range(N)]
        self.critic_shuffles = [
            torch.Generator().manual_seed(a.seed + 2 + N + c) for c in range(len(self.critics))
        ]

    # ------------------------------------------------------------------ one training step

    def _memory_plan(self, members: Sequence[Any], devices: Sequence[str]) -> list[ModelMemory]:
        """The agents' memory and that of the critics with their own backbone (value heads are a few kilobytes)."""
        a, plan, shards = self.args, super()._memory_plan(members, devices), self._optimizer_shards(self.data)
        if a.centralized_critic:
            size = model_size(a.critic_model or members[0], lm_head=False) if 0 in self.local else None
            if size is not None:
                plan.append(
                    model_memory("centralized critic", devices[0], size, optimizer_shards=shards, bf16=a.bf16)
                )
        elif a.critic_model is not None and (size := model_size(a.critic_model, lm_head=False)) is not None:
            plan += [
                model_memory(f"critic {i}", devices[i], size, optimizer_shards=shards, bf16=a.bf16)
                for i in self.local
            ]
        return plan

    def training_step(
        self, items: Sequence[Any], seeds: Sequence[int] | None = None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        args, N, G = self.args, self.num_agents, self.args.num_generations
        t0 = time.perf_counter()
        rollout = self._collect(items, seeds)
        t1 = time.perf_counter()
        metrics = rollout_metrics(rollout, self.data)  # the task's rewards
        task_rewards = rollout.rewards  # what samples.jsonl shows, as the metrics: not less the KL penalty
        if args.kl_penalty == "reward" and self.references is not None:
            rollout = self._penalised(rollout, metrics)  # the critics learn the penalised returns too

        # Values of every node (Q: of every joint action) under the policy that collected the batch.
        critic_inputs, old = self._critic_values(rollout)  # [nodes, N] or [nodes, K, N]
        node_values = old.mean(dim=1) if args.critic_type == "q" else old
        targets = tree_lambda_returns(
            rollout.rewards, node_values, rollout.child, rollout.done, args.discount, args.gae_lambda
        )  # [nodes, K, N]: what the critic learns

        if args.critic_type == "q":  # b[n, k, i]: agent i's counterfactual baseline for joint action k
            counterfactual = torch.stack(
                [counterfactual_baseline(old[n], rollout.joint_index[n], G) for n in range(len(old))]
            )
        advantages, value_targets = [], []
        for i in range(N):
            joint_index = rollout.joint_index[:, :, i]
            credited = torch.stack(
                [cross_returns(targets[n, :, i], joint_index[n], G) for n in range(len(targets))]
            )  # [nodes, G]
            if args.critic_type == "q":
                joint_adv = old[:, :, i] - counterfactual[:, :, i]
                adv = torch.stack([cross_returns(joint_adv[n], joint_index[n], G) for n in range(len(old))])
            else:
                adv = credited - node_values[:, i : i + 1]
            adv = adv.flatten()
            advantages.append(self._whitened(adv) if args.whiten_advantages else adv)
            value_targets.append(credited.flatten())

        learning = self.learning_agents()  # a frozen agent's value head (if any) stays as it is too
        old_values = [node_values[:, i].repeat_interleave(G) for i in range(self.num_agents)]
        updated = self.each_agent(
            lambda i: self.update_actor(
                i, rollout.generations[i], advantages[i], value_targets[i], old_values[i]
            ),
            learning,
        )
        for i, stats in zip(learning, updated):
            stats["explained_variance"] = explained_variance(
                *self._everywhere(old_values[i], value_targets[i])
            )
            metrics.update({f"agent_{i}/{k}": v for k, v in stats.items()})
        for c, critic in enumerate(self.critics):
            if critic is None:
                continue
            agent = None if args.centralized_critic else c
            samples, sample_targets, sample_old = self._critic_samples(critic_inputs[c], targets, old, agent)
            prefix = "critic" if args.centralized_critic else f"critic_{c}"
            stats = self.update_critic(c, samples, sample_targets, sample_old)
            metrics.update({f"{prefix}/{k}": v for k, v in stats.items()})
        # every process reports every agent's and critic's metrics
        metrics.update(self._merged({k: v for k, v in metrics.items() if k.startswith(("agent_", "critic"))}))
        t2 = time.perf_counter()
        completions = self._step_completions(rollout)
        metrics.update(
            {
                "time/generate": rollout.generate_seconds,
                "time/environment": t1 - t0 - rollout.generate_seconds,
                "time/update": t2 - t1,
                "time/step": t2 - t0,
                "completions_per_s": completions / (t2 - t0),
            }
        )
        return metrics, self._samples(items, rollout, advantages, task_rewards)

    # ------------------------------------------------------------------ actor (and value head) update
    def update_actor(
        self,
        i: int,
        gen: Generation,
        advantages: torch.Tensor,
        value_targets: torch.Tensor,
        old_values: torch.Tensor,
    ) -> dict[str, float]:
        """``num_iterations`` epochs of ``num_mini_batches`` clipped steps for agent ``i`` (and its value head)."""
        args, agent, optimizer = self.agent_args[i], self.team[i], self.optimizers[i]
        head = self.value_heads[i] if self.value_heads is not None else None
        device = agent.device
        advantages, value_targets, old_values = (
            t.to(device) for t in (advantages, value_targets, old_values)
        )
        M = gen.completion_ids.shape[0]
        micro = args.micro_batch_rows(M, gen.prompt_ids.shape[1] + gen.completion_ids.shape[1])
        cut = truncated_completions(gen.completion_ids, gen.completion_mask, agent.eos_token_ids)
        scored = self.loss_mask(i, gen, cut)  # the tokens the policy loss scores
        # Scored lengths of the whole batch (every process's under data parallelism): the loss normalisers.
        row_tokens, lengths, all_cut = self._everywhere(
            scored.sum(dim=1), gen.completion_mask.sum(dim=1), cut
        )
        # Behaviour and reference log-probs under no_grad, only when the loss needs them.
        batches = [slice(s, s + micro) for s in range(0, M, micro)]
        reused = args.num_iterations * args.num_mini_batches > 1
        old_logp = self._logprobs(i, gen, batches) if reused else None
        refs = self.references if args.kl_penalty == "loss" else None  # 'reward': already in the returns
        ref = self._logprobs(i, gen, batches, refs[i]) if refs is not None else None
        for _ in range(args.num_iterations):
            totals = dict.fromkeys(("loss", "value_loss", "clip_fraction", "approx_kl", "entropy", "kl"), 0.0)
            for batch, rows in self._mini_batches(M, self.actor_shuffles[i]):
                size, tokens = len(batch), int(row_tokens[batch].sum())
                # A shard may hold none of a mini-batch; a sharded agent's shards still run as many passes each.
                first_row = torch.zeros(1, dtype=torch.long)
                for mb, real in self._padded(i, rows.split(micro) if len(rows) else (), filler=first_row):
                    mask = scored[mb]
                    with self._autocast(i):
                        logp, entropy, values = policy_forward(
                            agent.model,
                            head,
                            gen.prompt_ids[mb],
                            gen.prompt_mask[mb],
                            gen.completion_ids[mb],
                            gen.completion_mask[mb],
                            args.temperature,
                            with_entropy=True,
                            entropy_grad=args.entropy_coef > 0,
                        )
                    behaviour = logp.detach() if old_logp is None else old_logp[mb]
                    per_token, clipped = clipped_surrogate(
                        logp, behaviour, advantages[mb], args.epsilon, args.epsilon_high, mask
                    )
                    if args.entropy_coef > 0:
                        per_token = per_token - args.entropy_coef * entropy
                    if ref is not None:
                        kl = kl_k3(logp, ref[mb], mask)
                        per_token = per_token + args.beta * kl
                        if real:
                            totals["kl"] += float((kl.detach() * mask).sum()) / max(tokens, 1)
                    loss = aggregate_loss(
                        per_token, mask, args.loss_aggregation, size, tokens, args.max_new_tokens
                    )
                    if head is not None:
                        v_loss = (
                            value_loss(values[:, 0], old_values[mb], value_targets[mb], args.value_clip).sum()
                            / size
                        )
                        loss = loss + args.value_coef * v_loss
                        if real:
                            totals["value_loss"] += float(v_loss.detach())
                    if not real:  # another shard's extra micro-batch: its collectives, no gradient
                        (0.0 * loss).backward()
                        continue
                    loss.backward()
                    with torch.no_grad():
                        weights = mask.float()
                        totals["loss"] += float(loss.detach())
                        totals["clip_fraction"] += float((clipped * weights).sum()) / max(tokens, 1)
                        # KL(pi_old || pi) from the tokens pi_old sampled: k3 with the sampler's log-probs first
                        totals["approx_kl"] += float(
                            (kl_k3(behaviour, logp.detach(), mask) * weights).sum()
                        ) / max(tokens, 1)
                        totals["entropy"] += float((entropy.detach() * weights).sum()) / max(tokens, 1)
                lr = optimizer.param_groups[0]["lr"]  # the rate this update uses (the schedule then moves on)
                grad_norm = self._step(optimizer, agent.model.parameters(), head)
                self.schedulers[i].step()
            # metrics: averages over the mini-batches of the last epoch
            totals = {k: v / args.num_mini_batches for k, v in totals.items()}
        if head is None:
            totals.pop("value_loss")
        if ref is None:
            totals.pop("kl")
        if self.data is not None:  # each process holds its part of the batch-normalised sums: add them up
            totals = {k: sum(part[k] for part in self.data.gather(totals)) for k in totals}
        all_advantages, all_values = self._everywhere(advantages.cpu(), old_values.cpu())
        return {
            **totals,
            "grad_norm": grad_norm,
            "lr": lr,
            "completion_length": float(lengths.float().mean()),
            "truncated_fraction": float(all_cut.float().mean()),
            "advantage_abs": float(all_advantages.abs().mean()),
            "value_mean": float(all_values.mean()),
        }

    # ------------------------------------------------------------------ separate critic update
    def update_critic(
        self,
        c: int,
        samples: tuple[torch.Tensor, torch.Tensor],
        targets: torch.Tensor,
        old_values: torch.Tensor,
    ) -> dict[str, float]:
        """``num_iterations`` epochs x ``num_mini_batches`` steps of critic ``c`` on its samples (once per update)."""
        args, critic, optimizer = self.args, self.critics[c], self.critic_optimizers[c]
        ids, mask = samples
        targets, old_values = targets.to(critic.device), old_values.to(critic.device)
        S = ids.shape[0]
        micro = args.micro_batch_rows(S, ids.shape[1])
        for _ in range(args.num_iterations):
            total, steps = 0.0, 0
            for batch, rows in self._mini_batches(S, self.critic_shuffles[c]):
                if not len(batch):  # fewer samples (tree nodes) than num_mini_batches: no step on nothing
                    continue
                steps += 1
                for mb in rows.split(micro) if len(rows) else ():  # a shard may hold none of a mini-batch
                    with bf16_autocast(critic.device, args.bf16):
                        values = critic(ids[mb], mask[mb])
                    loss = value_loss(values, old_values[mb], targets[mb], args.value_clip).mean(
                        dim=1
                    ).sum() / len(batch)
                    loss.backward()
                    total += float(loss.detach())
                grad_norm = self._step(optimizer, critic.parameters(), None)
        if self.data is not None:
            total = sum(self.data.gather(total))
        all_values, all_targets = self._everywhere(old_values.cpu().flatten(), targets.cpu().flatten())
        return {
            "value_loss": total / steps,  # the last epoch's mean over its mini-batches
            "grad_norm": grad_norm,
            "explained_variance": explained_variance(all_values, all_targets),
            "value_mean": float(all_values.mean()),
        }

    # ------------------------------------------------------------------ values under no_grad
    @torch.no_grad()
    def _critic_values(self, rollout: Rollout) -> tuple[list[Any], torch.Tensor]:
        """The critics' inputs (kept for their update) and values of every node: ``[nodes, N]`` (Q: ``[nodes, K, N]``)."""
        args, N, G = self.args, self.num_agents, self.args.num_generations
        nodes = len(rollout.states)
        roots = torch.arange(nodes) * G  # row of each node's first sample: its prompt
        if self.value_heads is not None:
            columns = {
                i: self._batched(
                    lambda ids, mask, i=i: self.value_heads[i](
                        last_token_hidden(self.team[i].model, ids, mask)
                    ),
                    rollout.generations[i].prompt_ids[roots],
                    rollout.generations[i].prompt_mask[roots],
                    self.team[i].device,
                    agent=i,
                )[:, 0]
                for i in self.local
            }
            merged = self._merged(columns)
            return [], torch.stack([merged[i] for i in range(N)], dim=1)
        observations = [[prompt_text(obs) for obs in state[1]] for state in rollout.states]
        if not args.centralized_critic:
            inputs: list[Any] = [None] * N
            columns = {}
            for i in self.local:
                inputs[i] = self.critics[i].encode([obs[i] for obs in observations])
                columns[i] = self._batched(self.critics[i], *inputs[i], self.critics[i].device)[:, 0]
            merged = self._merged(columns)
            return inputs, torch.stack([merged[i] for i in range(N)], dim=1)
        critic = self.critics[0]
        if critic is None:  # agent parallelism: the centralized critic is agent 0's process's
            return [None], self._merged({})[0]
        if args.critic_type == "v":
            inputs = critic.encode([joint_observation(obs) for obs in observations])
            values = self._batched(critic, *inputs, critic.device)
        else:
            texts = []
            for n, obs in enumerate(observations):
                for joint in rollout.joint_index[n]:
                    answers = [rollout.generations[i].completions[n * G + int(joint[i])] for i in range(N)]
                    texts.append(joint_observation(obs, answers))
            inputs = critic.encode(texts)
            values = self._batched(critic, *inputs, critic.device).view(nodes, -1, N)
        return [inputs], self._merged({0: values})[0]

    def _critic_samples(
        self,
        inputs: tuple[torch.Tensor, torch.Tensor],
        targets: torch.Tensor,
        old: torch.Tensor,
        agent: int | None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
        """A separate critic's training samples: one per node for V (target: mean over its joint actions), one per
        joint action for Q."""
        if self.args.critic_type == "q":
            N = targets.shape[-1]
            return inputs, targets.reshape(-1, N), old.reshape(-1, N)
        node_targets = targets.mean(dim=1)  # regressing on each joint action's target = on their mean
        if agent is not None:
            return inputs, node_targets[:, agent : agent + 1], old[:, agent : agent + 1]
        return inputs, node_targets, old

    def _batched(
        self, fn: Any, ids: torch.Tensor, mask: torch.Tensor, device: torch.device, agent: int | None = None
    ) -> torch.Tensor:
        """``fn(ids, mask)`` over micro-batches (``micro_batch_rows``), on the CPU; ``agent``: the agent whose model
        ``fn`` runs (a sharded one runs as many micro-batches as its other shards, see ``_padded``)."""
        # a value head's forward runs its agent's model: the agent's micro-batch settings
        settings = self.args if agent is None else self.agent_args[agent]
        step = settings.micro_batch_rows(ids.shape[0], ids.shape[1])
        batches = [slice(s, s + step) for s in range(0, ids.shape[0], step)]
        parts = []
        for sl, real in self._padded(agent, batches, filler=slice(0, 1)):
            # a value head runs its agent's model, in the agent's precision; a critic model in the team's
            with self._autocast(agent) if agent is not None else bf16_autocast(device, self.args.bf16):
                values = fn(ids[sl].to(device), mask[sl].to(device)).float().cpu()
            if real:
                parts.append(values)
        return torch.cat(parts)

    # ------------------------------------------------------------------ helpers
    def _mini_batches(
        self, count: int, generator: torch.Generator
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A seeded shuffle of the batch's rows cut into ``num_mini_batches`` parts: ``(rows of the batch, this
        process's rows)`` per part. Under data parallelism the batch is every process's ``count`` rows, shuffled
        alike everywhere, so each mini-batch is the one a single process would take."""
        if self.data is None:
            return [
                (part, part)
                for part in torch.randperm(count, generator=generator).tensor_split(
                    self.args.num_mini_batches
                )
            ]
        counts = self.data.gather(count)
        offset = sum(counts[: self.data.rank])
        order = torch.randperm(sum(counts), generator=generator)
        parts = order.tensor_split(self.args.num_mini_batches)
        return [(part, part[(part >= offset) & (part < offset + count)] - offset) for part in parts]

    def _everywhere(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor concatenated over the processes (itself in one process)."""
        if self.data is None:
            return list(tensors)
        parts = self.data.gather([t.cpu() for t in tensors])
        return [torch.cat([p[k] for p in parts]) for k in range(len(tensors))]

    def _whitened(self, advantages: torch.Tensor) -> torch.Tensor:
        """``whiten`` over the whole batch (every process's advantages); this process's part."""
        if self.data is None:
            return whiten(advantages)
        parts = self.data.gather(advantages)
        start = sum(len(p) for p in parts[: self.data.rank])
        return whiten(torch.cat(parts))[start : start + len(advantages)]

    def _step(self, optimizer: torch.optim.Optimizer, params: Any, head: ValueHead | None) -> float:
        params = [p for p in params if p.requires_grad] + ([] if head is None else list(head.parameters()))
        # The batch's gradient: the sum of every process's part under data parallelism.
        grad_norm = sum_and_clip_gradients(params, self.data, self.args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _optimizer(self, i: int, head: ValueHead | None = None) -> torch.optim.Optimizer:
        optimizer = super()._optimizer(i)
        if head is not None:
            optimizer.add_param_group(
                {
                    "params": list(head.parameters()),
                    "lr": self.args.critic_rate(self._learning_rate(i)),
                }
            )
        return optimizer

    def _schedule(self, optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        a = self.args
        total = steps * a.num_iterations * a.num_mini_batches
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(a, total))

    def checkpoint_state(self) -> dict[str, Any]:
        """The agents' state (see MAGRPOTrainer) plus the heads and critics this process holds, the critics'
        optimizers and the mini-batch shuffle streams."""
        state = super().checkpoint_state()
        state["value_heads"] = {
            i: self.once(h.state_dict()) for i, h in enumerate(self.value_heads or []) if h is not None
        }
        state["critics"] = {
            c: {
                "model": self.once(critic.state_dict()),
                "optimizer": self.once(
                    optimizer_state(self.critic_optimizers[c]), is_sharded(self.critic_optimizers[c])
                ),
            }
            for c, critic in enumerate(self.critics)
            if critic is not None
        }
        state["actor_shuffles"] = [g.get_state() for g in self.actor_shuffles]
        state["critic_shuffles"] = [g.get_state() for g in self.critic_shuffles]
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        fix = "the same critic settings (critic_model, centralized_critic)"
        # Before anything loads: a run with critic models where the checkpoint has value heads (or the other way
        # round) would fail inside torch on the agents' optimizers, which hold a head's parameter group.
        held = {
            "value_heads": [i for i, head in enumerate(self.value_heads or []) if head is not None],
            "critics": [c for c, critic in enumerate(self.critics) if critic is not None],
        }
        for key, here in held.items():
            if sorted(state[key]) != here:
                raise ConfigError(
                    f"resume_from_checkpoint: the checkpoint holds {key} {sorted(state[key])}, this process {here}; "
                    f"resume with {fix}"
                )
        super().load_checkpoint_state(state)
        for i, head_state in state["value_heads"].items():
            load_weights(self.value_heads[i], head_state, f"agent {i}'s value head", fix)
        for c, part in state["critics"].items():
            load_weights(self.critics[c], part["model"], f"critic {c}", fix)
            load_optimizer_state(self.critic_optimizers[c], part["optimizer"], f"critic {c}")
        for g, saved in zip(
            self.actor_shuffles + self.critic_shuffles, state["actor_shuffles"] + state["critic_shuffles"]
        ):
            g.set_state(saved)

    def save_model(self, output_dir: str | Path) -> None:
        """Agents as ``agent_i/`` (with ``value_head.pt`` when the critic is a head), critics as ``critic/``
        (centralized) or ``critic_i/``; each folder loads back with ``critic_model=`` / as an agent source."""
        super().save_model(output_dir)
        if self.data is not None and self.data.rank != 0:  # its copies are equal: the first shard writes them
            return
        for i, head in enumerate(self.value_heads or []):
            if head is not None:
                head.save(Path(output_dir) / f"agent_{i}")
        for c, critic in enumerate(self.critics):
            if critic is not None:
                critic.save(Path(output_dir) / ("critic" if self.args.centralized_critic else f"critic_{c}"))


class IACTrainer(ActorCriticTrainer):
    """IAC: independent actor-critic (IACConfig): each agent's own critic, one update per batch."""

    config_class = IACConfig


class MAACTrainer(ActorCriticTrainer):
    """MAAC: actor-critic with a centralized critic over every agent's observation (MAACConfig)."""

    config_class = MAACConfig


class IPPOTrainer(ActorCriticTrainer):
    """IPPO: PPO with independent critics (IPPOConfig)."""

    config_class = IPPOConfig


class MAPPOTrainer(ActorCriticTrainer):
    """MAPPO: PPO with a centralized critic (MAPPOConfig)."""

    config_class = MAPPOConfig


def _local_dir(source: str | None) -> str | None:
    """A saved agent folder, where a value head may have been saved with it; None for hub ids and objects."""
    return source if source is not None and Path(source).is_dir() else None
