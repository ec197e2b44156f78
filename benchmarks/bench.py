"""Speed benchmark: comarl against CoMLRL 1.4.3 and TRL at the same work, and against a hand-written floor.

    python benchmarks/bench.py            # the full run (what docs/benchmarks.md reports)
    python benchmarks/bench.py --quick    # smoke run: 8 prompts, one repeat
    comarl bench [--quick]                # the same, from the command line

What it does, top to bottom:

1. creates one virtual environment per peer under ``benchmarks/.venvs/`` (torch==2.13.0 first, the
   CPU build, so that no peer pulls a CUDA build; then the peer) -- never comarl dependencies;
2. builds the workload once (``workload.py``): a tiny Qwen2 + byte-level BPE tokenizer + 32 prompts,
   saved to ``benchmarks/.workload`` and loaded by path by every runner;
3. runs every case (library x mode x number of agents) in its own process, one Python per measured
   run, repeats interleaved (comarl, peer, comarl, peer, ...; the order reversed on odd repeats) so
   that machine load hits every library alike;
4. takes medians per case, writes ``benchmarks/results/<date>.json`` and ``.md``, prints the tables.

Modes: ``peer`` = one prompt per optimizer step (the peers' semantics), ``batched`` = 8 prompts per
step (CoMLRL: rollout_buffer_size = train_batch_size = 8, still generating one prompt at a time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TORCH_REQUIREMENT = "torch==2.13.0"
PEER_REQUIREMENTS = {"comlrl": "comlrl==1.4.3", "trl": "trl==1.16.0"}
RUNNERS = {
    "comarl": "run_comarl.py",
    "comlrl": "run_comlrl.py",
    "trl": "run_trl.py",
    "floor": "floor.py",
    "comarl-ap": "run_comarl.py",  # agent-parallel: one process per agent under torchrun (N cores for N agents)
}
RESULT_PREFIX = "RESULT "
MODES = ("peer", "batched")
TARGETS_TEXT = {
    "comlrl_batched_2": "2 agents, batched: >= 5x CoMLRL's completions/s",
    "comlrl_peer_2": "2 agents, peer semantics: >= 1.5x CoMLRL's completions/s",
    "trl_peer_1": "1 agent, peer semantics: >= 1.5x TRL's completions/s",
    "trl_batched_1": "1 agent, batched: >= 1.5x TRL's completions/s",
    "floor": "overhead over the hand-written loop <= 1.3x (every measured case)",
    "rss": "peak RSS <= CoMLRL's (every case)",
    "scaling": "agents as processes: seconds per epoch with N agents < N x one agent's (every N measured)",
}


@dataclass(frozen=True)
class Case:
    """One measured configuration: which library, which mode, how many agents."""

    library: str
    mode: str
    agents: int


def build_cases(agent_counts: Sequence[int], floor_agents: Sequence[int]) -> list[Case]:
    """Every case of one repeat, comarl next to each peer so that they run back to back."""
    cases = []
    for mode in MODES:
        for n in agent_counts:
            cases += [Case("comarl", mode, n), Case("comlrl", mode, n)]
            if n > 1:
                cases.append(Case("comarl-ap", mode, n))
            if n in floor_agents:
                cases.append(Case("floor", mode, n))
            if n == 1:
                cases.append(Case("trl", mode, 1))
    return cases


def schedule(cases: Sequence[Case], repeats: int) -> list[Case]:
    """All runs in order: the cases forwards on even repeats and backwards on odd ones."""
    runs: list[Case] = []
    for r in range(repeats):
        runs += list(cases) if r % 2 == 0 else list(reversed(cases))
    return runs


def median(values: Sequence[float]) -> float:
    """The middle value (mean of the two middle ones for an even count); raises on an empty list."""
    if not values:
        raise ValueError("median: no values")
    return float(statistics.median(values))


def summarize(runs: Sequence[dict[str, Any]]) -> dict[Case, dict[str, float]]:
    """Medians per case of throughput (wall and CPU), seconds and peak RSS over its repeats."""
    grouped: dict[Case, list[dict[str, Any]]] = {}
    for run in runs:
        grouped.setdefault(Case(run["library"], run["mode"], run["agents"]), []).append(run)
    keys = (
        "completions_per_s",
        "tokens_per_s",
        "completions_per_cpu_s",
        "seconds",
        "cpu_seconds",
        "peak_rss_mb",
    )
    summary = {}
    for case, rs in grouped.items():
        summary[case] = {
            **{k: median([r[k] for r in rs]) for k in keys},
            "repeats": len(rs),
            "threads": max(r.get("threads", 1) for r in rs),  # torch threads per process
        }
        gpu = [r["peak_gpu_mb"] for r in rs if r.get("peak_gpu_mb") is not None]
        summary[case]["peak_gpu_mb"] = median(gpu) if gpu else None
    return summary


def comparisons(summary: dict[Case, dict[str, float]]) -> list[dict[str, Any]]:
    """One row per (mode, agents, peer) with both libraries' medians and the ratio comarl / peer.

    ``ratio`` = comarl completions/s / peer completions/s (wall); ``cpu_ratio`` the same from CPU time.
    For the floor, ``ratio`` is comarl's speed relative to the floor and ``overhead`` = 1 / ratio
    (comarl's seconds per completion over the floor's).
    """
    rows = []
    for case, peer in sorted(summary.items(), key=lambda kv: _order(kv[0])):
        library, mode, agents = case.library, case.mode, case.agents
        if library in ("comarl", "comarl-ap") or Case("comarl", mode, agents) not in summary:
            continue
        ours = summary[Case("comarl", mode, agents)]
        ratio = ours["completions_per_s"] / peer["completions_per_s"]
        rows.append(
            {
                "mode": mode,
                "agents": agents,
                "peer": library,
                "comarl_completions_per_s": ours["completions_per_s"],
                "peer_completions_per_s": peer["completions_per_s"],
                "comarl_tokens_per_s": ours["tokens_per_s"],
                "peer_tokens_per_s": peer["tokens_per_s"],
                "ratio": ratio,
                "cpu_ratio": ours["completions_per_cpu_s"] / peer["completions_per_cpu_s"],
                "overhead": 1 / ratio,
                "comarl_rss_mb": ours["peak_rss_mb"],
                "peer_rss_mb": peer["peak_rss_mb"],
                "comarl_gpu_mb": ours["peak_gpu_mb"],
                "peer_gpu_mb": peer["peak_gpu_mb"],
            }
        )
    return rows


def agent_parallel_rows(summary: dict[Case, dict[str, float]]) -> list[dict[str, Any]]:
    """One row per agent-parallel case: its speed against comarl in one process and against CoMLRL.

    ``vs_one_process`` and ``vs_comlrl`` are wall-clock speed ratios (the agent-parallel run uses one
    core per agent, the others one core in all); ``cpu_vs_comlrl`` compares completions per CPU second;
    ``scaling`` = seconds per epoch / seconds of comarl with one agent in the same mode.
    """
    rows = []
    for case in sorted(summary, key=_order):
        if case.library != "comarl-ap":
            continue
        ours = summary[case]
        one_process = summary.get(Case("comarl", case.mode, case.agents))
        comlrl = summary.get(Case("comlrl", case.mode, case.agents))
        single = summary.get(Case("comarl", case.mode, 1))
        rows.append(
            {
                "mode": case.mode,
                "agents": case.agents,
                "completions_per_s": ours["completions_per_s"],
                "vs_one_process": ours["completions_per_s"] / one_process["completions_per_s"]
                if one_process
                else None,
                "vs_comlrl": ours["completions_per_s"] / comlrl["completions_per_s"] if comlrl else None,
                "cpu_vs_comlrl": (
                    ours["completions_per_cpu_s"] / comlrl["completions_per_cpu_s"] if comlrl else None
                ),
                "seconds": ours["seconds"],
                "scaling": ours["seconds"] / single["seconds"] if single else None,
                "rss_mb": ours["peak_rss_mb"],
            }
        )
    return rows


def _order(case: Case) -> tuple[int, int, int]:
    return MODES.index(case.mode), case.agents, list(RUNNERS).index(case.library)


def targets(
    rows: Sequence[dict[str, Any]], parallel: Sequence[dict[str, Any]] = ()
) -> dict[str, dict[str, Any]]:
    """Each target of issue 6 with the measured value (wall-clock ratio) and whether it is met.

    The speed targets compare comarl in one process (one core, like every peer); agent-parallel runs
    (``parallel``, from ``agent_parallel_rows``) only answer the scaling target: the largest
    ``scaling / agents`` must stay below 1.
    """
    by_key = {(r["peer"], r["mode"], r["agents"]): r for r in rows}
    found: dict[str, dict[str, Any]] = {}
    for key, peer, mode, agents, needed in (
        ("comlrl_batched_2", "comlrl", "batched", 2, 5.0),
        ("comlrl_peer_2", "comlrl", "peer", 2, 1.5),
        ("trl_peer_1", "trl", "peer", 1, 1.5),
        ("trl_batched_1", "trl", "batched", 1, 1.5),
    ):
        if (peer, mode, agents) in by_key:
            value = by_key[(peer, mode, agents)]["ratio"]
            found[key] = {"value": value, "needed": needed, "met": value >= needed}
    floor = [r["overhead"] for r in rows if r["peer"] == "floor"]
    if floor:
        found["floor"] = {"value": max(floor), "needed": 1.3, "met": max(floor) <= 1.3}
    rss = [r["comarl_rss_mb"] / r["peer_rss_mb"] for r in rows if r["peer"] == "comlrl"]
    if rss:
        found["rss"] = {"value": max(rss), "needed": 1.0, "met": max(rss) <= 1.0}
    per_agent = [r["scaling"] / r["agents"] for r in parallel if r["scaling"] is not None]
    if per_agent:
        found["scaling"] = {"value": max(per_agent), "needed": 1.0, "met": max(per_agent) < 1.0}
    return found


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _threads_text(count: int) -> str:
    return "one thread" if count == 1 else f"{count} threads"


def _parallel_heading(summary: dict[Case, dict[str, Any]]) -> str:
    """The line above the agent-parallel table: how many threads its processes and the one-process runs had."""
    parallel = {v["threads"] for c, v in summary.items() if c.library == "comarl-ap"}
    single = {v["threads"] for c, v in summary.items() if c.library != "comarl-ap"}
    each = " or ".join(_threads_text(t) for t in sorted(parallel))
    above = " or ".join(_threads_text(t) for t in sorted(single)) or "-"
    return (
        f"Agents as processes (`agent_parallel=True`, torchrun, one process per agent, {each} each; "
        f"the rows above run in one process with {above}):"
    )


def markdown(rows: Sequence[dict[str, Any]], summary: dict[Case, dict[str, float]]) -> str:
    """The result tables in markdown: comarl vs each peer, comarl vs the floor, targets, scaling in agents."""
    gpu = any(r.get("comarl_gpu_mb") is not None for r in rows)
    lines = [
        "| mode | agents | peer | comarl compl/s | peer compl/s | **comarl / peer** | (CPU-time ratio) "
        "| comarl tok/s | peer tok/s | comarl RSS MiB | peer RSS MiB |"
        + (" comarl GPU MiB | peer GPU MiB |" if gpu else ""),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else ""),
    ]
    for r in rows:
        if r["peer"] == "floor":
            continue
        lines.append(
            f"| {r['mode']} | {r['agents']} | {r['peer']} | {r['comarl_completions_per_s']:.2f} "
            f"| {r['peer_completions_per_s']:.2f} | **{r['ratio']:.2f}x** | {r['cpu_ratio']:.2f}x "
            f"| {r['comarl_tokens_per_s']:.0f} | {r['peer_tokens_per_s']:.0f} "
            f"| {r['comarl_rss_mb']:.0f} | {r['peer_rss_mb']:.0f} |"
            + (f" {_mib(r['comarl_gpu_mb'])} | {_mib(r['peer_gpu_mb'])} |" if gpu else "")
        )
    floor = [r for r in rows if r["peer"] == "floor"]
    if floor:
        lines += [
            "",
            "| mode | agents | comarl compl/s | floor compl/s | **comarl overhead** (floor speed / comarl speed) "
            "| comarl RSS MiB | floor RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in floor:
            lines.append(
                f"| {r['mode']} | {r['agents']} | {r['comarl_completions_per_s']:.2f} "
                f"| {r['peer_completions_per_s']:.2f} | **{r['overhead']:.2f}x** "
                f"| {r['comarl_rss_mb']:.0f} | {r['peer_rss_mb']:.0f} |"
            )
    lines += [
        "",
        "| mode | comarl seconds per epoch, 1 / 2 / 3 agents | relative to 1 agent |",
        "|---|---|---|",
    ]
    for mode in MODES:
        seconds = [
            summary[c]["seconds"]
            for c in sorted(summary, key=_order)
            if c.library == "comarl" and c.mode == mode
        ]
        if seconds:
            lines.append(
                f"| {mode} | {' / '.join(f'{s:.1f}' for s in seconds)} | {' / '.join(f'{s / seconds[0]:.2f}' for s in seconds)} |"
            )
    parallel = agent_parallel_rows(summary)
    if parallel:
        lines += [
            "",
            _parallel_heading(summary),
            "",
            "| mode | agents | compl/s | vs comarl, one process | vs CoMLRL (wall) | vs CoMLRL (per CPU s) "
            "| s / epoch | relative to 1 agent | RSS MiB, all processes |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]

        def fmt(value: float | None, suffix: str = "") -> str:
            return "-" if value is None else f"{value:.2f}{suffix}"

        for r in parallel:
            lines.append(
                f"| {r['mode']} | {r['agents']} | {r['completions_per_s']:.2f} | {fmt(r['vs_one_process'], 'x')} "
                f"| {fmt(r['vs_comlrl'], 'x')} | {fmt(r['cpu_vs_comlrl'], 'x')} | {r['seconds']:.1f} "
                f"| {fmt(r['scaling'])} | {r['rss_mb']:.0f} |"
            )
    found = targets(rows, parallel)
    if found:
        lines += ["", "| target | measured | met |", "|---|---:|---|"]
        for key, t in found.items():
            lines.append(f"| {TARGETS_TEXT[key]} | {t['value']:.2f} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- processes


def ensure_venv(name: str, requirement: str) -> Path:
    """``benchmarks/.venvs/<name>`` with torch (CPU build, first) and ``requirement``; reused when already built."""
    venv = HERE / ".venvs" / name
    python = venv / "bin" / "python"
    marker = venv / "comarl-bench.json"
    wanted = {"torch": TORCH_REQUIREMENT, "peer": requirement}
    if python.exists() and marker.exists() and json.loads(marker.read_text()) == wanted:
        return python
    print(f"creating {venv} ({TORCH_REQUIREMENT}, then {requirement}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    for package in (TORCH_REQUIREMENT, requirement):
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", package], check=True)
    marker.write_text(json.dumps(wanted))
    return python


def _gpu_name() -> str:
    """The name of the GPU the runs used (asked in a child process: the driver keeps no CUDA context)."""
    code = "import torch; print(torch.cuda.get_device_name(0))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def library_versions(python: Path, modules: Sequence[str]) -> dict[str, str]:
    """Installed versions of ``modules`` in the interpreter ``python`` (recorded with the results)."""
    code = (
        "import importlib.metadata as m, json, sys; "
        "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    )
    out = subprocess.run([str(python), "-c", code, *modules], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def process_threads(case: Case, threads: int) -> int:
    """Torch threads of each process of ``case`` when a one-process run gets ``threads``.

    An agent-parallel run splits them among its agent processes, at least one each, so that with
    ``threads >= agents`` it uses the same cores as the one-process runs.
    """
    return max(1, threads // case.agents) if case.library == "comarl-ap" else threads


# Timed in a fresh process before and after the runs, one thread: what on this machine moved the ratios between runs
# (docs/benchmarks.md, "Earlier runs"): MKL's plain and oneDNN's packed small-row products, and a page fault.
PROBE = """
import json, resource, statistics, time, torch
import torch.nn.functional as F
torch.set_num_threads(1)

