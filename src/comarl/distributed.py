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
import math
import os
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from comarl.config import ConfigError


@dataclass
class RemoteAgent:
    """An agent trained by another process: here only its tokenizer (for padding) and its description."""

    tokenizer: Any
    source: str | None = None
    role: str | None = None
    learning_rate: float | None = None


class Processes:
    """A set of processes of the run and this process's place among them: rank, size, object gathers, barriers and
    gradient sums over them. ``group`` is a torch.distributed process group (None: every process of the run)."""

    def __init__(self, dist: Any, rank: int, world_size: int, group: Any = None) -> None:
        self._dist, self.rank, self.world_size, self.group = dist, rank, world_size, group

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order."""
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def stride(self, items: Sequence[Any]) -> list[Any]:
        """This process's share of ``items``: every world_size-th, from its rank."""
        return list(items[self.rank :: self.world_size])

    def sum_values(self, values: dict[str, float]) -> dict[str, float]:
        """Each value of ``values`` summed over the processes (every process passes the same keys)."""
        parts = self.gather(values)
        return {k: sum(part[k] for part in parts) for k in values}

    def all_reduce_grads(self, params: Sequence[torch.Tensor], bucket_elements: int = 1 << 25) -> None:
        """Sum every parameter's gradient over the processes, in place, through flat buckets of about
        ``bucket_elements`` values (one collective per bucket; one for a small model). A bucket bounds the extra
        memory to its own size: one flat copy of every gradient would double the gradients' memory."""
        for p in params:
            if p.grad is None:  # another process may have a gradient for it
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for k, p in enumerate(params):
            bucket.append(p.grad)
            size += p.grad.numel()
            if k == len(params) - 1 or size >= bucket_elements:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                self._dist.all_reduce(flat, group=self.group)
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
                bucket, size = [], 0


class AgentParallel(Processes):
    """This process's place among the processes that play one episode together, one per agent (``rank`` = the
    agent it trains). Alone, they are the whole run; with data parallelism, one data shard's processes."""

    def device(self, devices: Sequence[str]) -> str:
        """This rank's device: its entry of ``devices``, or this process's GPU (:func:`local_gpu`) when agents
        share 'cuda'."""
        device = devices[self.rank]
        return local_gpu(self.rank) if device == "cuda" else device

    def generate_all(
        self,
        engine: Any,
        agents: Sequence[Any],
        prompts: Sequence[Sequence[Any]],
        num_generations: int,
        params: Sequence[Any],
        seeds: Sequence[Sequence[int]] | None = None,
    ) -> list[Any]:
        """This rank generates for its agent (sampling by ``params[rank]``, from ``seeds[rank]`` when given); every
        rank receives every agent's ``Generation`` (on the CPU)."""
        own = engine.generate(
            agents[self.rank],
            prompts[self.rank],
            num_generations,
            params[self.rank],
            None if seeds is None else seeds[self.rank],
        )
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


