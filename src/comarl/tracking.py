"""Run-folder outputs (metrics, samples, plot), a console progress bar, and optional metric sinks.

A run folder gets ``metrics.jsonl`` (one JSON object per logged step), ``samples.jsonl``
(example rollouts) and, when the run closes, ``plot.png``. The sinks ``TensorBoardSink`` and
``WandbSink`` (config ``report_to``) receive the same numeric metrics. ``rich``, ``matplotlib``,
``tensorboard`` and ``wandb`` are imported only when needed, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
PLOT_FILE = "plot.png"
CONFIG_FILE = "config.yaml"
LIVE_KEYS = ("reward", "success")


def _to_plain(value: Any) -> Any:
    """Turn torch tensors and numpy scalars/arrays into plain Python values for JSON."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def json_ready(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) inside it, at any depth, replaced by None."""
    value = _to_plain(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    plain = _to_plain(value)
    if plain is value:
        return str(value)
    return plain


class TensorBoardSink:
    """Scalars to TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard``; needs ``tensorboard``)."""

    def __init__(self, log_dir: str | Path, start_step: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "report_to=['tensorboard'] needs tensorboard: pip install 'comarl[tensorboard]'"
            ) from error
        # Steps after ``start_step`` that earlier event files hold (a resumed run redoes them; a new run into the
        # same folder replaces them) are hidden, as the JSONL logs drop their rows.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        """The samples as a markdown table in the Text tab."""
        cells = [[str(value).replace("|", "\\|").replace("\n", "<br>") for value in row] for row in rows]
        lines = [columns, ["---"] * len(columns), *cells]
        self.writer.add_text("samples", "\n".join("| " + " | ".join(line) + " |" for line in lines), step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbSink:
    """Metrics to a Weights & Biases run; ``init`` holds ``wandb.init`` arguments (project, name, entity, dir, ...)."""

    def __init__(self, init: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError("report_to=['wandb'] needs wandb: pip install 'comarl[wandb]'") from error
        self.run = wandb.init(**init)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        import wandb

        self.run.log({"samples": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a crashed run must not show as finished


class TrackioSink:
    """Metrics to a trackio run (local-first, W&B-like API); ``init`` holds ``trackio.init`` arguments."""

    def __init__(self, init: dict[str, Any]) -> None:
        try:
            import trackio
        except ImportError as error:
            raise ImportError("report_to=['trackio'] needs trackio: pip install 'comarl[trackio]'") from error
        self.trackio = trackio
        trackio.init(**init)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.trackio.log(metrics, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.trackio.log({"samples": self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self, failed: bool = False) -> None:
        self.trackio.finish()


class RunLogger:
    """Write metrics and samples to a run folder and show training progress on the console.

    ``run_dir=None`` writes nothing to disk; ``console=False`` draws no progress bar. Steps are
    1-based: ``log(step, ...)`` moves the bar to ``step`` of ``total_steps``. Use it as a context
    manager, or call :meth:`close` at the end (which also writes ``plot.png``).
    """

    def __init__(
        self,
        run_dir: str | Path | None,
        *,
        total_steps: int,
        console: bool = True,
        description: str = "training",
        sinks: Sequence[Any] = (),
    ) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        # objects with log(step, metrics), log_samples(step, columns, rows) and close(), e.g. TensorBoardSink
        self.sinks = list(sinks)
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.description = description
        self._live: dict[str, float] = {}
        self._closed = False
        self._progress: Progress | None = None
        if console:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task(description, total=total_steps)
            self._progress.start()

    @property
    def metrics_path(self) -> Path | None:
        """Path of ``metrics.jsonl``, or ``None`` when nothing is written to disk."""
        return self.run_dir / METRICS_FILE if self.run_dir is not None else None

    def _write(self, name: str, row: dict[str, Any]) -> None:
        if self.run_dir is None:
            return
        # NaN and inf as null: json.dumps would write NaN / Infinity, which is not JSON (JSON.parse, jq reject it)
        text = json.dumps(json_ready(row), default=_json_default, allow_nan=False)
        with open(self.run_dir / name, "a", encoding="utf-8") as handle:
            handle.write(text + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append ``{"step": step, **metrics}`` to ``metrics.jsonl`` and advance the progress bar."""
        row = {"step": step, **{key: _to_plain(value) for key, value in metrics.items()}}
        self._write(METRICS_FILE, row)
        numbers = {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, int | float)}
        for sink in self.sinks:
            sink.log(step, numbers)
        for key in LIVE_KEYS:
            if isinstance(row.get(key), int | float):
                self._live[key] = float(row[key])
        if self._progress is not None:
            live = " ".join(f"{key}={value:.3f}" for key, value in self._live.items())
            description = f"{self.description} {live}" if live else self.description
            self._progress.update(self._task, completed=step, description=description)

    def advance(self, step: int) -> None:
        """Move the progress bar to ``step`` (every step; ``log`` only runs every ``logging_steps``)."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Append each sample, tagged with ``step``, as one line of ``samples.jsonl``; the sinks get them as one
        table (columns ``step`` and the samples' keys; a list, one entry per agent, as JSON text)."""
        for sample in samples:
            self._write(SAMPLES_FILE, {"step": step, **sample})
        if samples and self.sinks:
            columns = ["step", *samples[0]]
            rows = [[step, *(_table_cell(sample.get(key)) for key in columns[1:])] for sample in samples]
            for sink in self.sinks:
                sink.log_samples(step, columns, rows)

    def print(self, message: str) -> None:
        """Print a message (above the progress bar when one is shown); rich markup is not parsed."""
        if self._progress is not None:
            self._progress.console.print(message, markup=False)
        else:
            print(message)

    def close(self, failed: bool = False) -> None:
        """Stop the progress bar, close the sinks (telling them whether the run ``failed``) and write ``plot.png``
        if metrics were logged."""
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        for sink in self.sinks:
            sink.close(failed)
        metrics_path = self.metrics_path
        if metrics_path is not None and metrics_path.exists():
            # ValueError: none of the plotted keys was logged, so there is nothing to draw.
            with contextlib.suppress(ValueError):
                plot_metrics(metrics_path, metrics_path.with_name(PLOT_FILE))

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)


def _table_cell(value: Any) -> Any:
    """A sample's value as a table cell: text and numbers as they are, anything else as JSON text."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    return json.dumps(json_ready(value), default=_json_default)


def write_run_config(run_dir: str | Path, config: dict[str, Any]) -> None:
    """Write ``config`` (plain values: the trainer, its agents, its args) as ``run_dir/config.yaml``."""
    import yaml

    (Path(run_dir) / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))


def read_metrics(path: str | Path) -> list[dict]:
    """Read a ``metrics.jsonl`` file into a list of dicts (blank lines are skipped, and a last row cut off by a
    run killed while writing it)."""
    with open(path, encoding="utf-8") as handle:
        lines = [(number, line) for number, line in enumerate(handle, 1) if line.strip()]
    if lines and not lines[-1][1].endswith("\n"):
        try:
            json.loads(lines[-1][1])
        except json.JSONDecodeError:
            lines.pop()
    rows = []
    for number, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not a JSON object ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}, line {number}: a metrics row is a JSON object with an integer 'step'")
        rows.append(row)
    return rows


def _number(value: Any) -> bool:
    return isinstance(value, int | float)


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(row["step"], row[key]) for row in rows if _number(row.get(key))]
    return [step for step, _ in points], [value for _, value in points]


def plot_metrics(
    metrics_path: str | Path, out_path: str | Path, keys: Sequence[str] = ("reward", "success")
) -> Path:
    """Plot ``keys`` from a ``metrics.jsonl`` against step and save a PNG to ``out_path``.

    One subplot per key found in the metrics; ``eval/<key>``, when logged, is drawn on the same
    subplot as a second line with markers. Keys missing from every row are skipped; if none is
    present a ``ValueError`` is raised.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(metrics_path)
    present = [key for key in keys if any(_series(rows, name)[0] for name in (key, f"eval/{key}"))]
    if not present:
        logged = sorted(
            {key for row in rows for key, value in row.items() if key != "step" and _number(value)}
        )
        raise ValueError(f"none of the keys {list(keys)} is in {metrics_path}; it has {logged}")

    figure = Figure(figsize=(5 * len(present), 3.5))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(present), squeeze=False)[0]
    for ax, key in zip(axes, present):
        steps, values = _series(rows, key)
        if steps:
            ax.plot(steps, values, label="train")
        eval_steps, eval_values = _series(rows, f"eval/{key}")
        if eval_steps:
            ax.plot(eval_steps, eval_values, marker="o", label="eval")
            ax.legend()
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    figure.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)  # e.g. `comarl plot RUN --out figures/run.png`
    figure.savefig(out_path, dpi=100)
    return out_path
