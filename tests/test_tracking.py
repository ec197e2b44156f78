import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from comarl.tracking import RunLogger, plot_metrics, read_metrics


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_logger_writes_metrics_samples_and_plot(tmp_path):
    run_dir = tmp_path / "run"
    logged = [
        (1, {"reward": 0.25, "success": 0.0, "loss": 1.5}),
        (2, {"reward": 0.5, "success": 0.5, "loss": 1.25, "eval/reward": 0.75}),
        (3, {"reward": 1.0, "success": 1.0, "loss": 1.0}),
    ]
    with RunLogger(run_dir, total_steps=3, console=False) as logger:
        for step, metrics in logged:
            logger.log(step, metrics)
        logger.log_samples(2, [{"prompt": "hi", "completion": "hello"}, {"prompt": "a", "completion": "b"}])
        # each line is on disk as soon as it is logged
        assert len(_lines(run_dir / "metrics.jsonl")) == 3

    assert _lines(run_dir / "metrics.jsonl") == [{"step": step, **metrics} for step, metrics in logged]
    assert read_metrics(run_dir / "metrics.jsonl") == [{"step": step, **metrics} for step, metrics in logged]
    assert _lines(run_dir / "samples.jsonl") == [
        {"step": 2, "prompt": "hi", "completion": "hello"},
        {"step": 2, "prompt": "a", "completion": "b"},
    ]
    plot = run_dir / "plot.png"
    assert plot.stat().st_size > 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_tensor_and_numpy_values_become_floats(tmp_path):
    logger = RunLogger(tmp_path, total_steps=1, console=False)
    logger.log(1, {"reward": torch.tensor(0.5), "success": np.float32(1.0), "n": np.int64(3)})
    logger.log_samples(1, [{"reward": torch.tensor(2.0)}])
    logger.close()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row == {"step": 1, "reward": 0.5, "success": 1.0, "n": 3}
    assert isinstance(row["reward"], float)
    assert _lines(tmp_path / "samples.jsonl") == [{"step": 1, "reward": 2.0}]


def test_no_run_dir_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with RunLogger(None, total_steps=2, console=False) as logger:
        logger.log(1, {"reward": 1.0})
        logger.log_samples(1, [{"x": 1}])
        logger.print("hello")
    assert list(tmp_path.iterdir()) == []
    assert "hello" in capsys.readouterr().out


def test_console_progress_bar(tmp_path):
    with RunLogger(tmp_path, total_steps=2, description="demo") as logger:
        logger.log(1, {"reward": 0.1234, "success": 0.5})
        logger.print("a [/message] with brackets")
        logger.log(2, {"loss": 0.3})
        progress = logger._progress
        task = progress.tasks[0]
        assert task.completed == 2
        assert task.total == 2
        assert task.description == "demo reward=0.123 success=0.500"


def test_close_without_plottable_keys_skips_plot(tmp_path):
    with RunLogger(tmp_path, total_steps=1, console=False) as logger:
        logger.log(1, {"loss": 1.0})
    assert not (tmp_path / "plot.png").exists()


def test_plot_metrics_with_eval_only_and_missing_keys(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "\n".join(json.dumps(row) for row in [{"step": 1, "eval/success": 0.5}, {"step": 2, "reward": 1.0}])
    )
    out = plot_metrics(metrics, tmp_path / "out.png", keys=("reward", "success", "missing"))
    assert out == tmp_path / "out.png"
    assert out.stat().st_size > 0


