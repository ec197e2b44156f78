"""Will the team fit? The static training memory of every device, estimated before any weights load.

Training keeps, per agent: fp32 weights (the AdamW master copy), a fp32 gradient and AdamW's two
fp32 moments for every trainable parameter, with ``beta > 0`` and no LoRA a frozen fp32 copy of
the starting weights as the KL reference, and with ``bf16=True`` the bf16 copies of the weights that
autocast keeps while a forward runs. Parameters are counted on the meta device (the model's config is
read, never its weights). Activations and the KV cache of generation come on top, so a device whose
free memory is below this static total cannot train the team, and the run stops before loading
anything. Processes may share a device (a GPU, a machine's memory): each checks the models of all of
them on its own devices (:func:`sharing_devices`).

Also here: :func:`keep_freed_memory`, the malloc setting that spares a CPU training step its page faults.
"""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from comarl.config import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of one agent's model: all of them, those the optimizer trains, and those in the weights
    that comarl's decode step may pack while it generates on the CPU in fp32 (``llama_decoder.packable_layers``;
    0 for a model it does not serve, or where this machine's CPU does not pack). Counted whether or not packing
    pays at the time (``llama_decoder.packing_pays``), so the plan holds either way."""

    parameters: int
    trainable: int
    packed: int = 0


@dataclass(frozen=True)
class ModelMemory:
    """The static training memory of one model (an agent or a critic) on its device, in bytes.

    ``weights = 4 P`` (P parameters, fp32; only the adapters' for an agent that shares another's base),
    ``gradients = 4 T`` and ``optimizer = 8 T`` (T trainable parameters; AdamW's two moments),
    ``reference = 4 P`` (the KL reference copy, kept only for full fine-tuning), ``autocast = 2 W`` under bf16
    autocast, which caches a bf16 copy of every weight that requires gradients while a forward runs (W: all P
    weights of a fully fine-tuned or frozen model, only the adapters of a LoRA one, whose frozen base is not
    cached: a training forward keeps its casts for the backward, like activations, which are not counted). A model
    split among D processes (``shard_weights``) holds each of these / D, except the autocast copies of its gathered
    whole weights, and ``gathered = 4 P``: its whole weights, assembled for every generate call. ``packed``:
    the packed copy of its projection weights that comarl's decode step holds while the model generates on the
    CPU in fp32 where packing pays (``llama_decoder.packed_weights``; counted either way), less its gradients,
    which are freed then (0 for a fully fine-tuned model). These last three are held only while the model runs:
    a device counts them once per process (:func:`device_need`), for the models of one process on one device take
    turns. ``process``: the rank of the process that holds the model.
    """

    name: str
    device: str
    weights: int
    gradients: int
    optimizer: int
    reference: int
    gathered: int = 0
    autocast: int = 0
    packed: int = 0
    process: int = 0

    @property
    def transient(self) -> int:
        """The bytes held only while the model runs: gathered weights, autocast casts, packed weights."""
        return self.gathered + self.autocast + self.packed

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference + self.transient


def model_size(
    source: Any, lora: tuple[int, float, list[str] | str] | None = None, lm_head: bool = True
) -> ModelSize | None:
    """Count the parameters of the model that a hub id or local path names, without loading its weights.

    The model (a causal LM, or with ``lm_head=False`` the bare backbone a critic loads) is built
    from its config on the meta device; ``lora = (r, alpha, target_modules)`` wraps it with peft as
    training would, so ``trainable`` counts the adapters only; a saved LoRA agent (an adapter folder) counts its base
    with the saved adapter, which is what then trains, whatever ``lora`` says. None for a model object (it is already in
    memory) and when the config cannot be read or built here (a model with custom code, a hub id without
    network): the model is then not counted, and loading it reports the real error.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if not isinstance(source, (str, Path)):
        return None
    try:
        from comarl.agents import add_lora, is_adapter_folder

        adapter = None
        if is_adapter_folder(str(source), {}):
            # A saved LoRA agent: its base with the saved adapter, which is what trains (Agent.from_pretrained).
            from peft import PeftConfig, get_peft_model

            adapter = PeftConfig.from_pretrained(str(source))
            adapter.inference_mode = False  # saved for inference; training makes it trainable
            source = adapter.base_model_name_or_path
        config = AutoConfig.from_pretrained(str(source))
        with torch.device("meta"):
            model = (AutoModelForCausalLM if lm_head else AutoModel).from_config(config)
        # Tied embeddings are one parameter, as in the loaded model (transformers 5.0 ties them only
        # when weights load, so a model built from its config would count its LM head twice).
        model.tie_weights()
        if adapter is not None and lm_head:
            model = get_peft_model(model, adapter)
        elif lora is not None:
            model = add_lora(model, *lora)
    except ConfigError:  # lora_target_modules that match nothing: stop before any weights load
        raise
    except Exception:  # the check is advisory; never stop a run that loading would let through
        return None
    parameters = sum(p.numel() for p in model.parameters())
    trainable = (
        sum(p.numel() for p in model.parameters() if p.requires_grad)
        if lora is not None or (adapter is not None and lm_head)
        else parameters
    )
    from comarl.llama_decoder import cpu_packing_available, packable_layers, unsupported_reason

    model.eval()  # as the engine generates
    decodes = lm_head and cpu_packing_available() and unsupported_reason(model) is None
    packed = sum(layer.weight.numel() for layer in packable_layers(model)) if decodes else 0
    return ModelSize(parameters, trainable, packed)


def model_memory(
    name: str,
    device: str,
    size: ModelSize,
    *,
    owns_weights: bool = True,
    trains: bool = True,
    reference: bool = False,
    optimizer_shards: int = 1,
    weight_shards: int = 1,
    bf16: bool = False,
    generates_on_cpu: bool = False,
) -> ModelMemory:
    """The bytes of one model: see :class:`ModelMemory`. ``trains=False``: frozen (no gradients or optimizer
    state); ``owns_weights=False``: the base weights are another agent's (a shared LoRA base: only its own
    adapters count, trained or not); ``reference``: a frozen copy of the weights is kept;
    ``optimizer_shards``: the processes that share its AdamW state (``shard_optimizer``), each holding a share;
    ``weight_shards``: the processes among which the whole model is split (``shard_weights``); ``bf16``: its
    forwards run under bf16 autocast; ``generates_on_cpu``: it generates on the CPU, whose decode step packs its
    weights in fp32 (not under bf16, nor for a split model, whose layers it leaves to the model's forward)."""
    trainable = size.trainable if trains else 0
    D = weight_shards

    def share(n: int) -> int:
        return -(-n // D)  # rounded up

    return ModelMemory(
        name=name,
        device=device,
        weights=share(4 * (size.parameters if owns_weights else size.trainable)),
        gradients=share(4 * trainable),
        optimizer=share(-(-8 * trainable // optimizer_shards)),
        reference=share(4 * size.parameters) if reference else 0,
        gathered=4 * size.parameters if D > 1 else 0,
        # size.trainable: the weights that require gradients, trained or not (a frozen agent's still do). Not
        # divided among shards: FSDP2 gathers whole weights that require gradients, and autocast caches their casts.
        autocast=2 * size.trainable if bf16 else 0,
        # Generation comes after the optimizer step has freed the gradients: the packed copy needs only what exceeds them.
        packed=max(0, 4 * size.packed - share(4 * trainable))
        if generates_on_cpu and not bf16 and D == 1
        else 0,
    )


def canonical_device(device: str) -> str:
    """One name per device of this process: ``cpu`` for any CPU name (``cpu:0``), ``cuda:<index>`` for ``cuda``
    (the current GPU), so that two names of one memory are checked together."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda" and dev.index is None:
        return f"cuda:{torch.cuda.current_device() if torch.cuda.is_available() else 0}"
    return str(dev)


def device_identity(device: str) -> str:
    """What names one physical device across processes: a GPU's UUID (each process may number its GPUs its own way,
    e.g. under per-process ``CUDA_VISIBLE_DEVICES``), else the host name and the device (a machine's CPU memory)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return f"gpu {torch.cuda.get_device_properties(dev).uuid}"
    return f"{socket.gethostname()} {dev.type}"


def sharing_devices(parts: Sequence[Sequence[tuple[str, ModelMemory]]], rank: int) -> list[ModelMemory]:
    """The models that every process of a run places on the devices of process ``rank``: ``parts[r]`` is process
    r's plan, each model with its device's :func:`device_identity`. Processes that share a device (a GPU, a
    machine's memory) must each check all the models on it: each alone would see its own fit. Another process's
    models are named with its rank and given this process's name of the device."""
    here = {identity: m.device for identity, m in parts[rank]}
    return [
        replace(m, process=r)
        if r == rank
        else replace(m, name=f"{m.name} (process {r})", device=here[identity], process=r)
        for r, plan in enumerate(parts)
        for identity, m in plan
        if identity in here
    ]


def free_memory(device: str) -> int | None:
    """Bytes free on ``device`` now: CUDA's free memory, or the host's ``MemAvailable`` for the CPU; None if unknown."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(dev)[0]
    if dev.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit systems
# (DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB x sizeof(long)).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20
TRIM_THRESHOLD = 2**30


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory that freed tensors leave for the next ones, instead of handing it back to
    the OS; True where it applied, False where the C library is not glibc (macOS, musl: nothing to do).

    Why: glibc serves every allocation above its mmap threshold (128 KiB at start, raised on the fly to the largest
    block freed) with fresh pages from the OS, and gives back the heap's free top beyond twice that. A training step
    on the CPU frees its activations and logits and takes fresh zeroed pages for the next step's, one page fault per
    4 KiB: 5,000 faults per step in the benchmark's peer mode, 12,000-22,000 in batched mode. With the mmap threshold
    at glibc's maximum (32 MiB) and the trim threshold at 1 GiB (``mallopt``, what the environment variables
    ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set at start-up), blocks up to 32 MiB come from the heap
    and stay there once freed: ~200 faults per step, a peer-mode step 5-8 % faster (docs/benchmarks.md). The memory
    kept is memory the process has used, so its peak resident size stays what it was (the same on the benchmark).
    Process-wide, for the rest of the process (malloc has no per-caller setting); larger blocks keep their own pages
    as before.
    """
    try:
        libc_version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):  # no such name outside glibc systems
        return False
    if not libc_version or not libc_version.startswith("glibc"):
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols: glibc's mallopt
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def device_need(models: Sequence[ModelMemory]) -> int:
    """The bytes the ``models`` on one device need at once: every model's static memory, and per process the largest
    of its models' copies held only while a model runs (gathered weights, autocast casts, packed weights): the
    agents of one process on one device take turns; those of different processes run at the same time."""
    largest: dict[int, int] = {}
    for m in models:
        largest[m.process] = max(largest.get(m.process, 0), m.transient)
    return sum(m.total - m.transient for m in models) + sum(largest.values())


def by_device(plan: Sequence[ModelMemory]) -> dict[str, list[ModelMemory]]:
    """The plan's models grouped by device, in the order the devices first appear."""
    groups: dict[str, list[ModelMemory]] = {}
    for m in plan:
        groups.setdefault(m.device, []).append(m)
    return groups


def summary(plan: Sequence[ModelMemory], free: dict[str, int | None]) -> str:
    """One line per run: each device's static training memory and its free memory, e.g.
    ``static training memory (before activations): cuda:0 46.0 GiB of 79.2 GiB free, cuda:1 46.0 GiB of 79.2 GiB
    free`` (MiB below a tenth of a GiB)."""

    def amount(n: int) -> str:
        return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.0f} MiB"

    parts = []
    for device, on_device in by_device(plan).items():
        need, have = amount(device_need(on_device)), free.get(device)
        parts.append(f"{device} {need} of {amount(have)} free" if have is not None else f"{device} {need}")
    return "static training memory (before activations): " + ", ".join(parts)


def check_fits(plan: Sequence[ModelMemory], free: dict[str, int | None], fixes: Sequence[str]) -> None:
    """Raise ConfigError naming the device, the models on it, their bytes and ``fixes`` when a device's models need
    more than its ``free`` bytes (a device whose free memory is unknown is not checked)."""
    for device, on_device in by_device(plan).items():
        need, have = device_need(on_device), free.get(device)
        if have is None or need <= have:
            continue
        parts = "; ".join(
            f"{m.name}: weights {m.weights / GIB:.1f}, gradients {m.gradients / GIB:.1f}, "
            f"AdamW states {m.optimizer / GIB:.1f}, KL reference {m.reference / GIB:.1f}"
            + (f", whole weights while generating {m.gathered / GIB:.1f}" if m.gathered else "")
            + (f", bf16 autocast copies {m.autocast / GIB:.1f}" if m.autocast else "")
            + (f", packed weights while generating {m.packed / GIB:.1f}" if m.packed else "")
            for m in on_device
        )
        raise ConfigError(
            f"the team does not fit on {device}: it needs at least {need / GIB:.1f} GiB there before activations "
            f"({parts}; in GiB), and {device} has {have / GIB:.1f} GiB free. Fixes: {'; '.join(fixes)}; "
            "or check_memory=False to skip this check"
        )
