"""The offline demo learns, the CLI runs it from YAML, and bad CLI input is a one-line error."""

from __future__ import annotations

import json

import pytest

from comarl.cli import main
from comarl.tasks import demo
from comarl.trainers.magrpo import MAGRPOTrainer


def test_meeting_reward_by_hand():
    alice = ["park .", "cafe", "museum now", ""]
    bob = ["park", "station", "museum", "park"]
    open_places = [["park", "cafe"], ["cafe", "park"], ["park", "cafe"], ["park", "cafe"]]
    # same open place -> 1; cafe open, station not -> 0.25; museum not open for either -> 0; bob only -> 0.25
    assert demo.meeting_reward(alice, bob, open_places) == [1.0, 0.25, 0.0, 0.25]


def test_views_differ_and_name_the_open_places():
    item = {"city": "paris", "open_places": ["park", "cafe"]}
    assert (
        demo.formatter(0)(item)
        == "alice is in paris . the park and the cafe are open . where will you meet bob ?"
    )
    assert (
        demo.formatter(1)(item)
        == "bob is in paris . the cafe and the park are open . where will you meet alice ?"
    )


@pytest.mark.slow
def test_demo_team_learns_to_coordinate(tmp_path):
    """Seeded: from chance (~1% joint success) to >= 90% greedy joint success in 200 steps."""
    summary = demo.run_demo(MAGRPOTrainer, tmp_path / "run", max_steps=200, seed=0, progress_bar=False)
    assert summary["success_before"] <= 0.05
    assert summary["success_after"] >= 0.9
    run = tmp_path / "run"
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "samples.jsonl",
        "plot.png",
        "agents/agent_0/config.json",
        "agents/agent_1/model.safetensors",
    ):
        assert (run / name).exists(), name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "success" in r]
    first, last = train[:20], train[-20:]
    assert sum(r["success"] for r in first) / 20 < 0.1
    assert sum(r["success"] for r in last) / 20 > 0.8


