"""comarl's malloc setting (``keep_freed_memory``) on and off, and the same setting given to the floor and to TRL.

On the CPU comarl's trainer sets glibc's malloc to keep the memory that freed tensors leave for the next step's
(``comarl.memory.keep_freed_memory``: mmap threshold 32 MiB, trim threshold 1 GiB), instead of taking fresh pages
from the OS at every step. This script measures what that is worth at the benchmark's work, one epoch per process,
variants interleaved ``--repeats`` times, for each mode with one agent:

- comarl as it ships, and with ``--glibc-malloc`` (``keep_freed_memory=False``);
- the hand-written floor with the same setting (as ``bench.py`` runs it) and with glibc's defaults;
- TRL as it ships (glibc's defaults), and with the same setting from the environment (``MALLOC_MMAP_THRESHOLD_``,
  ``MALLOC_TRIM_THRESHOLD_``): what the setting would give the peer.

It prints median seconds per epoch and each library's speed-up from the setting::

    python benchmarks/malloc_ablation.py --repeats 3    # uses bench.py's workload and TRL venv (built if missing)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench import HERE, PEER_REQUIREMENTS, Case, ensure_venv, run_case
from workload import build_workload

from comarl.memory import MMAP_THRESHOLD_MAX, TRIM_THRESHOLD

KEPT_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_MAX), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
# (label, library, extra runner arguments, extra environment); each library's first variant keeps freed memory.
VARIANTS = [
    ("comarl (keeps freed memory)", "comarl", [], {}),
    ("comarl --glibc-malloc", "comarl", ["--glibc-malloc"], {}),
    ("floor (keeps freed memory)", "floor", [], {}),
    ("floor --glibc-malloc", "floor", ["--glibc-malloc"], {}),
    ("trl + MALLOC_* (keeps freed memory)", "trl", [], KEPT_ENV),
    ("trl (glibc's defaults)", "trl", [], {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload", default=str(HERE / ".workload"), help="built there first if it is missing"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=None, help="prompts per epoch (default: all 32)")
    parser.add_argument("--modes", default="peer,batched")
    parser.add_argument("--libraries", default="comarl,floor,trl")
    args = parser.parse_args()
    workload = build_workload(args.workload)
    libraries = args.libraries.split(",")
    pythons = {"comarl": Path(sys.executable), "floor": Path(sys.executable)}
    if "trl" in libraries:
        pythons["trl"] = ensure_venv("trl", PEER_REQUIREMENTS["trl"])
    variants = [v for v in VARIANTS if v[1] in libraries]
    for mode in args.modes.split(","):
        seconds: dict[str, list[float]] = {label: [] for label, *_ in variants}
        for r in range(args.repeats):
            for label, library, extra_args, extra_env in variants if r % 2 == 0 else variants[::-1]:
                result = run_case(
                    Case(library, mode, 1),
                    pythons[library],
                    workload,
                    1,
                    args.prompts,
                    1800,
                    "cpu",
                    extra_args,
                    extra_env,
                )
                seconds[label].append(result["seconds"])
                print(f"  {mode} {label}: {result['seconds']:.2f} s", flush=True)
        print(f"\n{mode} mode, 1 agent, one core: median seconds per epoch of {args.repeats} runs")
        medians = {label: statistics.median(values) for label, values in seconds.items()}
        for label, value in medians.items():
            print(f"  {label:<38} {value:7.2f} s")
        for i in range(0, len(variants), 2):
            kept, default = variants[i][0], variants[i + 1][0]
            print(f"  {variants[i][1]}: x{medians[default] / medians[kept]:.3f} from keeping freed memory")
        print(flush=True)


if __name__ == "__main__":
    main()
