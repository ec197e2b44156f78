import json
import subprocess
import sys

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