def test_plot_metrics_raises_when_no_key_present(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="reward"):
        plot_metrics(metrics, tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()


def test_import_is_cheap():
    code = (
        "import sys, comarl; before = set(sys.modules); import comarl.tracking; "
        "new = set(sys.modules) - before; "
        "assert not any(m.split('.')[0] in ('rich', 'matplotlib', 'torch') for m in new), sorted(new)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- metric sinks (report_to)

SINK_DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob", "return a + b")]


def _sink_trainer(model, **kw):
    from comarl import MAGRPOConfig, MAGRPOTrainer

    settings = dict(
        prompts_per_step=2,
        num_generations=2,
        max_new_tokens=4,
        max_steps=2,
        progress_bar=False,
        reward_call="batched",
    )
    wandb_config = kw.pop("wandb_config", None)
    settings.update(kw)
    return MAGRPOTrainer(
        model=model,
        num_agents=2,
        train_dataset=SINK_DATA,
        reward_func=lambda a, b: [len(x) - len(y) / 2 for x, y in zip(a, b)],
        args=MAGRPOConfig(**settings),
        wandb_config=wandb_config,
    )


def test_tensorboard_sink_gets_the_logged_metrics(qwen_bpe, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _sink_trainer(qwen_bpe, output_dir=str(tmp_path), report_to=["tensorboard"]).train()
    logged = read_metrics(tmp_path / "metrics.jsonl")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("reward", "agent_1/loss"):
        points = events.Scalars(key)
        assert [p.step for p in points] == [1, 2]
        assert [p.value for p in points] == pytest.approx([row[key] for row in logged])
    # the completions of each logged step as a markdown table (one row per sample of samples.jsonl)
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1, 2]
    table = texts[0].tensor_proto.string_val[0].decode().splitlines()
    assert table[:2] == [
        "| step | prompts | completions | rewards | advantages |",
        "| --- | --- | --- | --- | --- |",
    ]
    assert len(table) == 2 + 2 and table[2].startswith('| 1 | ["')  # two samples (log_completions=2)


def test_a_new_run_into_a_used_folder_replaces_its_logs(qwen_bpe, tmp_path):
    """A run that does not resume replaces an earlier run's logs in its output_dir, as it replaces its checkpoints:
    metrics.jsonl and samples.jsonl were appended to (steps 1, 2, 1, 2) and TensorBoard showed both runs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for _ in range(2):
        _sink_trainer(qwen_bpe, output_dir=str(tmp_path), report_to=["tensorboard"]).train()
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    samples = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted(set(samples)) == [1, 2] and len(samples) == 2 * samples.count(1)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [p.step for p in events.Scalars("reward")] == [1, 2]


def test_non_finite_metrics_are_written_as_null(tmp_path):
    """json.dumps writes NaN / Infinity, which JSON parsers (JSON.parse, jq) reject: they are written as null,
    and the plot skips them."""
    with RunLogger(tmp_path, total_steps=2) as logger:
        logger.log(1, {"reward": float("nan"), "agent_0/grad_norm": float("inf"), "success": 0.5})
        logger.log(2, {"reward": 0.25, "agent_0/grad_norm": 1.0, "success": 0.5})
        logger.log_samples(1, [{"rewards": [float("-inf"), 1.0]}])
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read_metrics(tmp_path / "metrics.jsonl")[0] == {
        "step": 1, "reward": None, "agent_0/grad_norm": None, "success": 0.5
    }  # fmt: skip
    assert json.loads((tmp_path / "samples.jsonl").read_text())["rewards"] == [None, 1.0]
    assert (tmp_path / "plot.png").exists()


def test_the_progress_bar_moves_every_step_not_only_on_logged_ones(qwen_bpe, monkeypatch):
    """With logging_steps=3 the bar stood at 0 for three steps, then jumped."""
    from comarl import tracking

    seen = []
    advance = tracking.RunLogger.advance
    monkeypatch.setattr(
        tracking.RunLogger, "advance", lambda self, step: seen.append(step) or advance(self, step)
    )
    _sink_trainer(qwen_bpe, max_steps=4, logging_steps=3).train()
    assert seen == [1, 2, 3, 4]


def test_comlrl_wandb_config_logs_to_wandb(qwen_bpe, tmp_path, monkeypatch):
    """CoMLRL's wandb_config= turns the W&B sink on: wandb.init gets its project, name and dir, every logged step
    goes to run.log with its step, and the run is finished (a stand-in wandb module records the calls)."""
    import types

    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", step, metrics))

        def finish(self, exit_code=None):
            calls.append(("finish", exit_code))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    fake.Table = lambda columns, data: ("table", columns, data)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sections = {"dataset": {"name": "tldr", "type": "summary"}, "output": {"verbose": False}}
    trainer = _sink_trainer(
        qwen_bpe,
        wandb_config={"project": "team", "name": "first", "dir": str(tmp_path), "config_sections": sections},
    )
    assert trainer.args.report_to == ["wandb"]
    last = trainer.train()
    assert calls[-1] == ("finish", 0)
    init = calls[0][1]
    assert (init["project"], init["name"], init["dir"]) == ("team", "first", str(tmp_path))
    assert init["config"]["num_generations"] == 2
    # CoMLRL's config_sections join the run's config, the dataset's name and type as dataset_name / dataset_type
    assert init["config"]["output"] == {"verbose": False}
    assert (init["config"]["dataset_name"], init["config"]["dataset_type"]) == ("tldr", "summary")
    metrics = [c for c in calls if c[0] == "log" and "samples" not in c[2]]
    assert [c[1] for c in metrics] == [1, 2] and metrics[-1][2]["reward"] == pytest.approx(last["reward"])
    # each logged step's samples as a W&B table: a row per sample, agents' lists as JSON text
    tables = [(c[1], c[2]["samples"]) for c in calls if c[0] == "log" and "samples" in c[2]]
    assert [step for step, _ in tables] == [1, 2]
    _, columns, rows = tables[0][1]
    assert columns == ["step", "prompts", "completions", "rewards", "advantages"]
    assert len(rows) == 2 and rows[0][0] == 1 and len(json.loads(rows[0][2])) == 2  # two agents' completions
    # a run that crashes is finished as failed (exit code 1), not shown as finished
    crashing = _sink_trainer(qwen_bpe, wandb_config={"project": "team"})
    crashing.training_step = lambda items, seeds: 1 / 0
    with pytest.raises(Exception, match="division by zero"):
        crashing.train()
    assert calls[-1] == ("finish", 1)


def test_wandb_sink_runs_offline(qwen_bpe, tmp_path, monkeypatch):
    """The real wandb package, offline: the run starts, logs and finishes into output_dir/wandb."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _sink_trainer(qwen_bpe, output_dir=str(tmp_path), report_to=["wandb"], run_name="offline-check").train()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))[0].stat().st_size > 0


def test_trackio_sink_logs_every_step(qwen_bpe, tmp_path):
    """The real trackio package, storing into TRACKIO_DIR (read when trackio is imported: a fresh process)."""
    script = f"""
import torch
torch.set_num_threads(1)
from tests.test_tracking import _sink_trainer
_sink_trainer({qwen_bpe!r}, report_to=["trackio"], trackio_project="sink-check", run_name="r1").train()
from trackio.sqlite_storage import SQLiteStorage
logs = SQLiteStorage.get_logs("sink-check", "r1")
print([row["step"] for row in logs if "reward" in row], sorted(k for k in [r for r in logs if "reward" in r][-1] if k.startswith("agent_1/"))[:2])
print([row["step"] for row in logs if "samples" in row])
"""
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).parent.parent))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-2:] == [
        "[1, 2] ['agent_1/advantage_abs', 'agent_1/clip_fraction']",
        "[1, 2]",  # the samples table of each logged step
    ]