def test_cli_train_from_yaml_with_overrides(tmp_path, capsys):
    spec = tmp_path / "run.yaml"
    spec.write_text(
        "trainer: magrpo\ntask: demo\nargs:\n  max_steps: 2\n  max_new_tokens: 3\n  progress_bar: false\n  prompts_per_step: 2\n"
        "  num_generations: 2\n  reward_call: batched\n  success_threshold: 1.0\n"
    )
    out = tmp_path / "out"
    assert main(["train", str(spec), "--set", f"output_dir={out}", "--set", "args.learning_rate=1e-5"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "reward" in printed and "eval/success" in printed
    assert "learning_rate: 1.0e-05" in (out / "config.yaml").read_text()
    assert printed["agent_0/lr"] == 1e-5  # the summary keeps 4 significant digits, not 4 decimals (0.0)
    # steps 1 and 2, then the final evaluation of the trained team at step 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], "eval/success" in row) for row in rows] == [(1, False), (2, False), (2, True)]


def test_cli_train_resumes_from_the_newest_checkpoint(tmp_path, capsys, monkeypatch):
    spec = tmp_path / "run.yaml"
    spec.write_text(
        "trainer: magrpo\ntask: demo\nargs:\n  max_steps: 2\n  max_new_tokens: 3\n  progress_bar: false\n  prompts_per_step: 2\n"
        "  num_generations: 2\n  reward_call: batched\n  save_steps: 1\n  save_total_limit: 1\n"
    )
    out = tmp_path / "out"
    assert main(["train", str(spec), "--set", f"output_dir={out}"]) == 0
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_2"]
    capsys.readouterr()
    # Resuming a finished run takes no further step: the log still has steps 1 and 2 once each (step 2's
    # training row, then its final evaluation row).
    assert main(["train", str(spec), "--set", f"output_dir={out}", "--resume"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 2]
    # A resume the checkpoint does not fit stops before any model loads (the demo team is not built).
    monkeypatch.setattr(demo, "build_team", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    capsys.readouterr()
    assert main(["train", str(spec), "--set", f"output_dir={out}", "--set", "args.seed=5", "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"comarl: error: resume_from_checkpoint='{out / 'checkpoints' / 'step_2'}': the checkpoint was written with "
        "seed=42, this run has seed=5; resume with the same seed (it shapes the saved state or the data order), or "
        "start a new run from the saved agents\n"
    )
    assert (
        main(["train", str(spec), "--set", f"output_dir={out}", "--set", "trainer=marloo", "--resume"]) == 2
    )
    assert (
        "the checkpoint has trainer='MAGRPOTrainer', this run trainer='MARLOOTrainer'"
        in capsys.readouterr().err
    )


def test_cli_resume_without_a_checkpoint_stops_before_any_model_loads(tmp_path, capsys):
    spec = tmp_path / "run.yaml"
    spec.write_text("task: demo\nargs: {max_steps: 1, save_steps: 1}\n")
    out = tmp_path / "out"
    assert main(["train", str(spec), "--set", f"output_dir={out}", "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"comarl: error: --resume: no finished checkpoint in {out / 'checkpoints'}; "
        "run without --resume to start the run (it writes one every args.save_steps)\n"
    )
    assert not out.exists()  # the demo team was not built


def test_cli_train_function_task(tmp_path, qwen_bpe, capsys):
    (tmp_path / "data.jsonl").write_text('{"prompt": "def add(a, b):"}\n{"prompt": "alice and bob"}\n')
    (tmp_path / "rewards.py").write_text(
        "def longer(a, b):\n    return [len(x) - len(y) for x, y in zip(a, b)]\n"
    )
    spec = tmp_path / "run.yaml"
    spec.write_text(
        f"task: function\nmodel: {qwen_bpe}\nnum_agents: 2\ndataset: {tmp_path / 'data.jsonl'}\n"
        f"reward_funcs: ['{tmp_path / 'rewards.py'}:longer']\n"
        "args: {max_steps: 1, prompts_per_step: 2, num_generations: 2, max_new_tokens: 4, progress_bar: false}\n"
    )
    assert main(["train", str(spec)]) == 0
    assert "reward/longer" in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ('{"prompt": "a"}\n{bad json\n', "is not valid JSON (Expecting property name"),
        (None, "dataset: cannot load"),  # neither a .json/.jsonl file nor a hub dataset
        (
            '{"text": "a"}\n{"text": "b"}\n',
            "prompt_column='prompt': the first item of dataset has no such key",
        ),
    ],
)
def test_cli_function_task_refuses_bad_data_before_the_run_starts(tmp_path, qwen_bpe, capsys, data, message):
    """A dataset that is not JSON, not there, or without the prompt column crashed with a traceback; the missing
    column only at the first step, after the run folder's logs had been replaced."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    path = tmp_path / ("data.jsonl" if data is not None else "data.csv")
    if data is not None:
        path.write_text(data)
    (tmp_path / "rewards.py").write_text("def longer(a, b):\n    return [len(x) for x in a]\n")
    spec = tmp_path / "run.yaml"
    spec.write_text(
        f"task: function\nmodel: {qwen_bpe}\ndataset: {path}\n"
        f"reward_funcs: ['{tmp_path / 'rewards.py'}:longer']\n"
        f"args: {{max_steps: 1, progress_bar: false, output_dir: {out}}}\n"
    )
    assert main(["train", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("comarl: error: ") and message in err
    assert (
        out / "metrics.jsonl"
    ).read_text() == '{"step": 1, "reward": 0.5}\n'  # the earlier run's log is kept


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "nonsense=1"], "--set nonsense: unknown key"),
        (["--set", "args.nonsense=1"], "unknown trainer field 'nonsense'"),
        (["--set", "num_generations=0"], "num_generations=0: must be an integer >= 1"),
        (["--set", "trainer=ppo"], "trainer='ppo'"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, argv, message):
    spec = tmp_path / "run.yaml"
    spec.write_text("task: demo\n")
    assert main(["train", str(spec), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("comarl: error: ") and message in err


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_demo_refuses_a_bad_seed_before_building_the_team(tmp_path, capsys, seed):
    out = tmp_path / "run"
    assert main(["demo", "--out", str(out), "--seed", seed, "--steps", "1", "--no-progress"]) == 2
    assert (
        capsys.readouterr().err
        == f"comarl: error: --seed {seed}: give an integer in [0, 2**31 - 1] (default 0)\n"
    )
    assert not out.exists()  # refused before the run folder and the team were made


def test_run_demo_gives_back_the_callers_thread_count(tmp_path):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        demo.run_demo(MAGRPOTrainer, tmp_path / "run", max_steps=1, progress_bar=False)
        assert torch.get_num_threads() == 2  # the demo runs on one thread, the caller's setting comes back
    finally:
        torch.set_num_threads(threads)


def test_cli_demo_names_the_command_that_evaluates_its_team_and_that_command_runs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["demo", "--out", str(out), "--steps", "2", "--no-progress"]) == 0
    hint = capsys.readouterr().out.splitlines()[-1]
    assert hint == f"evaluate it again: comarl eval --task demo --run {out}"
    assert main(hint.removeprefix("evaluate it again: comarl ").split()) == 0
    assert "reward/meeting_reward" in capsys.readouterr().out
