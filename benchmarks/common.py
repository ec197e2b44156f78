"""What every benchmark runner shares: the workload on disk, the reward, and the one JSON line it prints.

Runners execute in different virtual environments (comarl's, CoMLRL's, TRL's), so this module
imports only the standard library at the top; torch is imported inside the functions that need it.

A runner is one process per measured run: it loads the workload by path, times one epoch of
training, and prints exactly one line ``RESULT {json}`` with completions/s, tokens/s and the
peak resident memory of the process (``ru_maxrss``, which includes imports and model loading).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

# The workload every library runs (issue 6). Kept here so that the driver, the runners and the
# docs agree on one set of numbers.
NUM_GENERATIONS = 4  # G completions per prompt per agent
NEW_TOKENS = 32  # min_new_tokens = max_new_tokens: every completion is exactly this long
TEMPERATURE = 1.0
LEARNING_RATE = 1e-5
PROMPTS_PER_STEP = {"peer": 1, "batched": 8}  # (a) the peers' semantics, (b) batched
RESULT_PREFIX = "RESULT "


def runner_args(description: str) -> argparse.Namespace:
    """The command line every runner takes: the workload folder, the mode, the number of agents, threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--workload", required=True, help="folder written by bench.py (model/ + prompts.json)"
    )
    parser.add_argument("--mode", choices=sorted(PROMPTS_PER_STEP), required=True)
    parser.add_argument("--agents", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for this process")
    parser.add_argument("--prompts", type=int, default=None, help="use only the first N prompts (smoke runs)")
    parser.add_argument(
        "--agent-parallel",
        action="store_true",
        help="comarl only: one process per agent (launched by torchrun with --nproc-per-node=agents)",
    )
    parser.add_argument(
        "--plain-decoding",
        action="store_true",
        help="comarl and the floor: decode through the model's own forward (HFEngine(fast_decoding=False)), not "
        "comarl's LlamaDecoder",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where every library places its models: cpu (the recorded CPU tables) or cuda (the GPU tables)",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="comarl and TRL: bf16 autocast (bf16=True) instead of the workload's fp32; not what the targets compare",
    )
    parser.add_argument(
        "--glibc-malloc",
        action="store_true",
        help="comarl and the floor: leave glibc's malloc settings as they are (keep_freed_memory=False); the "
        "peers always run with them (or with MALLOC_* environment variables set by the caller)",
    )
    args = parser.parse_args()
    # Same intra-op threads for every library; set before torch is imported anywhere.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_MODE", "disabled")
    return args


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)


def model_path(workload: str | Path) -> str:
    return str(Path(workload) / "model")


def load_prompts(workload: str | Path, limit: int | None = None) -> list[dict[str, str]]:
    """The benchmark dataset: a list of ``{"prompt": text}``, the first ``limit`` items when given."""
    items = json.loads((Path(workload) / "prompts.json").read_text())["items"]
    return items if limit is None else items[:limit]


def team_reward(*completions: list[str]) -> list[float]:
    """Cheap shared reward, the same for every library: total characters of the joint action / 100.

    ``completions[i][k]`` is agent i's completion in joint action k; returns one float per joint action.
    """
    return [sum(len(text) for text in joint) / 100.0 for joint in zip(*completions)]


class Clock:
    """Wall and CPU time of the timed region, and the completions and tokens generated in it.

    CPU time (all threads of this process) barely moves when other programs load the machine,
    so it is reported next to wall time: on a shared machine its ratios are the steadier ones.
    """

    def __init__(self) -> None:
        self.started = self.cpu_started = 0.0
        self.seconds = self.cpu_seconds = 0.0
        self.tokens = 0
        self.completions = 0

    def __enter__(self) -> Clock:
        self.start()
        return self

    def start(self) -> None:
        """(Re)start the timed region here: a runner whose library sets itself up inside ``train()`` calls it
        at its first step."""
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def __exit__(self, *exc: Any) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the last step's kernels belong to the timed region
        self.seconds = time.perf_counter() - self.started
        self.cpu_seconds = time.process_time() - self.cpu_started


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_gpu_mb() -> float | None:
    """Peak memory torch allocated on the GPU in this process, in MiB; None where CUDA was not used."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def decode_trials() -> list[dict[str, Any]]:
    """What comarl's decode step found in this process's packing trials (``comarl.llama_decoder.PACKING_TRIALS``):
    per row count, ms per decode step with plain and with packed products, ms per packing, and whether a call of
    the workload's length packs; empty where comarl's decoder was not used."""
    decoder = sys.modules.get("comarl.llama_decoder")
    if decoder is None:
        return []
    return [
        {
            "rows": rows,
            "plain_ms": round(1e3 * trial.plain, 3),
            "packed_ms": round(1e3 * trial.packed, 3),
            "packing_ms": round(1e3 * trial.packing, 3),
            "packs": trial.saves(NEW_TOKENS - 1),
        }
        for (_, rows), trial in decoder.PACKING_TRIALS.items()
    ]


def report(
    library: str,
    args: argparse.Namespace,
    clock: Clock,
    setup_seconds: float,
    expected_completions: int,
    **extra: Any,
) -> None:
    """Print the run's one ``RESULT`` line; fail loudly when the library did not do the expected work."""
    if clock.completions != expected_completions:
        raise SystemExit(
            f"{library}: generated {clock.completions} completions, expected {expected_completions} "
            "(prompts x num_generations x agents); the runner's configuration is wrong"
        )
    result = {
        "library": library,
        "mode": args.mode,
        "agents": args.agents,
        "prompts": expected_completions // (NUM_GENERATIONS * args.agents),
        "threads": args.threads,
        "bf16": args.bf16,
        "completions": clock.completions,
        "tokens": clock.tokens,
        "seconds": round(clock.seconds, 4),
        "cpu_seconds": round(clock.cpu_seconds, 4),
        "completions_per_s": clock.completions / clock.seconds,
        "tokens_per_s": clock.tokens / clock.seconds,
        "completions_per_cpu_s": clock.completions / clock.cpu_seconds,
        "setup_seconds": round(setup_seconds, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "device": args.device,
        "peak_gpu_mb": peak_gpu_mb(),
        "python": sys.version.split()[0],
        "decode_trials": decode_trials(),
        **extra,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