def test_report_to_is_checked():
    from comarl import ConfigError, MAGRPOConfig

    with pytest.raises(ConfigError, match=r"report_to=\['mlflow'\]: unknown \['mlflow'\]"):
        MAGRPOConfig(report_to=["mlflow"])
    assert MAGRPOConfig(report_to="trackio").report_to == ["trackio"]
    with pytest.raises(ConfigError, match=r"report_to=\['tensorboard'\] writes into output_dir/tensorboard"):
        MAGRPOConfig(report_to="tensorboard")
    assert MAGRPOConfig(report_to="none").report_to == []


def test_cli_plot_draws_a_run_folder(tmp_path, capsys):
    from comarl.cli import main

    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "reward": s / 10, "agent_0/loss": 1 / s}) for s in range(1, 4))
    )
    assert main(["plot", str(tmp_path), "--keys", "reward", "agent_0/loss"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path), "--keys", "success"]) == 2
    assert capsys.readouterr().err.endswith(
        "metrics.jsonl; it has ['agent_0/loss', 'reward']\n"
    )  # what the run did log
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "nowhere/metrics.jsonl does not exist" in capsys.readouterr().err
    assert main(["plot", str(tmp_path), "--out", "/proc/plot.png"]) == 2
    assert capsys.readouterr().err.startswith("comarl: error: comarl plot: cannot write /proc/plot.png (")
    with open(tmp_path / "metrics.jsonl", "a") as handle:  # a corrupt row between two good ones
        handle.write('\n{"step": 4, "rew\n{"step": 5, "reward": 0.5}\n')
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(
        f"comarl: error: comarl plot: {tmp_path / 'metrics.jsonl'}, line 4:"
    )


