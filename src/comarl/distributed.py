"""Agent parallelism on ``torch.distributed``: one process per agent, launched with torchrun.

Rank ``i`` holds and trains agent ``i`` only. At every turn each process generates its own agent's
completions, then one ``all_gather_object`` gives every process every agent's completions, so
each plays the same joint actions in its own copy of the environment and computes the same
rewards and advantages; each process then updates its own agent, and the per-agent metrics are
gathered once per step. Agents therefore generate and update concurrently (separate GPUs, or
separate CPU cores), and no process loads another agent's weights.

Launch (NCCL when every process has its own GPU, else gloo)::

    torchrun --nproc-per-node=2 -m comarl train config.yaml --set args.agent_parallel=true

Environments must be deterministic given the same joint actions (every process steps its own
copy); ``check_same`` stops a run whose processes disagree instead of letting it deadlock.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from comarl.config import ConfigError


@dataclass
class RemoteAgent:
    """An agent trained by another process: here only its tokenizer (for padding) and its description."""

    tokenizer: Any
    source: str | None = None
    role: str | None = None
    learning_rate: float | None = None


class _Processes:
    """What every launch mode shares: this process's rank, the world size, object gathers and barriers."""

    rank: int
    world_size: int
    _dist: Any

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order."""
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        self._dist.barrier()

    def sum_values(self, values: dict[str, float]) -> dict[str, float]:
        """Each value of ``values`` summed over the processes (every process passes the same keys)."""
        parts = self.gather(values)
        return {k: sum(part[k] for part in parts) for k in values}

    def all_reduce_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Sum every parameter's gradient over the processes, in one flat buffer (one collective per call)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()


class AgentParallel(_Processes):
    """This process's place in a team run with one process per agent (``rank`` = the agent it trains)."""

    def __init__(self, num_agents: int) -> None:
        dist = _process_group(
            f"agent_parallel=True needs one process per agent: launch with `torchrun --nproc-per-node={num_agents} ...`"
        )
        if dist.get_world_size() != num_agents:
            raise ConfigError(
                f"agent_parallel=True: the world has {dist.get_world_size()} processes for {num_agents} agents; "
                f"launch with --nproc-per-node={num_agents}"
            )
        self.rank = dist.get_rank()
        self.world_size = num_agents
        self._dist = dist

    def device(self, devices: Sequence[str]) -> str:
        """This rank's device: its entry of ``devices``, or ``cuda:LOCAL_RANK`` when agents share 'cuda'."""
        device = devices[self.rank]
        if device == "cuda":
            return f"cuda:{int(os.environ.get('LOCAL_RANK', self.rank))}"
        return device

    def generate_all(
        self,
        engine: Any,
        agents: Sequence[Any],
        prompts: Sequence[Sequence[Any]],
        num_generations: int,
        params: Sequence[Any],
    ) -> list[Any]:
        """This rank generates for its agent (sampling by ``params[rank]``); every rank receives every agent's
        ``Generation`` (on the CPU)."""
        own = engine.generate(agents[self.rank], prompts[self.rank], num_generations, params[self.rank])
        gathered = self.gather(own.to("cpu"))  # what all_gather_object sends
        gathered[self.rank] = own
        return gathered

    def check_same(self, what: str, obj: Any) -> None:
        """Stop with a clear error when ranks hold different ``obj`` (e.g. rewards of a non-deterministic env)."""
        digest = hashlib.sha256(pickle.dumps(obj)).hexdigest()
        digests = self.gather(digest)
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"agent_parallel: the processes computed different {what} (by rank: {digests}); the environment "
                "and reward must be deterministic given the joint actions, since every process steps its own copy"
            )


class DataParallel(_Processes):
    """Data parallelism: every process holds the whole team and takes its shard of each step's prompts.

    Each process generates, plays and scores its shard; advantages come from every process's returns
    (so batch-wide statistics stay batch-wide); the loss is normalised over the whole batch and the
    gradients are summed across processes before each optimizer step, so the step equals one process's
    step on all the prompts, and the weights stay identical everywhere.
    """

    def __init__(self) -> None:
        dist = _process_group(
            "data_parallel=True needs its processes: launch with `torchrun --nproc-per-node=N ...`"
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._dist = dist

    def device(self, devices: Sequence[str]) -> list[str]:
        """This process's copy of the team on its own GPU (``cuda:LOCAL_RANK``) when the agents are on GPUs."""
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        return [f"cuda:{local}" if str(d).startswith("cuda") else d for d in devices]

    def shard(self, items: Sequence[Any]) -> list[Any]:
        """This process's contiguous share of ``items`` (their count is a multiple of the world size)."""
        size = len(items) // self.world_size
        return list(items[self.rank * size : (self.rank + 1) * size])


def _process_group(launch_hint: str) -> Any:
    """``torch.distributed``, with the default process group initialised from torchrun's environment."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError(f"{launch_hint} (or initialise torch.distributed yourself)")
        backend = _backend(int(os.environ["WORLD_SIZE"]))
        if backend == "nccl":  # NCCL's object gathers stage through the current device: one GPU per rank
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group(backend=backend)
        # A group left open hangs the interpreter's exit (gloo); the group we opened we also close.
        atexit.register(dist.destroy_process_group)
    return dist


def _backend(world_size: int) -> str:
    """NCCL when every process has a GPU of its own; else gloo (CPU, or processes sharing a GPU — only
    token ids and texts cross processes, through the CPU either way)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def save_own_model(model: Any, path: Any) -> None:
    """``model.save_pretrained(path)`` from any rank (in a single process: exactly ``save_pretrained``).

    Once torch.distributed is initialised, transformers writes weights only on rank 0
    (``should_save_on_this_rank``: it assumes every rank holds a shard of one model); here every rank
    owns a different agent, so the check is lifted for this one call.
    """
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        model.save_pretrained(path)
    finally:
        del model.should_save_on_this_rank
