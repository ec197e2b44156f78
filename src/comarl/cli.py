"""Command line: ``comarl demo``, ``comarl train CONFIG.yaml [--set key=value ...]``, ``comarl fields``, ``comarl eval``, ``comarl bench``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from comarl.config import TRAINERS, ConfigError, RunSpec, config_class, config_help, load_run_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="comarl", description="Train teams of LLMs with multi-agent RL.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train two tiny agents to coordinate, offline on the CPU")
    demo.add_argument("--out", default=None, help="run folder (default: runs/demo-<time>)")
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the team and the training (default 0)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")

    train = sub.add_parser("train", help="train from a YAML run spec")
    train.add_argument(
        "config", help="YAML file with trainer, task, model/agents, dataset, reward_funcs, args"
    )
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run field or a trainer field (args.<field> or <field>); repeatable",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in output_dir/checkpoints (written every args.save_steps)",
    )

    fields = sub.add_parser("fields", help="list a trainer's config fields with their help")
    fields.add_argument(
        "trainer", nargs="?", default="magrpo", help=f"{', '.join(TRAINERS)} (default magrpo)"
    )

    evaluate = sub.add_parser(
        "eval", help="evaluate a team, one model or a pipeline on the code, writing or demo task"
    )
    evaluate.add_argument("--task", required=True, help="code, writing or demo")
    team_source = evaluate.add_mutually_exclusive_group(required=True)
    team_source.add_argument("--run", help="a training run folder: loads RUN/agents/agent_0, agent_1, ...")
    team_source.add_argument(
        "--models", nargs="+", help="model paths or hub ids, one per agent (e.g. base models)"
    )
    evaluate.add_argument("--mode", default="team", help="team (default), single (one model) or pipeline")
    evaluate.add_argument("--samples", type=int, default=1, help="episodes per item, n of pass@k (default 1)")
    evaluate.add_argument(
        "--k", type=int, nargs="+", default=[1], help="k values of pass@k (each <= --samples)"
    )
    evaluate.add_argument("--split", default="eval", help="the task's split (default eval)")
    evaluate.add_argument(
        "--source",
        default=None,
        help="the task's data source (default: writing and demo local, code humaneval)",
    )
    evaluate.add_argument("--limit", type=int, default=None, help="evaluate the first LIMIT items only")
    evaluate.add_argument(
        "--turns", type=int, default=1, help="turns per episode (code feedback rounds; default 1)"
    )
    evaluate.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="default: greedy for --samples 1, else 1.0; 0 is greedy",
    )
    evaluate.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens per answer (default: the task's, 256; demo 3)",
    )
    evaluate.add_argument("--batch-size", type=int, default=8, help="items per batched generate call")
    evaluate.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    evaluate.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    evaluate.add_argument(
        "--json", dest="json_path", default=None, help="also write the result (with samples) here"
    )

    plot = sub.add_parser("plot", help="draw a run's metrics (metrics.jsonl) into a PNG")
    plot.add_argument("run_dir", help="a run folder with metrics.jsonl")
    plot.add_argument(
        "--keys",
        nargs="+",
        default=["reward", "success"],
        help="metrics to draw, one panel each (eval/<key> too; default: reward success)",
    )
    plot.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/plot.png)")

    bench = sub.add_parser(
        "bench", help="speed benchmark against CoMLRL and TRL (needs a source checkout; installs the peers)"
    )
    bench.add_argument("--quick", action="store_true", help="smoke run: 8 prompts, one repeat")
    bench.add_argument("--repeats", type=int, default=None, help="repeats per case (default 2)")
    bench.add_argument("--threads", type=int, default=1, help="torch threads of every measured process")
    bench.add_argument("--device", default="cpu", help="cpu (default) or cuda: where every library trains")

    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "train":
            return _train(load_run_spec(args.config, args.overrides), resume=args.resume)
        if args.command == "eval":
            return _eval(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "plot":
            return _plot(args)
        return _fields(args.trainer)
    except ConfigError as exc:
        print(f"comarl: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left early (`comarl fields magrpo | head`): no traceback
        # Python flushes stdout again at exit; point it at devnull so that flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _plot(args: argparse.Namespace) -> int:
    from comarl.tracking import METRICS_FILE, plot_metrics

    metrics = Path(args.run_dir) / METRICS_FILE
    if not metrics.is_file():
        raise ConfigError(f"comarl plot: {metrics} does not exist; give a run folder (output_dir of a run)")
    out = Path(args.out or Path(args.run_dir) / "plot.png")
    try:
        out = plot_metrics(metrics, out, args.keys)
    except ValueError as exc:  # a corrupt row, or none of the keys logged
        raise ConfigError(f"comarl plot: {exc}") from None
    except OSError as exc:
        raise ConfigError(
            f"comarl plot: cannot write {out} ({exc.strerror or exc}); choose another --out"
        ) from None
    print(out)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from comarl.config import MAX_SEED
    from comarl.tasks.demo import DEMO_STEPS, run_demo
    from comarl.trainers.magrpo import MAGRPOTrainer

    if args.steps is not None and args.steps < 1:
        raise ConfigError(
            f"--steps {args.steps}: give a number of training steps >= 1 (default {DEMO_STEPS})"
        )
    if not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed {args.seed}: give an integer in [0, 2**31 - 1] (default 0)")
    if args.out is not None:
        try:
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--out {args.out}: cannot create it ({exc.strerror or exc})") from None
    summary = run_demo(
        MAGRPOTrainer,
        args.out,
        max_steps=DEMO_STEPS if args.steps is None else args.steps,
        seed=args.seed,
        progress_bar=not args.no_progress,
    )
    print(
        f"joint success: {summary['success_before']:.1%} before training (sampled) -> "
        f"{summary['success_after']:.1%} after (greedy)"
    )
    print("the trained team's greedy answers in one city (open places -> alice's / bob's answer):")
    for places, answers in summary["conventions"].items():
        print(f"  {places:<18} -> {' / '.join(answers)}")
    print(f"run folder: {summary['run_dir']} (config.yaml, metrics.jsonl, plot.png, samples.jsonl, agents/)")
    print(f"evaluate it again: comarl eval --task demo --run {summary['run_dir']}")
    return 0


def _train(spec: RunSpec, resume: bool = False) -> int:
    from comarl.tasks import demo
    from comarl.trainers import actor_critic, magrpo, preference

    trainer_cls = {
        "magrpo": magrpo.MAGRPOTrainer,
        "mareinforce": magrpo.MAREINFORCETrainer,
        "marloo": magrpo.MARLOOTrainer,
        "maremax": magrpo.MAReMaxTrainer,
        "iac": actor_critic.IACTrainer,
        "maac": actor_critic.MAACTrainer,
        "ippo": actor_critic.IPPOTrainer,
        "mappo": actor_critic.MAPPOTrainer,
        "madpo": preference.MADPOTrainer,
        "marlhf": preference.MARLHFTrainer,
    }[spec.trainer]
    args = spec.trainer_args()
    demo_base = Path(args.output_dir or "runs/demo") / "base_models" if spec.task == "demo" else None
    if resume:  # checked before any model loads, as the config is (train() checks the loaded agents again)
        from comarl.checkpoint import CHECKPOINTS, check_resumable, completed_checkpoints

        found = completed_checkpoints(args.output_dir) if args.output_dir else []
        if not found:
            where = Path(args.output_dir) / CHECKPOINTS if args.output_dir else "output_dir (not set)"
            raise ConfigError(
                f"--resume: no finished checkpoint in {where}; run without --resume to start the run (it writes "
                "one every args.save_steps)"
            )
        several = args.agent_parallel or args.data_parallel
        if demo_base is not None:
            sources = demo.team_folders(demo_base)
        else:
            sources = spec.agents or [spec.model] * spec.num_agents
        processes = int(os.environ.get("WORLD_SIZE", "1")) if several else 1
        check_resumable(found[-1], trainer_cls.__name__, spec.num_agents, processes, args, sources)
    env = None
    if spec.task == "demo":
        # Every process (under torchrun) builds the same tiny team into the same folders (tiny_model renames each
        # build into place), so every process's agents have the sources the checkpoint records.
        trainer = demo.demo_trainer(trainer_cls, demo.build_team(demo_base, seed=args.seed), args)
    elif spec.task in ("code", "writing"):
        from comarl.evaluation import task_protocol

        task = task_protocol(spec.task)
        source = spec.source or task.default_source
        env = task.make_env(spec.num_agents, args.num_turns)  # this run's: closed when it ends
        trainer = trainer_cls(
            model=spec.model,
            agents=spec.agents,
            num_agents=None if spec.agents else spec.num_agents,
            train_dataset=task.load_items("train", source),
            eval_dataset=task.load_items("eval", source),
            env=env,
            args=args,
        )
    else:
        column = spec.prompt_column
        train_dataset, eval_dataset = _load_dataset(spec.dataset), _load_dataset(spec.eval_dataset)
        for name, data in (("dataset", train_dataset), ("eval_dataset", eval_dataset)):
            # checked before the run starts: a KeyError at the first prompt came after the folder's logs were replaced
            if data is not None and len(data) and (not isinstance(data[0], dict) or column not in data[0]):
                keys = sorted(data[0]) if isinstance(data[0], dict) else type(data[0]).__name__
                raise ConfigError(
                    f"prompt_column={column!r}: the first item of {name} has no such key ({keys})"
                )
        trainer = trainer_cls(
            model=spec.model,
            agents=spec.agents,
            num_agents=None if spec.agents else spec.num_agents,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            reward_func=[_import_callable(name) for name in spec.reward_funcs or []],
            formatters=lambda item: item[column],
            args=args,
        )
    try:
        metrics = trainer.train(resume_from_checkpoint=True if resume else None)
    finally:
        if env is not None:
            env.close()  # the code task's sandbox pool
    if trainer.processes is None or trainer.processes.rank == 0:  # one summary per run, not per process
        if not metrics:  # resumed at its last step: nothing to train; the run's rows are in its log
            done = f"step {trainer.step} of {trainer.total_steps}"
            print(f"comarl: the run had finished ({done}); nothing to train")
        else:
            # 4 significant digits, not 4 decimals: a learning rate of 1e-5 must not print as 0.0
            summary = {k: float(f"{v:.4g}") for k, v in metrics.items() if not k.startswith("time/")}
            print(json.dumps(summary, indent=1))
    if trainer.processes is not None:
        from comarl.distributed import finish

        finish(0)  # under torchrun: leave without the interpreter teardown that can abort a finished run
    return 0


def _eval(args: argparse.Namespace) -> int:
    from comarl import evaluation

    sources = [str(p) for p in evaluation.run_agent_paths(args.run)] if args.run else args.models
    # Every flag is checked before a model loads.
    evaluation.check_request(
        args.task,
        args.mode,
        len(sources),
        args.samples,
        args.k,
        args.turns,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
    )
    items = evaluation.task_items(args.task, args.split, args.source, args.limit)
    device = evaluation.check_device(args.device)
    if args.json_path:
        evaluation.check_output(args.json_path)
    agents = evaluation.load_agents(sources, device)
    result = evaluation.evaluate_task(
        args.task,
        agents,
        args.mode,
        args.samples,
        args.k,
        args.split,
        source=args.source,
        limit=args.limit,
        num_turns=args.turns,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        items=items,
    )
    evaluation.print_table(result)
    if args.json_path:
        try:
            print(f"written: {evaluation.write_json(result, args.json_path)}")
        except OSError as exc:  # e.g. the disk filled up during the evaluation
            raise ConfigError(f"--json {args.json_path}: cannot write it ({exc.strerror or exc})") from None
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks/bench.py`` of this checkout with this Python (it makes the peers' own venvs)."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
    if not script.exists():
        raise ConfigError(
            f"comarl bench runs {script}, which only a source checkout has; clone the repository and run it there"
        )
    command = [sys.executable, str(script), "--threads", str(args.threads), "--device", args.device]
    command += ["--quick"] if args.quick else []
    command += ["--repeats", str(args.repeats)] if args.repeats is not None else []
    return subprocess.run(command, check=False).returncode


def _fields(trainer: str) -> int:
    try:
        cls = config_class(trainer)
    except KeyError:
        raise ConfigError(f"unknown trainer {trainer!r}; choose one of {', '.join(TRAINERS)}") from None
    for name, text in config_help(cls).items():
        print(f"{name:<26} {text}")
    return 0


def _load_dataset(source: str | None) -> Any:
    if source is None:
        return None
    if source.endswith((".json", ".jsonl")):
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"dataset: {source} does not exist")
        text = path.read_text()
        try:
            if source.endswith(".jsonl"):
                return [json.loads(line) for line in text.splitlines() if line.strip()]
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"dataset: {source} is not valid JSON ({exc.msg}: {exc.doc[:60]!r})") from None
        if not isinstance(data, list):
            raise ConfigError(f"dataset: {source} must hold a JSON list of objects")
        return data
    import datasets

    try:
        return datasets.load_dataset(source, split="train")
    except OSError as exc:  # no such file or hub dataset (FileNotFoundError), or offline (ConnectionError)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"dataset: cannot load {source!r} ({first}); give a .json/.jsonl path or a datasets hub name"
        ) from None


def _import_callable(name: str) -> Callable[..., Any]:
    """'package.module:function' or 'path/to/file.py:function'."""
    if ":" not in name:
        raise ConfigError(f"reward_funcs: {name!r} must look like 'module:function' or 'file.py:function'")
    module_name, func_name = name.rsplit(":", 1)
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.exists():
            raise ConfigError(f"reward_funcs: {module_name} does not exist")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"reward_funcs: cannot import {module_name!r}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"reward_funcs: {module_name} has no function {func_name!r}")
    return func


if __name__ == "__main__":
    sys.exit(main())