def per_call(fn, calls=300, rounds=7):
    for _ in range(50):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return round(statistics.median(times), 1)

w, x4, x32 = torch.randn(1024, 256), torch.randn(4, 256), torch.randn(32, 256)
result = {"mkl_4_rows_us": per_call(lambda: F.linear(x4, w)), "mkl_32_rows_us": per_call(lambda: F.linear(x32, w))}
if torch.backends.mkldnn.is_available():
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    result["onednn_packed_4_rows_us"] = per_call(
        lambda: torch.ops.mkldnn._linear_pointwise(x4, packed, None, "none", [], "")
    )
faults = []
for _ in range(5):
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    block = torch.empty(16 * 2**20)  # 64 MiB: above glibc's largest mmap threshold, so fresh pages every time
    block.fill_(1.0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    block.fill_(2.0)
    again = time.perf_counter() - start
    faults.append((first - again) / max(1, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 1e6)
    del block
result["page_fault_us"] = round(statistics.median(faults), 2)
print(json.dumps(result))
"""
PROBE_NAMES = {
    "mkl_4_rows_us": "MKL product 4 x 256 -> 1024",
    "onednn_packed_4_rows_us": "oneDNN packed, the same",
    "mkl_32_rows_us": "MKL product 32 x 256 -> 1024",
    "page_fault_us": "page fault",
}


def probe_machine(python: Path) -> dict[str, float]:
    """Time :data:`PROBE` with ``python`` in a fresh one-thread process: µs per small product and per page fault."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"machine probe: exit code {done.returncode}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def probe_text(before: dict[str, float], after: dict[str, float]) -> str:
    """One line for the tables: each probe's µs before and after the runs."""
    parts = [
        f"{label} {before[key]:g} / {after[key]:g} µs"
        for key, label in PROBE_NAMES.items()
        if key in before and key in after
    ]
    return "Machine probe, one core, before / after the runs: " + "; ".join(parts) + "."


def trials_text(runs: Sequence[dict[str, Any]]) -> str:
    """One line for the tables: per row count, in how many of comarl's runs the decode step's packing trial chose
    packed products, and the trials' median ms per step plain / packed and per packing ("" without trials)."""
    by_rows: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        if run["library"] == "comarl":
            for trial in run.get("decode_trials", []):
                by_rows.setdefault(trial["rows"], []).append(trial)
    if not by_rows:
        return ""
    parts = [
        f"{rows} rows packed in {sum(t['packs'] for t in trials)} of {len(trials)} "
        f"({median([t['plain_ms'] for t in trials]):.2f} / {median([t['packed_ms'] for t in trials]):.2f} ms, "
        f"{median([t['packing_ms'] for t in trials]):.1f} ms)"
        for rows, trials in sorted(by_rows.items())
    ]
    return (
        "comarl's decode step, its packing trial in each run (median ms per step plain / packed, per packing): "
        + "; ".join(parts)
        + "."
    )


def run_case(
    case: Case,
    python: Path,
    workload: Path,
    threads: int,
    prompts: int | None,
    timeout: float,
    device: str,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run one case in a fresh process and return its RESULT line as a dict (``extra_args`` added to the runner's
    command line, ``extra_env`` to its environment)."""
    launcher = [str(python)]
    if case.library == "comarl-ap":
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.agents}"]
    threads = process_threads(case, threads)
    command = [
        *launcher,
        str(HERE / RUNNERS[case.library]),
        "--workload",
        str(workload),
        "--mode",
        case.mode,
        "--agents",
        str(case.agents),
        "--threads",
        str(threads),
        "--device",
        device,
    ]
    if prompts is not None:
        command += ["--prompts", str(prompts)]
    if case.library == "comarl-ap":
        command.append("--agent-parallel")
    command += list(extra_args)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
        **(extra_env or {}),
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"{case}: exit code {done.returncode}, no result line; last output:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 prompts, 1 repeat")
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats per case (default 2; 1 with --quick)"
    )
    parser.add_argument(
        "--prompts", type=int, default=None, help="prompts per epoch (default 32; 8 with --quick)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every runner (default 1)")
    parser.add_argument("--agents", default="1,2,3", help="agent counts measured against CoMLRL")
    parser.add_argument("--floor-agents", default="1,2", help="agent counts for the hand-written floor")
    parser.add_argument(
        "--libraries", default="comarl,comlrl,trl,floor,comarl-ap", help="subset of libraries to run"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (default, the recorded CPU tables) or cuda: where every library trains, the same for all",
    )
    parser.add_argument(
        "--peers-here",
        action="store_true",
        help="run CoMLRL and TRL with this interpreter instead of their own venvs (a machine without network, "
        "where they were installed from wheels; see docs/benchmarks.md)",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="record a failed run (its last output) and go on with the others instead of stopping",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is abandoned")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for <date>.json and <date>.md")
    parser.add_argument(
        "--tables-from",
        default=None,
        help="print the tables of a results JSON (or a .runs.jsonl) without running",
    )
    args = parser.parse_args(argv)
    if args.tables_from:
        path = Path(args.tables_from)
        if path.suffix == ".jsonl":
            runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            runs = json.loads(path.read_text())["runs"]
        summary = summarize(runs)
        print(markdown(comparisons(summary), summary))
        machine = {} if path.suffix == ".jsonl" else json.loads(path.read_text())["machine"]
        if "probe_before" in machine:
            print("\n" + probe_text(machine["probe_before"], machine["probe_after"]))
        trials = trials_text(runs)
        if trials:
            print("\n" + trials)
        return 0
    repeats = args.repeats or (1 if args.quick else 2)
    prompts = args.prompts or (8 if args.quick else None)
    libraries = args.libraries.split(",")
    unknown = [name for name in libraries if name not in RUNNERS]
    if unknown:
        parser.error(f"--libraries: unknown {unknown}; choose from {list(RUNNERS)}")

    from workload import build_workload

    workload = build_workload(HERE / ".workload")
    pythons = {
        "comarl": Path(sys.executable),
        "floor": Path(sys.executable),
        "comarl-ap": Path(sys.executable),
    }
    for name, requirement in PEER_REQUIREMENTS.items():
        if name in libraries:
            pythons[name] = Path(sys.executable) if args.peers_here else ensure_venv(name, requirement)
    versions = {
        name: library_versions(
            python, ["torch", "transformers", *([name] if name in PEER_REQUIREMENTS else [])]
        )
        for name, python in pythons.items()
    }
    cases = [
        c
        for c in build_cases(
            [int(n) for n in args.agents.split(",")], [int(n) for n in args.floor_agents.split(",")]
        )
        if c.library in libraries
    ]
    probe_before = probe_machine(Path(sys.executable))
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M") + ("-quick" if args.quick else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Every run is appended as it finishes, so an interrupted benchmark keeps what it measured.
    partial = out / f"{stamp}.runs.jsonl"
    runs, failures = [], []
    plan = schedule(cases, repeats)
    for i, case in enumerate(plan, start=1):
        try:
            result = run_case(
                case, pythons[case.library], workload, args.threads, prompts, args.timeout, args.device
            )
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            if not args.keep_going:
                raise
            print(f"[{i}/{len(plan)}] {case.library:<7} {case.mode:<8} agents={case.agents}  FAILED: {error}")
            failures.append({**asdict(case), "error": str(error)[-3000:]})
            continue
        runs.append(result)
        with partial.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(
            f"[{i}/{len(plan)}] {case.library:<7} {case.mode:<8} agents={case.agents}  "
            f"{result['completions_per_s']:6.2f} completions/s  {result['seconds']:7.1f} s  "
            f"{result['peak_rss_mb']:6.0f} MiB",
            flush=True,
        )
    probe_after = probe_machine(Path(sys.executable))
    summary = summarize(runs)
    rows = comparisons(summary)
    table = markdown(rows, summary) + "\n\n" + probe_text(probe_before, probe_after)
    trials = trials_text(runs)
    if trials:
        table += "\n\n" + trials
    record = {
        "date": stamp,
        "settings": {
            "repeats": repeats,
            "prompts": prompts or 32,
            "threads": args.threads,
            "quick": args.quick,
            "device": args.device,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "gpu": _gpu_name() if args.device.startswith("cuda") else None,
            "probe_before": probe_before,
            "probe_after": probe_after,
        },
        "versions": versions,
        "summary": [{**asdict(c), **v} for c, v in summary.items()],
        "comparisons": rows,
        "agent_parallel": agent_parallel_rows(summary),
        "targets": targets(rows, agent_parallel_rows(summary)),
        "runs": runs,
        "failures": failures,
    }
    (out / f"{stamp}.json").write_text(json.dumps(record, indent=1))
    (out / f"{stamp}.md").write_text(table + "\n")
    partial.unlink()
    print("\n" + table)
    print(f"\nwritten: {out / (stamp + '.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
