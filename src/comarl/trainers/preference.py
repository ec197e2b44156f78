"""Preference methods: MADPO (multi-agent DPO) and MARLHF (a learned joint reward model, then MAGRPO).

Both start from the team's own candidates: every agent answers each prompt K times, joint
candidate ``k`` is every agent's k-th answer, and the task reward ranks them. Pairs
(chosen, rejected) of joint candidates of one prompt, with a higher and a lower team reward,
are the preference data (``algorithms.preference_pairs``).

MADPO, one training step (``MADPOTrainer.training_step``):

1. the candidates of ``prompts_per_step`` items: sampled now from the current team
   (``candidates_from="current"``), or taken from those the initial team sampled for the whole
   dataset before the first step (``"initial"``, CoMLRL's MADPO);
2. preference pairs from their team rewards;
3. each agent's DPO margin on every pair,
   ``m_i = beta [(log pi_i(w_i) - log ref_i(w_i)) - (log pi_i(l_i) - log ref_i(l_i))]``;
4. each agent ``num_iterations`` optimizer steps (1 by default) on the team's loss
   ``-log sigmoid(sum_j m_j)``: the joint policy is the product of the agents' policies, so the
   team's margin is the sum of theirs, and agent i follows its gradient with respect to its own
   weights. ``dpo_margin="own"``: ``-log sigmoid(m_i)`` instead.

MARLHF (``MARLHFTrainer``): before the first step, the initial team's candidates over the training
set give pairs; a reward model (a backbone and a scalar head reading every agent's prompt and
answer) is fit on them with the Bradley-Terry loss; then the MAGRPO loop trains the team on the
reward model's score (``RewardModelEnv``) while the task reward is logged and evaluated.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from comarl.agents import Agent
from comarl.algorithms import dpo_margins, preference_loss, preference_pairs, sequence_logprobs
from comarl.config import ConfigError, MADPOConfig, MARLHFConfig
from comarl.critics import CriticModel, joint_observation
from comarl.distributed import DataParallel, sum_and_clip_gradients
from comarl.engines import Generation, concat_generations, stream_seed
from comarl.envs import Env, StepResult, prompt_text
from comarl.memory import ModelMemory, model_memory, model_size
from comarl.rollout import collect
from comarl.trainers.magrpo import (
    MAGRPOTrainer,
    adamw,
    is_sharded,
    load_optimizer_state,
    optimizer_state,
    rollout_metrics,
)


class MADPOTrainer(MAGRPOTrainer):
    """Multi-agent DPO on the team's preferences between joint answers (MADPOConfig)."""

    config_class = MADPOConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        a = self.args
        # Random pairs of a training_step called without seeds: a stream per data shard (see pair_streams).
        shard = self.data.rank if self.data is not None else 0
        self.pair_generator = torch.Generator().manual_seed(a.seed + 3 + 1000 * shard)
        # candidates_from="initial": per dataset item, what the initial team answered (see _initial_candidates),
        # looked up by the dataset indices of the current step (self._step_indices, set by _batches).
        self.candidates: list[dict[str, Any]] | None = None
        if a.candidates_from == "initial":  # a size that shard_weights cannot split stops here, not at step 1
            dataset_chunks(len(self.train_dataset), a.prompts_per_step, self.data, a.shard_weights)

    def _keeps_reference(self) -> bool:
        # The reference is the initial policy. Candidates from the initial team carry its log-probs from the
        # moment they are sampled; candidates sampled later need a frozen copy (or the agent without adapters).
        return self.args.dpo_reference == "initial" and self.args.candidates_from == "current"

    def _reference_fix(self) -> str:
        return (
            "candidates_from='initial' (the initial team's candidates carry their reference log-probs: no copy), "
            "or dpo_reference='none'"
        )

    # ------------------------------------------------------------------ one training step
    def training_step(
        self, items: Sequence[Any], seeds: Sequence[int] | None = None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        args, K = self.args, self.args.num_generations
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        if args.candidates_from == "current":
            rollout = self._collect(items, seeds)
            generations, rewards = rollout.generations, rollout.rewards.mean(dim=-1)  # [B, K] team rewards
            ref = None
            metrics.update(rollout_metrics(rollout, self.data))
            generate_seconds = rollout.generate_seconds
        else:
            # The cache is per dataset index: the step trains on the items train() handed it, by their indices.
            if len(self._step_indices) != len(items) or any(
                self.train_dataset[j] != item for j, item in zip(self._step_indices, items)
            ):
                raise ValueError(
                    "MADPO.training_step: with candidates_from='initial' a step takes the cached candidates of the "
                    "dataset items train() gives it; call train(), or set candidates_from='current' to step on "
                    "items of your own"
                )
            if self.candidates is None:
                self.candidates, generate_seconds = self._initial_candidates()
            else:
                generate_seconds = 0.0
            generations, rewards, ref = self._cached(self._step_indices)
        pairs = preference_pairs(
            rewards,
            args.preference_pairs_per_sample,
            args.pair_selection,
            pair_streams(seeds, self.pair_generator),
        )
        # Under data parallelism: over every process's items and pairs.
        totals = {
            "items": float(rewards.shape[0]),
            "reward": float(rewards.sum()) / K,
            "pairs": float(pairs.shape[0]),
            "gap": float((rewards[pairs[:, 0], pairs[:, 1]] - rewards[pairs[:, 0], pairs[:, 2]]).sum()),
        }
        if self.data is not None:
            totals = self.data.sum_values(totals)
        metrics["candidates/reward"] = totals["reward"] / totals["items"]
        metrics["pairs"] = totals["pairs"]
        metrics["pairs/reward_gap"] = totals["gap"] / totals["pairs"] if totals["pairs"] else 0.0
        t1 = time.perf_counter()
        if totals["pairs"]:  # a process whose items gave no pair still takes part in the step
            metrics.update(self.update_team(generations, pairs, K, ref, int(totals["pairs"])))
        t2 = time.perf_counter()
        metrics.update(
            {
                "time/generate": generate_seconds,
                "time/update": t2 - t1,
                "time/step": t2 - t0,
            }
        )
        return metrics, self._pair_samples(generations, rewards, pairs, K)

    def update_team(
        self,
        generations: Sequence[Generation],
        pairs: torch.Tensor,
        K: int,
        ref: Sequence[torch.Tensor | None] | None,
        total_pairs: int | None = None,
    ) -> dict[str, float]:
        """``num_iterations`` DPO steps of every agent this process trains, on ``pairs`` ``[P, 3]`` of
        ``(item, chosen, rejected)`` among the candidates (row ``item * K + k`` of each generation). The loss is the
        mean over ``total_pairs`` (default P; under data parallelism every process's pairs), and so are the metrics."""
        args, P = self.args, pairs.shape[0]
        total = P if total_pairs is None else total_pairs
        chosen, rejected = pairs[:, 0] * K + pairs[:, 1], pairs[:, 0] * K + pairs[:, 2]
        # Only rows in some pair are scored; each once, however many pairs it is in.
        rows, where = torch.unique(torch.cat([chosen, rejected]), return_inverse=True)
        win, lose = where[:P], where[P:]
        # A frozen agent is its own initial policy: its margins are 0 against that reference, and it is not scored.
        fixed = [i for i in self.local if i in args.frozen_agents and args.dpo_reference == "initial"]
        scored = [i for i in self.local if i not in fixed]
        ref_logp = {}
        for i in scored:
            if ref is not None and ref[i] is not None:
                ref_logp[i] = ref[i][rows]
            elif self.references is not None:
                ref_logp[i] = self._sequence_logprobs(i, generations[i], rows, self.references[i])
            else:
                ref_logp[i] = torch.zeros(len(rows))
        metrics: dict[str, float] = {}
        for _ in range(args.num_iterations):
            margins: dict[int, torch.Tensor] = {i: torch.zeros(P) for i in fixed}
            rewards = {}
            for i in scored:
                logp = self._sequence_logprobs(i, generations[i], rows)
                margins[i] = dpo_margins(
                    logp[win], logp[lose], ref_logp[i][win], ref_logp[i][lose], args.dpo_beta
                )
                rewards[i] = args.dpo_beta * (logp - ref_logp[i])  # DPO's implicit reward of each scored row
            if args.dpo_margin == "joint":  # every agent's margin, from whichever process trains it
                margins = self._merged(margins)
                team = torch.stack([margins[j] for j in sorted(margins)]).sum(dim=0)
            sums: dict[str, float] = {}
            for i in self.learning_agents():  # frozen agents' margins still count in the team's
                own = team if args.dpo_margin == "joint" else margins[i]
                # d loss / d m_i per pair, for loss = mean_p -log sigmoid(own_p); m_i moves with
                # +beta log pi_i(w) and -beta log pi_i(l), so each scored row gets one weight.
                dloss = -(1 - torch.sigmoid(own)) / total
                weight = torch.zeros(len(rows)).index_add_(0, win, dloss * args.dpo_beta)
                weight.index_add_(0, lose, -dloss * args.dpo_beta)
                stats = self._dpo_step(i, generations[i], rows, weight)
                metrics.update({f"agent_{i}/{k}": v for k, v in stats.items()})
                sums.update(
                    {
                        f"agent_{i}/loss": float(preference_loss(own).sum()),
                        f"agent_{i}/margin": float(margins[i].sum()),
                        f"agent_{i}/accuracy": float((margins[i] > 0).sum()),
                        f"agent_{i}/chosen_reward": float(rewards[i][win].sum()),
                        f"agent_{i}/rejected_reward": float(rewards[i][lose].sum()),
                    }
                )
            if args.dpo_margin == "joint":
                sums.update(
                    {
                        "loss": float(preference_loss(team).sum()),
                        "margin": float(team.sum()),
                        "accuracy": float((team > 0).sum()),
                    }
                )
        if self.data is not None:
            sums = self.data.sum_values(sums)
        metrics.update({k: v / total for k, v in sums.items()})
        return self._merged(metrics)

    def _dpo_step(
        self, i: int, gen: Generation, rows: torch.Tensor, weight: torch.Tensor
    ) -> dict[str, float]:
        """One optimizer step of agent ``i`` on ``sum_r weight_r log pi_i(row r)``, whose gradient is the DPO
        loss's (the weights are its derivative in each row's log-prob), one micro-batch at a time."""
        args, agent = self.agent_args[i], self.team[i]
        weight = weight.to(agent.device)
        width = gen.prompt_ids.shape[1] + gen.completion_ids.shape[1]
        micro = args.micro_batch_rows(len(rows), width)
        parts = [(rows[s : s + micro], weight[s : s + micro]) for s in range(0, len(rows), micro)]
        # another shard's extra micro-batch: the first candidate, with weight 0
        first = (torch.zeros(1, dtype=torch.long), 0.0)
        for (part_rows, part_weight), _ in self._padded(i, parts, filler=first):
            with self._autocast(i):
                logp = self._row_logprobs(agent, gen, part_rows)
            (part_weight * logp).sum().backward()
        grad_norm, lr = self._apply_gradients(i)
        return {"grad_norm": grad_norm, "lr": lr}

    # ------------------------------------------------------------------ candidates
    def _initial_candidates(self) -> tuple[list[dict[str, Any]], float]:
        """Every training item's candidates from the initial team, with their team rewards and (dpo_reference
        'initial') each agent's log-probs of them, the reference for the whole run. Under data parallelism each
        process samples every world_size-th item, as many per call as in a training step, and then every process
        holds them all. The cache stays on the CPU (the whole training set's ids, outside the agents' device memory);
        :meth:`_cached` moves each step's share to the agents."""
        args, K, size = self.args, self.args.num_generations, len(self.train_dataset)
        cache: dict[int, dict[str, Any]] = {}
        seconds = 0.0
        for chunk in dataset_chunks(size, args.prompts_per_step, self.data, args.shard_weights):
            # item j's draws are keyed (seed, j, 0), "step 0": the same in any process layout
            rollout = self._collect(
                [self.train_dataset[j] for j in chunk], [stream_seed(args.seed, j, 0) for j in chunk]
            )
            seconds += rollout.generate_seconds
            team_rewards = rollout.rewards.mean(dim=-1)
            ref = (
                {
                    i: self._sequence_logprobs(i, rollout.generations[i], torch.arange(len(chunk) * K))
                    for i in self.local
                }
                if args.dpo_reference == "initial"
                else {}
            )
            for b, j in enumerate(chunk):
                block = slice(b * K, (b + 1) * K)
                cache[j] = {
                    "generations": {
                        i: _trimmed(_rows(rollout.generations[i], block)).to("cpu") for i in self.local
                    },
                    "rewards": team_rewards[b].cpu(),
                    # clones: a view would keep (and pickle, under data parallelism) the whole chunk's storage
                    "ref": {i: r[block].clone() for i, r in ref.items()},
                }
        if self.data is not None:  # every process's items
            for part in self.data.gather(cache):
                cache.update({j: c for j, c in part.items() if j not in cache})
        return [cache[j] for j in range(size)], seconds

    def _cached(
        self, indices: Sequence[int]
    ) -> tuple[list[Generation | None], torch.Tensor, list[Any] | None]:
        """The cached candidates of dataset items ``indices`` (on the CPU), stacked as one step's batch on each
        agent's device. The reference log-probs stay on the CPU, where ``_sequence_logprobs`` puts the policy's."""
        parts = [self.candidates[j] for j in indices]  # type: ignore[index]
        generations: list[Generation | None] = [None] * self.num_agents
        for i in self.local:
            generations[i] = concat_generations(
                [p["generations"][i] for p in parts], self.team[i].tokenizer.pad_token_id
            ).to(self.team[i].device)
        ref = None
        if self.args.dpo_reference == "initial":
            ref = [
                torch.cat([p["ref"][i] for p in parts]).float().cpu() if i in self.local else None
                for i in range(self.num_agents)
            ]
        return generations, torch.stack([p["rewards"] for p in parts]), ref

    # ------------------------------------------------------------------ log-probs
    def _row_logprobs(
        self, agent: Agent, gen: Generation, rows: torch.Tensor, model: Any = None
    ) -> torch.Tensor:
        """``log pi(completion | prompt)`` of generation rows ``rows`` at temperature 1 (DPO scores the policy
        itself, whatever temperature sampled the candidates)."""
        rows = rows.to(gen.prompt_ids.device)
        mask = gen.completion_mask[rows]
        per_token = agent.completion_logprobs(
            gen.prompt_ids[rows], gen.prompt_mask[rows], gen.completion_ids[rows], mask, 1.0, model=model
        )
        return sequence_logprobs(per_token, mask)

    @torch.no_grad()
    def _sequence_logprobs(
        self, i: int, gen: Generation, rows: torch.Tensor, model: Any = None
    ) -> torch.Tensor:
        """Agent ``i``'s ``_row_logprobs`` of ``rows`` without gradients, one micro-batch at a time, on the CPU."""
        agent, width = self.team[i], gen.prompt_ids.shape[1] + gen.completion_ids.shape[1]
        micro = self.agent_args[i].micro_batch_rows(len(rows), width)
        parts = []
        batches = [rows[s : s + micro] for s in range(0, len(rows), micro)]
        for scored, real in self._padded(i, batches, filler=torch.zeros(1, dtype=torch.long)):
            with self._autocast(i):
                logp = self._row_logprobs(agent, gen, scored, model)
            if real:
                parts.append(logp.float().cpu())
        return torch.cat(parts) if parts else torch.zeros(0)

    # ------------------------------------------------------------------ state, samples
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            **super().checkpoint_state(),
            "candidates": self.once(self.candidates),  # every shard gathers every item's
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self.candidates = state["candidates"]

    def _pair_samples(
        self, generations: Sequence[Generation | None], rewards: torch.Tensor, pairs: torch.Tensor, K: int
    ) -> list[dict[str, Any]]:
        """The first pair of the first ``log_completions`` items: both joint answers and their team rewards."""
        samples, seen = [], set()
        for b, win, lose in pairs.tolist():
            if b in seen or len(seen) >= self.args.log_completions:
                continue
            seen.add(b)
            samples.append(
                {
                    "chosen": [g.completions[b * K + win] if g is not None else None for g in generations],
                    "rejected": [g.completions[b * K + lose] if g is not None else None for g in generations],
                    "rewards": [float(rewards[b, win]), float(rewards[b, lose])],
                }
            )
        return samples


def pair_streams(
    seeds: Sequence[int] | None, shared: torch.Generator | None = None
) -> list[torch.Generator] | torch.Generator | None:
    """Where :func:`comarl.algorithms.preference_pairs` draws random pairs: item b from a stream keyed (``seeds[b]``,
    3), apart from the streams its answers were sampled from (:func:`comarl.rollout.agent_seed`); without seeds,
    every item from ``shared``."""
    if seeds is None:
        return shared
    return [torch.Generator().manual_seed(stream_seed(seed, 3)) for seed in seeds]


def dataset_chunks(
    size: int, prompts_per_step: int, data: DataParallel | None, sharded: bool = False
) -> list[list[int]]:
    """The dataset indices this process answers when a whole training set is sampled once, one list per batched
    call: all of them, ``prompts_per_step`` at a time; under data parallelism every world_size-th item, as many per
    call as a shard takes in a training step. ``sharded``: the agents are split among the shards
    (``shard_weights``), whose generate calls must then be as many on every shard."""
    indices, per_call = list(range(size)), prompts_per_step
    if data is not None:
        indices, per_call = data.stride(indices), per_call // data.world_size
        first, last = (len(range(d, size, data.world_size)) for d in (0, data.world_size - 1))
        if sharded and -(-first // per_call) != -(-last // per_call):  # the same on every shard, so all stop
            raise ConfigError(
                f"shard_weights=True: the {size} training items give the data shards different numbers of generate "
                f"calls ({per_call} items each) when the team answers the whole set; use a training set of a "
                f"multiple of prompts_per_step={prompts_per_step} items"
            )
    return [indices[s : s + per_call] for s in range(0, len(indices), per_call)]


def _rows(gen: Generation, rows: slice) -> Generation:
    return Generation(
        gen.prompt_ids[rows],
        gen.prompt_mask[rows],
        gen.completion_ids[rows],
        gen.completion_mask[rows],
        gen.prompts[rows],
        gen.completions[rows],
    )


def _trimmed(gen: Generation) -> Generation:
    """``gen`` without the columns of padding its rows share (left of the prompts, right of the completions)."""
    keep_prompt = gen.prompt_mask.any(dim=0).nonzero()
    first = int(keep_prompt[0]) if len(keep_prompt) else gen.prompt_ids.shape[1] - 1
    keep_completion = gen.completion_mask.any(dim=0).nonzero()
    last = int(keep_completion[-1]) + 1 if len(keep_completion) else 1
    return Generation(
        gen.prompt_ids[:, first:].clone(),
        gen.prompt_mask[:, first:].clone(),
        gen.completion_ids[:, :last].clone(),
        gen.completion_mask[:, :last].clone(),
        list(gen.prompts),
        list(gen.completions),
    )


# ---------------------------------------------------------------------------- MARLHF


class RewardModelEnv(Env):
    """The task environment with the team's reward replaced by a reward model's score of the joint answer.

    The task's own rewards stay visible: their team mean as the ``task`` component (logged as
    ``reward/task``), its reward components and its ``success``. Single-turn.
    """

    num_turns = 1

    def __init__(self, task_env: Env, reward_model: CriticModel, batch_size: int = 64) -> None:
        self.task_env, self.reward_model, self.batch_size = task_env, reward_model, batch_size
        self.num_agents = task_env.num_agents
        self.episode: Env | None = None
        self.observations: list[Any] = []

    def fork(self) -> Env:
        """A shallow copy: ``reset`` and ``step`` replace the per-episode attributes (the reward model is shared)."""
        return copy.copy(self)

    def reset(self, item: Any) -> list[Any]:
        self.episode = self.task_env.fork()
        self.observations = list(self.episode.reset(item))
        return list(self.observations)

    def step(self, joint_action: Sequence[str]) -> StepResult:
        """One joint action on this episode (after ``reset``), scored as :meth:`step_many` scores a batch."""
        return self.step_many([self], [[joint_action]])[0][0]

    def step_many(
        self, episodes: Sequence[Env], joint_actions: Sequence[Sequence[Sequence[str]]]
    ) -> list[list[StepResult]]:
        results = self.task_env.step_many([ep.episode for ep in episodes], joint_actions)  # type: ignore[attr-defined]
        texts = [
            joint_observation([prompt_text(o) for o in ep.observations], list(action))  # type: ignore[attr-defined]
            for ep, actions in zip(episodes, joint_actions)
            for action in actions
        ]
        scores = reward_scores(self.reward_model, texts, self.batch_size).tolist()
        flat = [r for row in results for r in row]
        for result, score in zip(flat, scores):
            result.components = {**result.components, "task": sum(result.rewards) / len(result.rewards)}
            result.rewards = [score] * self.num_agents
        return results


@torch.no_grad()
def reward_scores(reward_model: CriticModel, texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    """The reward model's score of each text ``[len(texts)]``, ``batch_size`` texts per forward."""
    parts = [
        reward_model(*reward_model.encode(texts[s : s + batch_size]))[:, 0].float().cpu()
        for s in range(0, len(texts), batch_size)
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


class MARLHFTrainer(MAGRPOTrainer):
    """MARLHF: fit a joint reward model on the team's preference pairs, then MAGRPO on its scores (MARLHFConfig)."""

    config_class = MARLHFConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        a = self.args
        source = a.reward_model or self.team[0].source
        if source is None:
            raise ConfigError("MARLHF: set reward_model= (a hub id or path); agent 0 was given as an object")
        # Every process holds a copy of the reward model (with its first agent, whose device it shares): the copies
        # are fit together (each process scores its share of every batch of pairs, gradients summed), so they stay
        # equal, and each process scores its own joint answers.
        device = self.team[self.local[0]].device
        self.reward_model = CriticModel.from_pretrained(source, outputs=1, device=device)
        self.reward_optimizer = adamw(
            list(self.reward_model.parameters()),
            self._optimizer_group(self.processes),
            lr=a.reward_learning_rate,
            betas=(a.adam_beta1, a.adam_beta2),
            eps=a.adam_epsilon,
            weight_decay=a.weight_decay,
        )
        self.reward_model_fitted = not a.fit_reward_model
        if a.fit_reward_model:  # a size that shard_weights cannot split stops here, not at the fit
            dataset_chunks(len(self.train_dataset), a.prompts_per_step, self.data, a.shard_weights)
        self.env = RewardModelEnv(self.task_env, self.reward_model)
        # The order of the pairs the reward model trains on: the same on every process.
        self.order_generator = torch.Generator().manual_seed(a.seed + 4)

    def _memory_plan(self, members: Sequence[Any], devices: Sequence[str]) -> list[ModelMemory]:
        """The agents' memory and the reward model's (a backbone with a scalar head, trained when it is fit)."""
        a, plan = self.args, super()._memory_plan(members, devices)
        size = model_size(a.reward_model or members[0], lm_head=False)
        if size is not None:  # a copy in every process, on the device of its first agent
            trains = a.fit_reward_model or a.reward_refit_steps > 0
            shards = self._optimizer_shards(self.processes)  # every process holds a copy
            plan.append(
                model_memory(
                    "reward model", devices[self.local[0]], size, trains=trains, optimizer_shards=shards
                )
            )
        return plan

    def training_step(
        self, items: Sequence[Any], seeds: Sequence[int] | None = None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        k = self.args.reward_refit_steps
        refit = k > 0 and self.step > 1 and (self.step - 1) % k == 0
        fitted = self.fit_reward_model() if refit or not self.reward_model_fitted else {}
        metrics, samples = super().training_step(items, seeds)
        return {**fitted, **metrics}, samples

    def fit_reward_model(self, pairs: tuple[Sequence[str], Sequence[str]] | None = None) -> dict[str, float]:
        """Stage 1: preference pairs, and ``reward_num_train_epochs`` passes of the Bradley-Terry loss
        ``-log sigmoid(s_w - s_l)`` over them, ``reward_train_batch_size`` pairs per step.

        ``pairs``: ``(chosen, rejected)`` joint-observation texts (``critics.joint_observation``) to fit on, e.g.
        human preferences; by default the team's candidates on the training set, paired by the task reward. With
        several processes each scores its share of every batch and the gradients are summed, so every copy takes
        the one-process step.
        """
        args, procs = self.args, self.processes
        share = procs.stride if procs is not None else list  # the pairs of a batch this process scores
        chosen, rejected = self._preference_texts() if pairs is None else (list(pairs[0]), list(pairs[1]))
        P = len(chosen)
        if P == 0 or len(rejected) != P:
            raise ConfigError(
                f"MARLHF: {P} chosen and {len(rejected)} rejected texts; the reward model needs pairs to learn from"
                + (
                    f" (every candidate of every training prompt got the same task reward: raise "
                    f"preference_num_candidates, now {args.preference_num_candidates}, or the sampling temperature)"
                    if pairs is None
                    else ""
                )
            )
        model, bs = self.reward_model, args.reward_train_batch_size
        model.train()
        params = list(model.parameters())
        for _ in range(args.reward_num_train_epochs):
            order = torch.randperm(P, generator=self.order_generator).tolist()
            totals = {"loss": 0.0}
            for s in range(0, P, bs):
                batch = order[s : s + bs]
                mine = share(batch)
                if mine:  # a process whose share is empty still takes part in the gradient sum
                    scores = model(*model.encode([chosen[j] for j in mine] + [rejected[j] for j in mine]))[
                        :, 0
                    ]
                    losses = preference_loss(scores[: len(mine)] - scores[len(mine) :])
                    (losses.sum() / len(batch)).backward()
                    totals["loss"] += float(losses.detach().sum())
                sum_and_clip_gradients(params, procs, args.max_grad_norm)
                self.reward_optimizer.step()
                self.reward_optimizer.zero_grad(set_to_none=True)
        model.eval()
        self.reward_model_fitted = True
        mine = share(list(range(P)))
        after = reward_scores(model, [chosen[j] for j in mine]) - reward_scores(
            model, [rejected[j] for j in mine]
        )
        totals["correct"] = float((after > 0).sum())
        if procs is not None:
            totals = procs.sum_values(totals)
        return {
            "reward_model/pairs": float(P),
            "reward_model/loss": totals["loss"] / P,  # the last epoch's, as it trained
            "reward_model/accuracy": totals["correct"] / P,  # after training, on its pairs
        }

    def _preference_texts(self) -> tuple[list[str], list[str]]:
        """The team's ``preference_num_candidates`` answers to every training prompt, paired by the task reward:
        ``(chosen, rejected)`` joint-observation texts, item by item. Item j's draws are keyed (seed, j, step, 1),
        at the step that fits (0 before training). Data shards each answer every world_size-th item, as many per
        call as in a training step, and every process then holds every pair, in the order one process has them."""
        args, K = self.args, self.args.preference_num_candidates
        pairs_of: list[tuple[int, str, str]] = []  # (item, chosen, rejected)
        for chunk in dataset_chunks(
            len(self.train_dataset), args.prompts_per_step, self.data, args.shard_weights
        ):
            items = [self.train_dataset[j] for j in chunk]
            seeds = [stream_seed(args.seed, j, self.step, 1) for j in chunk]
            rollout = collect(
                self.task_env,
                self.team.agents,
                items,
                engine=self.engine,
                num_generations=K,
                params=self._sampling(),
                pool=self.pool,
                parallel=self.parallel,
                shards=self._weight_shards(),  # one turn and equal chunks already keep them in step; as _collect
                seeds=seeds,
            )
            rewards = rollout.rewards.mean(dim=-1)
            pairs = preference_pairs(
                rewards, args.preference_pairs_per_sample, args.pair_selection, pair_streams(seeds)
            )
            for b, win, lose in pairs.tolist():
                observations = [prompt_text(o) for o in rollout.states[b][1]]
                answer = [[g.completions[b * K + k] for g in rollout.generations] for k in (win, lose)]
                pairs_of.append(
                    (
                        chunk[b],
                        joint_observation(observations, answer[0]),
                        joint_observation(observations, answer[1]),
                    )
                )
        # Every shard's pairs, item by item (sorted is stable: an item's pairs keep their order).
        if self.data is not None:
            pairs_of = sorted((p for part in self.data.gather(pairs_of) for p in part), key=lambda p: p[0])
        return [c for _, c, _ in pairs_of], [r for _, _, r in pairs_of]

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            **super().checkpoint_state(),
            "reward_model": self.once(self.reward_model.state_dict()),
            "reward_optimizer": self.once(
                optimizer_state(self.reward_optimizer), is_sharded(self.reward_optimizer)
            ),
            "reward_model_fitted": self.reward_model_fitted,
            "pair_order": self.order_generator.get_state(),
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self.reward_model.load_state_dict(state["reward_model"])
        load_optimizer_state(self.reward_optimizer, state["reward_optimizer"], "the reward model")
        self.reward_model_fitted = state["reward_model_fitted"]
        self.order_generator.set_state(state["pair_order"])

    def save_model(self, output_dir: str | Path) -> None:
        """The agents (``agent_i/``) and the reward model (``reward_model/``, reloadable with
        ``reward_model=<that folder>, fit_reward_model=False``)."""
        super().save_model(output_dir)
        if self.processes is None or self.processes.rank == 0:  # the copies are equal: process 0 saves it
            self.reward_model.save(Path(output_dir) / "reward_model")
