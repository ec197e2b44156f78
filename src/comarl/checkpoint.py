"""Resumable run state, written so that a stopped run continues exactly as if it had never stopped.

A checkpoint is a folder ``output_dir/checkpoints/step_<N>/``:

- ``process_<r>.pt`` — what process ``r`` holds (all of it in a single-process run): its agents'
  weights, optimizers and learning-rate schedules, value heads and critics, its random streams
  (Python, NumPy, torch CPU and CUDA, the joint-action and mini-batch generators). Under data
  parallelism, a state every data shard holds whole and equal (unsharded weights, their AdamW
  state, critics, MADPO's candidates) is written once, by the first shard; the others' parts say
  :data:`IN_FIRST_SHARD` there and name that part in ``first_shard``, and resume reads it from it;
- ``trainer_state.json`` — the step, the trainer, the team size, the number of processes, the agents'
  sources and the :data:`RESUME_SETTINGS`, which a resumed run must share.

Every part is written into ``step_<N>.partial/``, which is renamed to ``step_<N>/`` once all are on disk, so a
save cut short never leaves a folder that is loaded. A folder is deleted ``trainer_state.json`` first, so a
deletion cut short does not leave one either: only ``step_<N>/`` folders with that file are loaded.

A run that does not resume deletes the folder's checkpoints when it starts, a resumed run those past its step
(:func:`remove_checkpoints`).
Saving step N also deletes the checkpoints past N (left when this run resumed from an older one, which it
replaces) and the unfinished ones (saves or deletions cut short), and keeps the newest ``save_total_limit``, step N
among them.

The data order needs no state: each epoch's permutation comes from ``seed + epoch``, and a resumed
run skips the steps already taken. The reference models (``beta > 0``) and a LoRA agent's frozen base
(of which a checkpoint keeps the adapters alone) are rebuilt from the agents' sources, as at the start
of the run: a resumed run must load the same models.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from comarl.config import ConfigError

STATE_FILE = "trainer_state.json"
CHECKPOINTS = "checkpoints"
PARTIAL = ".partial"  # the suffix of a checkpoint folder being written
CHECKPOINT_NAME = re.compile(r"step_\d+(\.partial)?")
# Stands in a data shard's part for a state the first data shard's part holds (D equal copies would take D times
# the disk: 36 GB per copy for a 3 B agent's fp32 weights and AdamW moments).
IN_FIRST_SHARD = "comarl: in the first data shard's part"
# Settings a resumed run must keep: they shape the saved state (one model for every agent, LoRA adapters over a base
# that is not saved, the critics, MADPO's candidates of the initial team, shares of weights or of AdamW's state) or
# the data order that the saved step counts into (each epoch's permutation, the items of a step). Others (max_steps,
# logging, evaluation) may change. A config without one of them (MAGRPO's has no critic_type) is not checked for it.
RESUME_SETTINGS = (
    "share_weights",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "lora_shared_base",
    "centralized_critic",
    "critic_type",
    "candidates_from",
    "shard_weights",
    "shard_optimizer",
    "seed",
    "shuffle",
    "prompts_per_step",
)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step_{step}"


def completed_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints under ``output_dir/checkpoints``, oldest first."""
    return [p for p in _checkpoint_folders(output_dir) if _finished(p)]


def _finished(directory: Path) -> bool:
    return not directory.name.endswith(PARTIAL) and (directory / STATE_FILE).is_file()