def test_plot_of_a_run_stopped_mid_row_into_a_new_folder(tmp_path, capsys):
    from comarl.cli import main

    # the run was killed while it wrote its third row
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.1}\n{"step": 2, "reward": 0.2}\n{"st')
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward": 0.1},
        {"step": 2, "reward": 0.2},
    ]
    out = tmp_path / "figures" / "run.png"
    assert main(["plot", str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


class _RecordingSink:
    """A metric sink that records its calls."""

    def __init__(self):
        self.calls = []

    def log(self, step, metrics):
        self.calls.append(("log", step, metrics))

    def log_samples(self, step, columns, rows):
        self.calls.append(("log_samples", step, columns, rows))

    def close(self, failed=False):
        self.calls.append(("close", failed))


def test_sinks_get_the_numeric_metrics_as_floats_and_the_samples_as_one_table(tmp_path):
    """The step is the sinks' step argument, not a metric; text and null metrics stay in metrics.jsonl alone; a
    sample's lists become JSON text, its text, numbers and None stay as they are; no samples, no table."""
    sink = _RecordingSink()
    with RunLogger(tmp_path, total_steps=3, console=False, sinks=[sink]) as logger:
        logger.log(3, {"reward": 1, "success": 0.5, "note": "warm-up", "loss": None})
        logger.log_samples(3, [{"prompt": "hi", "rewards": [1, 0.5], "score": 2, "error": None}])
        logger.log_samples(3, [])
        logger.close()  # closing again on leaving the block does nothing
    assert sink.calls == [
        ("log", 3, {"reward": 1.0, "success": 0.5}),
        ("log_samples", 3, ["step", "prompt", "rewards", "score", "error"], [[3, "hi", "[1, 0.5]", 2, None]]),
        ("close", False),
    ]
    assert isinstance(sink.calls[0][2]["reward"], float)
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 3, "reward": 1, "success": 0.5, "note": "warm-up", "loss": None}
    ]


def test_samples_with_arrays_and_other_objects_are_written_as_lists_and_text(tmp_path):
    """Tensors and NumPy arrays become JSON lists; any other value JSON cannot hold is written as its text."""
    with RunLogger(tmp_path, total_steps=1, console=False) as logger:
        logger.log_samples(
            1, [{"ids": torch.tensor([3, 4]), "scores": np.array([0.5, 1.5]), "path": Path("a/b")}]
        )
    assert _lines(tmp_path / "samples.jsonl") == [
        {"step": 1, "ids": [3, 4], "scores": [0.5, 1.5], "path": "a/b"}
    ]