class DataParallel(Processes):
    """Data parallelism: every process holds the whole team and takes its shard of each step's prompts.

    Each process generates, plays and scores its shard; advantages come from every process's returns
    (so batch-wide statistics stay batch-wide); the loss is normalised over the whole batch and the
    gradients are summed across processes before each optimizer step, so the step equals one process's
    step on all the prompts, and the weights stay identical everywhere. With agent parallelism too, these
    are the processes that hold one agent (``rank`` = the shard), and "the whole team" is that agent.
    """

    def device(self, devices: Sequence[str]) -> list[str]:
        """This process's copy of the team on its own GPU (:func:`local_gpu`) when the agents are on GPUs."""
        return [local_gpu(self.rank) if _is_gpu(d) else d for d in devices]

    def shard(self, items: Sequence[Any]) -> list[Any]:
        """This process's contiguous share of ``items`` (their count is a multiple of the world size)."""
        size = len(items) // self.world_size
        return list(items[self.rank * size : (self.rank + 1) * size])

    def shard_model(self, model: Any, frozen: bool = False) -> Any:
        """``model`` split among these processes (``shard_weights``, FSDP2's ``fully_shard``): each keeps 1/D of
        every weight, and of its gradient and AdamW state. Every decoder layer (the classes the model names in
        ``_no_split_modules``) is one unit, gathered for its forward and backward, then the rest of the model.
        Gradients reach each shard summed over the processes, not averaged: the trainers' losses are already
        normalised over the whole batch, as the flat all-reduce of unsharded copies assumes. ``frozen``: a model
        that never runs a backward (a KL reference), whose root is also freed after each forward (FSDP2 frees the
        root's gathered weights after the backward, otherwise never). Returns ``model`` itself (fully_shard changes
        it in place)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        group = self.group if self.group is not None else self._dist.group.WORLD
        device = next(model.parameters()).device
        mesh = DeviceMesh.from_group(group, device_type=device.type)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA adapters
        layers = set(getattr(base, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module, mesh=mesh, reshard_after_forward=True)
        # FSDP2's rule for the root: kept whole from the forward to the backward, which frees it
        fully_shard(model, mesh=mesh, reshard_after_forward=frozen)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # A sum: no division by D, and gloo has no pre-multiplied sum (the only kind NCCL needs no copy for).
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model


def sum_and_clip_gradients(
    params: Sequence[torch.Tensor], copies: Processes | None, max_norm: float | None
) -> float:
    """The batch's gradient of ``params``, clipped to ``max_norm`` (None: not clipped); returns its norm before
    clipping. ``copies``: the processes holding copies of them, whose gradients are summed first (one flat
    all-reduce). Parameters sharded by ``DataParallel.shard_model`` arrive summed by their reduce-scatter; the
    norm then adds the squares of both kinds, ``sqrt(|g_whole|^2 + |g_sharded|^2)``, and every gradient is scaled
    by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s rule, which cannot mix the two kinds)."""
    sharded = [p for p in params if _is_shard(p)]
    whole = [p for p in params if not _is_shard(p)]
    if copies is not None and whole:
        copies.all_reduce_grads(whole)
    if not sharded:
        return float(torch.nn.utils.clip_grad_norm_(whole, max_norm if max_norm is not None else math.inf))
    grads = [p.grad for p in sharded if p.grad is not None]
    squares = float(torch.nn.utils.get_total_norm(grads).full_tensor()) ** 2 if grads else 0.0
    whole_grads = [p.grad for p in whole if p.grad is not None]
    if whole_grads:
        squares += float(torch.nn.utils.get_total_norm(whole_grads)) ** 2
    norm = math.sqrt(squares)
    if max_norm is not None and norm + 1e-6 > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads + whole_grads:
            g.mul_(scale)
    return norm


def local_gpu(rank: int) -> str:
    """``cuda:LOCAL_RANK``, wrapped around this machine's GPU count: processes outnumbering the GPUs share them."""
    return f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % max(torch.cuda.device_count(), 1)}"