def _checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """Checkpoint folders under ``output_dir/checkpoints``, finished or not, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    # Only the names save_checkpoint writes: a folder the user left there (step_4.bak) is not ours to read or delete.
    return sorted((p for p in root.iterdir() if CHECKPOINT_NAME.fullmatch(p.name)), key=_step)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional for comarl itself
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU the saving process saw; a resume that sees fewer GPUs restores those it has.
        for device, gpu_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(gpu_state, device)
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def save_checkpoint(trainer: Any, output_dir: str | Path, keep: int) -> Path:
    """Write ``trainer``'s state for its current step; keep the newest ``keep`` checkpoints. Returns the folder."""
    parallel = trainer.processes
    rank = 0 if parallel is None else parallel.rank
    directory = checkpoint_dir(output_dir, trainer.step)
    partial = directory.with_name(directory.name + PARTIAL)
    if rank == 0:
        _remove(partial)  # left by a save of this step that was cut short
        partial.mkdir(parents=True)
    if parallel is not None:
        parallel.barrier()
    # The process (global rank) whose part holds the states marked IN_FIRST_SHARD in this one.
    first_shard = None if trainer.data is None else trainer.data.gather(rank)[0]
    saved = {"trainer": trainer.checkpoint_state(), "rng": rng_state(), "first_shard": first_shard}
    torch.save(saved, partial / f"process_{rank}.pt")
    if parallel is not None:
        parallel.barrier()  # every process's part is on disk before the folder is renamed into place
    if rank == 0:
        state = {
            "step": trainer.step,
            "trainer": type(trainer).__name__,
            "num_agents": trainer.num_agents,
            "processes": 1 if parallel is None else parallel.world_size,
            "agents": [_source(agent.source) for agent in trainer.team],
            "agent_fingerprints": [_fingerprint(agent.source) for agent in trainer.team],
            "settings": _settings(trainer.args),
        }
        (partial / STATE_FILE).write_text(json.dumps(state, indent=1))
        # Checkpoints at or past this step were left by an earlier run in this folder (one that went further, or
        # the run this one resumed from an older checkpoint): this run replaces them, and resuming must not jump
        # back to them, so they go before this one is renamed into place (a crash in between resumes from an
        # older step of this run). Unfinished ones are saves cut short, whose parts would otherwise stay on disk
        # for good (no later save counts them). Of the rest, the newest `keep` stay, this one among them.
        older = []
        for other in _checkpoint_folders(output_dir):
            if _finished(other) and _step(other) < trainer.step:
                older.append(other)
            elif other != partial:
                _remove(other)
        os.replace(partial, directory)
        for old in older[: max(len(older) - (keep - 1), 0)]:
            _remove(old)
    if parallel is not None:
        parallel.barrier()
    return directory


def _source(source: str | None) -> str | None:
    """An agent's source as a checkpoint records it: a local folder by its absolute path, a hub id as it is; None
    for a model object built without one (its ``_name_or_path`` is ``""``)."""
    if not source:
        return None
    return str(Path(source).resolve()) if Path(source).exists() else source


def _fingerprint(source: str | None) -> str | None:
    """What identifies a local model folder wherever it lies (a cluster job's scratch path changes between jobs): a
    hash of its config files and of its weight files' names and sizes. None for a hub id or a model object."""
    if not source or not Path(source).is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(Path(source).iterdir()):
        if path.name in ("config.json", "adapter_config.json"):
            digest.update(path.name.encode() + path.read_bytes())
        elif path.suffix in (".safetensors", ".bin"):
            digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()


def _settings(args: Any) -> dict[str, Any]:
    """The :data:`RESUME_SETTINGS` of ``args`` that its config has, as JSON gives them back (lists, not tuples)."""
    return json.loads(json.dumps({key: getattr(args, key) for key in RESUME_SETTINGS if hasattr(args, key)}))


def _step(directory: Path) -> int:
    return int(directory.name.removeprefix("step_").removesuffix(PARTIAL))


def remove_checkpoints(output_dir: str | Path, past: int = -1) -> None:
    """Delete the checkpoint folders under ``output_dir/checkpoints`` past step ``past``, finished or not, newest
    first: every one at a new run's start, those past its step at a resumed run's (they belong to the run it
    replaces, and a later resume must not jump to them)."""
    for directory in reversed(_checkpoint_folders(output_dir)):
        if _step(directory) > past:
            _remove(directory)