def test_tensorboard_samples_table_escapes_pipes_and_newlines(tmp_path):
    """A completion's "|" would end its markdown cell and a newline its row: they are written as \\| and <br>."""
    from comarl.tracking import TensorBoardSink

    sink = TensorBoardSink(tmp_path)
    texts = []
    sink.writer.close()
    sink.writer = type("Writer", (), {"add_text": lambda self, *args: texts.append(args)})()
    sink.log_samples(2, ["step", "completion"], [[2, "a|b\nc"]])
    assert texts == [("samples", "| step | completion |\n| --- | --- |\n| 2 | a\\|b<br>c |", 2)]


def test_tensorboard_of_a_resumed_run_hides_the_steps_it_redoes(tmp_path):
    """A run stopped after step 3 resumes from its checkpoint at step 2: step 3 is logged again and shows once, with
    the new value; steps 1 and 2 stay."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from comarl.tracking import TensorBoardSink

    first = TensorBoardSink(tmp_path, start_step=0)
    for step in (1, 2, 3):
        first.log(step, {"reward": float(step)})
    first.close()
    resumed = TensorBoardSink(tmp_path, start_step=2)
    resumed.log(3, {"reward": 30.0})
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(p.step, p.value) for p in events.Scalars("reward")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_advance_moves_the_bar_to_the_step(tmp_path):
    """advance(step) sets the bar to step of total_steps (a resumed run starts it at its checkpoint's step)."""
    with RunLogger(tmp_path, total_steps=5, description="demo") as logger:
        logger.advance(3)
        logger.advance(4)
        assert logger._progress.tasks[0].completed == 4


def test_closing_a_logger_that_logged_nothing_draws_no_plot(tmp_path):
    """A run that stops before its first logged step has no metrics.jsonl: close writes no plot and raises nothing."""
    RunLogger(tmp_path, total_steps=3, console=False).close()
    assert list(tmp_path.iterdir()) == []


def test_read_metrics_skips_blank_lines_and_refuses_rows_that_are_not_metrics(tmp_path):
    """Blank lines are skipped; a row without an integer step, or a corrupt row that was written whole (it ends in a
    newline, so no crash cut it off), is an error naming its line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n\n{"step": 2, "reward": 0.75}\n')
    assert read_metrics(path) == [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.75}]
    for second_row, problem in (
        ('{"reward": 0.75}', "a metrics row is a JSON object with an integer 'step'"),
        ('{"step": "2"}', "a metrics row is a JSON object with an integer 'step'"),
        ('{"step": 2, "rew', "not a JSON object"),
    ):
        path.write_text('{"step": 1}\n' + second_row + "\n")
        with pytest.raises(ValueError, match=f"metrics.jsonl, line 2: {problem}"):
            read_metrics(path)


def _png_size(path):
    """Width and height in pixels, from the PNG's header chunk."""
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_draws_one_panel_per_key_with_train_or_eval_values(tmp_path):
    """By default reward and success, each a 5 x 3.5 inch panel at 100 dpi; a key logged only as eval/<key> has its
    panel; a key whose values are all null (NaN, inf) has none."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "eval/success": 0.5}\n{"step": 2, "reward": 1.0}\n')
    assert _png_size(plot_metrics(metrics, tmp_path / "both.png")) == (2 * 500, 350)
    metrics.write_text('{"step": 1, "reward": null, "success": 0.5}\n{"step": 2, "reward": null}\n')
    assert _png_size(plot_metrics(metrics, tmp_path / "one.png")) == (500, 350)


def test_run_config_keeps_the_order_it_is_given(tmp_path):
    """config.yaml reads trainer, agents, then the args in their order (not sorted by name)."""
    from comarl.tracking import write_run_config

    config = {
        "trainer": "MAGRPOTrainer",
        "agents": [{"source": "m"}],
        "args": {"seed": 1, "learning_rate": 0.5},
    }
    write_run_config(tmp_path, config)
    text = "trainer: MAGRPOTrainer\nagents:\n- source: m\nargs:\n  seed: 1\n  learning_rate: 0.5\n"
    assert (tmp_path / "config.yaml").read_text() == text