def _is_shard(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a share of a sharded one (a DTensor); DTensor's module loads only in distributed runs."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def launch(
    num_agents: int,
    agent_parallel: bool,
    data_parallel: bool,
    devices: Sequence[str],
    shard_weights: bool = False,
) -> tuple[AgentParallel | None, DataParallel | None, Processes | None]:
    """``(agents, shards, everyone)``: this process's :class:`AgentParallel`, :class:`DataParallel` and all the run's
    processes, each None when that mode is off (all three None in a single-process run). ``devices``: every
    agent's device, the same list in every process (they pick the backend, see :func:`_process_group`);
    ``shard_weights``: whether FSDP2 will split the agents, which on GPUs needs NCCL.

    Both modes together form a grid of ``num_agents x D`` processes: global rank ``d * num_agents + i`` trains
    agent ``i`` on data shard ``d``; the processes of shard d play episodes together, those of agent i sum
    their gradients.
    """
    if not (agent_parallel or data_parallel):
        _refuse_a_world_without_a_mode()
        return None, None, None
    per_shard = num_agents if agent_parallel else 1
    if agent_parallel and not data_parallel:
        hint = f"agent_parallel=True needs one process per agent: launch with `torchrun --nproc-per-node={num_agents} ...`"
    else:
        hint = "data_parallel=True needs its processes: launch with `torchrun --nproc-per-node=N ...`"
    dist = _process_group(hint, devices)
    world, rank = dist.get_world_size(), dist.get_rank()
    # gloo has no all-gather or reduce-scatter of CUDA tensors, FSDP2's two collectives. (The backend config of a
    # group opened without a backend is "cpu:gloo,cuda:nccl": CUDA tensors go to NCCL there.)
    if shard_weights and any(map(_is_gpu, devices)) and "nccl" not in dist.get_backend_config():
        raise ConfigError(
            f"shard_weights=True with agents on GPUs needs NCCL, one GPU per process and every agent on a GPU; this "
            f"run's process group is {dist.get_backend_config()} (agent_devices={list(devices)}, "
            f"{_gpu_count()} for {os.environ.get('LOCAL_WORLD_SIZE', world)} processes on this machine). Launch at most one process per GPU with every agent on a GPU, or set shard_weights=False "
            "(shard_optimizer=True still splits AdamW's state)"
        )
    if agent_parallel and not data_parallel and world != num_agents:
        raise ConfigError(
            f"agent_parallel=True: the world has {world} processes for {num_agents} agents; "
            f"launch with --nproc-per-node={num_agents}"
        )
    if world % per_shard:
        raise ConfigError(
            f"agent_parallel=True and data_parallel=True: the world has {world} processes, not a multiple of the "
            f"{num_agents} agents; launch num_agents x (data shards) processes"
        )
    shards = world // per_shard if data_parallel else 1
    episode_group = agent_group = None  # None: the whole world
    if agent_parallel and data_parallel:
        # Every process creates every group, in the same order (torch.distributed's rule).
        episode_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(d * per_shard, (d + 1) * per_shard)) for d in range(shards)]
        )
        agent_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(i, world, per_shard)) for i in range(per_shard)]
        )
    agents = AgentParallel(dist, rank % per_shard, per_shard, episode_group) if agent_parallel else None
    data = DataParallel(dist, rank // per_shard, shards, agent_group) if data_parallel else None
    return agents, data, Processes(dist, rank, world)


def _refuse_a_world_without_a_mode() -> None:
    """Stop a run launched as several processes (torchrun's WORLD_SIZE, or a process group already open) with neither
    mode on: every process would train the whole team on every prompt and write the same output_dir at once."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    if world > 1:
        raise ConfigError(
            f"this process is one of {world} (torchrun, or a process group already open), but "
            "agent_parallel=False and data_parallel=False: every process would train the whole team on every prompt "
            "and write the same output_dir. Set agent_parallel=True (one process per agent) or data_parallel=True "
            "(one per data shard), or run a single process without torchrun"
        )


def _is_gpu(device: Any) -> bool:
    return str(device).startswith("cuda")


def _gpu_count() -> str:
    """How many GPUs this machine shows, in words for error messages ("no GPU", "1 GPU", "4 GPUs")."""
    count = torch.cuda.device_count()
    return "no GPU" if count == 0 else f"{count} GPU" + ("s" if count > 1 else "")


def _process_group(launch_hint: str, devices: Sequence[str] = ()) -> Any:
    """``torch.distributed``, with the default process group initialised from torchrun's environment: its backend
    from the agents' ``devices`` (:func:`_backend`), and, when any agent is on a GPU, this process's GPU
    (:func:`local_gpu`) made the current CUDA device. A group the caller opened is used as it is."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError(f"{launch_hint} (or initialise torch.distributed yourself)")
        processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        backend = _backend(processes_here, on_gpus=bool(devices) and all(map(_is_gpu, devices)))
        if any(map(_is_gpu, devices)) and torch.cuda.is_available():
            # NCCL's object gathers stage through the current device; FSDP2 and CUDA's defaults use it too.
            torch.cuda.set_device(local_gpu(int(os.environ["RANK"])))
        dist.init_process_group(backend=backend)
        # A group left open hangs the interpreter's exit (gloo); the group we opened we also close.
        atexit.register(_close_process_group)
    return dist


def _close_process_group() -> None:
    """Destroy the default process group and every subgroup, unless the caller already did."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def finish(exit_code: int = 0) -> NoReturn:
    """End a process of a distributed run whose work is done: wait for every process, destroy the process
    groups, flush the output and leave at once with ``exit_code`` (``os._exit``).

    Why not a normal exit: it could abort a finished run ("terminate called without an active exception", exit
    -6). Once ``torch._dynamo`` is imported (FSDP2 and transformers import it), the gloo group's worker threads
    outlive ``destroy_process_group`` and are torn down during the interpreter's finalization, where (most likely)
    a thread that touches Python is stopped by ``pthread_exit`` (through C++ frames: ``std::terminate``).
    ``os._exit`` skips that teardown. atexit handlers do not run: call it last, after the trainer has closed its
    trackers (``train()`` does). ``comarl train`` calls it under torchrun.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # no process leaves while another still exchanges with it
    _close_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _backend(processes_here: int, on_gpus: bool) -> str:
    """NCCL when every agent trains on a GPU (``on_gpus``) and each of the ``processes_here`` processes on this
    machine (torchrun's LOCAL_WORLD_SIZE; on several nodes the world is larger) has a GPU of its own; else gloo
    (an agent on the CPU, whose gradients NCCL cannot sum, or processes sharing a GPU; gloo sums CUDA gradients
    too, and only token ids and texts cross processes otherwise, through the CPU either way)."""
    return (
        "nccl"
        if on_gpus and torch.cuda.is_available() and torch.cuda.device_count() >= processes_here
        else "gloo"
    )


def save_own_model(model: Any, path: Any, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """``model.save_pretrained(path)`` from any rank (in a single process: exactly ``save_pretrained``);
    ``state_dict``: the weights to write, for a sharded model (:func:`whole_state_dict`).

    Once torch.distributed is initialised, transformers writes weights only on rank 0
    (``should_save_on_this_rank``: it assumes every rank holds a shard of one model); here every rank
    owns a different agent, so the check is lifted for this one call.
    """
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        if state_dict is None:
            model.save_pretrained(path)
        else:
            model.save_pretrained(path, state_dict=state_dict)
    finally:
        del model.should_save_on_this_rank


def whole_state_dict(model: Any, keep: bool) -> dict[str, torch.Tensor] | None:
    """The whole weights of a model sharded by :meth:`DataParallel.shard_model`, on the CPU, where ``keep`` (an
    empty dict elsewhere). Every process holding a share must call it: each tensor is gathered over the model's
    own group, one at a time, so a process that does not keep them never holds more than one. Of a model with LoRA
    adapters only the trainable tensors (what ``save_pretrained`` writes of it), not the base. None for a model
    that is not sharded."""
    if not any(_is_shard(p) for p in model.parameters()):
        return None
    adapters = (
        {n for n, p in model.named_parameters() if p.requires_grad} if hasattr(model, "peft_config") else None
    )
    weights: dict[str, torch.Tensor] = {}
    # By tensor: tied weights (embeddings and LM head) are gathered once and kept as one tensor under each name,
    # which save_pretrained writes once, as it does for the model itself.
    gathered: dict[int, torch.Tensor | None] = {}
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():
            if adapters is not None and name not in adapters:
                continue
            if id(value) not in gathered:
                whole = value.full_tensor() if _is_shard(value) else value
                gathered[id(value)] = whole.detach().cpu() if keep else None
            if keep:
                weights[name] = gathered[id(value)]
    return weights