def _remove(directory: Path) -> None:
    # trainer_state.json first: a removal cut short leaves an unfinished checkpoint, not one with parts missing.
    (directory / STATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def check_resumable(
    directory: str | Path,
    trainer: str,
    num_agents: int,
    processes: int,
    args: Any,
    sources: Sequence[str | None] | None = None,
) -> int:
    """The step of the checkpoint in ``directory``, once a run of ``trainer`` (its class name) with ``num_agents``
    agents on ``processes`` processes, config ``args`` and agent ``sources`` (None: not checked) may resume from
    it: the checkpoint must be finished and record the same trainer, team size, process count, sources and
    :data:`RESUME_SETTINGS`. Raises ConfigError naming the first that differs. Reads trainer_state.json alone, so
    ``comarl train --resume`` checks it before any model loads (:func:`load_checkpoint` checks it again)."""
    directory = Path(directory)
    if not _finished(directory):
        raise ConfigError(
            f"resume_from_checkpoint={str(directory)!r}: not a finished checkpoint (a step_<N> folder with "
            f"{STATE_FILE}); name a finished one, or resume_from_checkpoint=True for the newest"
        )
    state = json.loads((directory / STATE_FILE).read_text())
    for key, value in {"trainer": trainer, "num_agents": num_agents, "processes": processes}.items():
        if state[key] != value:
            raise ConfigError(
                f"resume_from_checkpoint={str(directory)!r}: the checkpoint has {key}={state[key]!r}, this run "
                f"{key}={value!r}; resume with the same trainer, team and launch"
            )
    # (Checkpoints written before sources and settings were recorded are not checked for them.)
    fingerprints = state.get("agent_fingerprints", [])
    for i, (saved_source, given) in enumerate(zip(state.get("agents", []), sources or [])):
        source = _source(given)
        if None in (saved_source, source) or saved_source == source:
            continue
        # A local folder moved or copied elsewhere is the same model.
        if i < len(fingerprints) and fingerprints[i] is not None and fingerprints[i] == _fingerprint(given):
            continue
        raise ConfigError(
            f"resume_from_checkpoint={str(directory)!r}: the checkpoint's agent {i} is {saved_source!r}, this "
            f"run's {source!r}; resume with the same models (model= / agents=; a local folder may have moved if its "
            "config and weight files are the same): the KL reference and a LoRA agent's base are loaded from them"
        )
    settings = _settings(args)
    for key, value in state.get("settings", {}).items():
        if key in settings and settings[key] != value:
            raise ConfigError(
                f"resume_from_checkpoint={str(directory)!r}: the checkpoint was written with {key}={value!r}, this "
                f"run has {key}={settings[key]!r}; resume with the same {key} (it shapes the saved state or the data "
                "order), or start a new run from the saved agents"
            )
    return int(state["step"])


def load_checkpoint(trainer: Any, directory: str | Path) -> int:
    """Restore ``trainer`` from a checkpoint folder written by :func:`save_checkpoint`; returns its step."""
    directory = Path(directory)
    parallel = trainer.processes
    step = check_resumable(
        directory,
        type(trainer).__name__,
        trainer.num_agents,
        1 if parallel is None else parallel.world_size,
        trainer.args,
        [agent.source for agent in trainer.team],
    )
    rank = 0 if parallel is None else parallel.rank
    # mmap: the state is paged in as it is copied onto the agents' devices, not read whole into host memory first.
    saved = torch.load(directory / f"process_{rank}.pt", map_location="cpu", weights_only=False, mmap=True)
    first_shard = saved.get("first_shard")
    if first_shard is not None and first_shard != rank:
        whole = torch.load(
            directory / f"process_{first_shard}.pt", map_location="cpu", weights_only=False, mmap=True
        )
        _take_first_shards(saved["trainer"], whole["trainer"])
    trainer.load_checkpoint_state(saved["trainer"])
    set_rng_state(saved["rng"])
    return step


def _take_first_shards(part: dict[Any, Any], first: dict[Any, Any]) -> None:
    """Replace every IN_FIRST_SHARD in ``part`` (nested dicts) with the value at the same place in ``first``."""
    for key, value in part.items():
        if isinstance(value, str) and value == IN_FIRST_SHARD:
            part[key] = first[key]
        elif isinstance(value, dict) and isinstance(first.get(key), dict):
            _take_first_shards(value, first[key])  # (not into a share of a sharded state: its keys differ)


def truncate_log(path: Path, step: int) -> None:
    """Drop the rows of a JSONL log written after ``step`` (by a run that went on after its last checkpoint),
    and a row the crash cut off (not a JSON object), which the next row would otherwise be appended to."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if (row := _row(line)) is not None and row.get("step", 0) <= step]
    if len(kept) != len(rows):
        path.write_text("".join(line + "\n" for line in kept))


def _row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None
