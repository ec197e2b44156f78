"""The offline demo learns, the CLI runs it from YAML, and bad CLI input is a one-line error."""

from __future__ import annotations

import json
import re
from pathlib import Path

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


def test_first_word_is_the_lowercased_first_word_without_punctuation():
    assert demo.first_word("Park. then cafe") == "park"
    assert demo.first_word(' ... "Cafe!" now') == "cafe"  # a word of punctuation alone is skipped
    assert demo.first_word(" ?! ") == ""
    assert demo.first_word("") == ""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "test"}, "load_items: split='test'; choose 'train' or 'eval'"),
        ({"source": "hub"}, "load_items: source='hub'; the demo's items are 'local' only"),
    ],
)
def test_demo_load_items_refuses_other_splits_and_sources(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        demo.load_items(**kwargs)


def test_demo_load_items_are_the_same_36_items_for_both_splits():
    train, evaluation = demo.load_items("train"), demo.load_items("eval")
    assert train == evaluation and len(train) == 36
    assert train[0] == {"city": "paris", "open_places": ["cafe", "park"], "id": "paris/cafe+park"}
    assert train[-1]["id"] == "delhi/museum+station"
    assert len({item["id"] for item in train}) == 36


@pytest.mark.parametrize(("num_agents", "num_turns"), [(2, 2), (3, 1), (1, 1)])
def test_demo_make_env_is_one_turn_of_two_agents(num_agents, num_turns):
    with pytest.raises(
        ValueError,
        match=rf"^num_agents={num_agents}, num_turns={num_turns}: the meeting game is one turn of two agents$",
    ):
        demo.make_env(num_agents, num_turns)


def test_demo_env_shows_each_agent_its_view_and_succeeds_only_on_a_meeting():
    env = demo.make_env()
    item = {"city": "lima", "open_places": ["museum", "station"]}
    assert env.reset(item) == [demo.formatter(0)(item), demo.formatter(1)(item)]
    both_open = env.step(["museum", "station"])  # 0.25 each for an open place, but they do not meet
    assert both_open.rewards == [0.5, 0.5] and both_open.done and both_open.info["success"] is False
    env.reset(item)
    met = env.step(["Station .", "station"])
    assert met.rewards == [1.0, 1.0] and met.info["success"] is True


def test_demo_corpus_knows_every_word_of_the_pipeline_prompt():
    """Bob's pipeline prompt ("... alice meets at the <answer> .") has no word the tiny tokenizers lack."""
    words = {word for line in demo.corpus() for word in line.split()}
    for item in demo.dataset():
        for answer in demo.PLACES:
            assert set(demo.pipeline_prompt(item, f"{answer} .").split()) <= words, (item, answer)


def test_demo_build_team_writes_a_llama_alice_and_a_gpt2_bob(tmp_path):
    paths = demo.build_team(tmp_path)
    assert paths == demo.team_folders(tmp_path) == [tmp_path / "alice-llama", tmp_path / "bob-gpt2"]
    types = [json.loads((p / "config.json").read_text())["model_type"] for p in paths]
    assert types == ["llama", "gpt2"]


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


class _FakeTrainer:
    """Stands in for MAGRPOTrainer in run_demo: records what the demo asks of it."""

    made: list[_FakeTrainer] = []

    def __init__(self, agents, train_dataset, eval_dataset, reward_func, formatters, args):
        import torch

        self.agents, self.train_dataset, self.eval_dataset, self.args = (
            agents,
            train_dataset,
            eval_dataset,
            args,
        )
        self.reward_func, self.formatters = reward_func, formatters
        self.team, self.engine = ["alice-agent", "bob-agent"], self
        self.evaluations, self.generations, self.train_threads = [], [], None
        self.threads_made = torch.get_num_threads()
        _FakeTrainer.made.append(self)

    def evaluate(self, **kwargs):
        self.evaluations.append(kwargs)
        before = len(self.evaluations) == 1
        return {"eval/success": 0.01 if before else 0.9, "eval/reward": 0.2 if before else 0.95}

    def train(self):
        import torch

        self.train_threads = torch.get_num_threads()

    def generate(self, agent, prompts, num_generations, params):
        from types import SimpleNamespace

        self.generations.append((agent, list(prompts), num_generations, params))
        return SimpleNamespace(completions=["Museum ." if agent == "alice-agent" else "cafe now"])


def test_run_demo_trains_the_team_it_built_and_reports_before_and_after(tmp_path, monkeypatch):
    import torch

    built = []
    monkeypatch.setattr(
        demo, "build_team", lambda base, seed=0: built.append((base, seed)) or [base / "a", base / "b"]
    )
    _FakeTrainer.made = []
    run = tmp_path / "new" / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        summary = demo.run_demo(_FakeTrainer, run, max_steps=7, seed=5, progress_bar=False)
        assert torch.get_num_threads() == 2  # the caller's setting comes back
    finally:
        torch.set_num_threads(threads)
    assert run.is_dir() and built == [(run / "base_models", 5)]
    (trainer,) = _FakeTrainer.made
    assert trainer.agents == [str(run / "base_models" / "a"), str(run / "base_models" / "b")]
    assert trainer.train_dataset == trainer.eval_dataset == demo.dataset()
    assert trainer.reward_func is demo.meeting_reward
    args = trainer.args
    assert (args.max_steps, args.seed, args.output_dir, args.progress_bar) == (7, 5, str(run), False)
    assert (args.joint_mode, args.reward_call, args.success_threshold) == ("cross", "batched", 1.0)
    assert trainer.train_threads == 1  # trained on one thread
    # sampled before training (chance level), greedy after
    assert trainer.evaluations == [{"do_sample": True, "num_generations": 8}, {}]
    assert summary == {
        "run_dir": str(run),
        "success_before": 0.01,
        "success_after": 0.9,
        "reward_before": 0.2,
        "reward_after": 0.95,
        "conventions": {
            f"{a} / {b}": ["museum", "cafe"]
            for a, b in [
                ("cafe", "park"),
                ("cafe", "museum"),
                ("cafe", "station"),
                ("park", "museum"),
                ("park", "station"),
                ("museum", "station"),
            ]
        },
    }
    # the conventions are each agent's greedy answer to its own view of the items in paris
    paris = demo.dataset(["paris"])
    assert [(agent, prompts) for agent, prompts, _, _ in trainer.generations] == [
        (agent, [demo.formatter(i)(item)])
        for item in paris
        for i, agent in enumerate(["alice-agent", "bob-agent"])
    ]
    assert {(n, p.do_sample, p.max_new_tokens) for _, _, n, p in trainer.generations} == {(1, False, 3)}


def test_cli_demo_names_the_command_that_evaluates_its_team_and_that_command_runs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["demo", "--out", str(out), "--steps", "2", "--no-progress"]) == 0
    hint = capsys.readouterr().out.splitlines()[-1]
    assert hint == f"evaluate it again: comarl eval --task demo --run {out}"
    assert main(hint.removeprefix("evaluate it again: comarl ").split()) == 0
    assert "reward/meeting_reward" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the CLI's wiring, without a model


def _fake_run_demo(monkeypatch):
    calls = []

    def run_demo(trainer_cls, out, max_steps, seed, progress_bar):
        calls.append((trainer_cls, out, max_steps, seed, progress_bar))
        return {
            "run_dir": str(out),
            "success_before": 0.25,
            "success_after": 0.875,
            "conventions": {"cafe / park": ["park", "park"], "museum / station": ["museum", "station"]},
        }

    monkeypatch.setattr(demo, "run_demo", run_demo)
    return calls


def test_cli_demo_passes_its_flags_and_prints_the_summary(tmp_path, capsys, monkeypatch):
    calls = _fake_run_demo(monkeypatch)
    out = tmp_path / "runs" / "nested" / "demo"  # parents are made
    argv = ["demo", "--out", str(out), "--steps", "7", "--seed", str(2**31 - 1), "--no-progress"]
    assert main(argv) == 0
    assert calls == [(MAGRPOTrainer, str(out), 7, 2**31 - 1, False)]
    assert out.is_dir()
    assert capsys.readouterr().out.splitlines() == [
        "joint success: 25.0% before training (sampled) -> 87.5% after (greedy)",
        "the trained team's greedy answers in one city (open places -> alice's / bob's answer):",
        "  cafe / park        -> park / park",
        "  museum / station   -> museum / station",
        f"run folder: {out} (config.yaml, metrics.jsonl, plot.png, samples.jsonl, agents/)",
        f"evaluate it again: comarl eval --task demo --run {out}",
    ]
    # the defaults: a new runs/demo-<time> folder, 300 steps, seed 0, a progress bar
    assert main(["demo"]) == 0
    assert calls[1] == (MAGRPOTrainer, None, demo.DEMO_STEPS, 0, True) and demo.DEMO_STEPS == 300


@pytest.fixture
def fake_trainer(monkeypatch):
    """MAGRPOTrainer as `comarl train` sees it, replaced by a recorder: no model loads. ``made`` holds each
    construction's keyword arguments, ``trained`` each train() call's resume_from_checkpoint."""
    from comarl.trainers import magrpo

    class Recorder:
        made: list = []
        trained: list = []
        metrics = {"reward": 0.123456, "time/step": 1.5, "agent_0/lr": 1e-5}
        processes = None
        step, total_steps = 3, 3

        def __init__(self, **kwargs):
            self.made.append(kwargs)

        def train(self, resume_from_checkpoint=None):
            self.trained.append(resume_from_checkpoint)
            return dict(self.metrics)

    Recorder.made, Recorder.trained = [], []
    monkeypatch.setattr(magrpo, "MAGRPOTrainer", Recorder)
    return Recorder


def test_cli_train_demo_builds_the_team_in_base_models_with_the_runs_seed(
    tmp_path, monkeypatch, fake_trainer
):
    """The README: the run folder holds base_models/, the untrained tiny models; without output_dir they go to
    runs/demo/base_models. The team is built with args.seed."""
    built = []
    monkeypatch.setattr(demo, "build_team", lambda base, seed=0: built.append((base, seed)) or ["a", "b"])
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "run.yaml"
    spec.write_text("task: demo\nargs: {seed: 7, progress_bar: false}\n")
    assert main(["train", str(spec)]) == 0
    assert main(["train", str(spec), "--set", f"output_dir={tmp_path / 'out'}"]) == 0
    assert built == [(Path("runs/demo/base_models"), 7), (tmp_path / "out" / "base_models", 7)]
    assert [kwargs["agents"] for kwargs in fake_trainer.made] == [["a", "b"], ["a", "b"]]
    assert fake_trainer.trained == [None, None]  # a new run, not a resumed one


def test_cli_train_prints_the_summary_once_per_run_without_timings(
    tmp_path, capsys, monkeypatch, fake_trainer
):
    from types import SimpleNamespace

    from comarl import distributed

    finished = []
    monkeypatch.setattr(distributed, "finish", lambda code=0: finished.append(code))
    monkeypatch.setattr(demo, "build_team", lambda base, seed=0: ["a", "b"])
    spec = tmp_path / "run.yaml"
    spec.write_text("task: demo\n")
    assert main(["train", str(spec)]) == 0
    assert capsys.readouterr().out == '{\n "reward": 0.1235,\n "agent_0/lr": 1e-05\n}\n'
    assert finished == []  # one process: a normal exit
    # under torchrun: rank 0 prints, the other ranks do not, and every rank leaves through finish(0)
    for rank, printed in ((0, '{\n "reward": 0.1235,\n "agent_0/lr": 1e-05\n}\n'), (1, "")):
        monkeypatch.setattr(fake_trainer, "processes", SimpleNamespace(rank=rank))
        assert main(["train", str(spec)]) == 0
        assert capsys.readouterr().out == printed
    assert finished == [0, 0]


def test_cli_resume_checks_the_newest_checkpoint_with_the_runs_team_and_processes(
    tmp_path, monkeypatch, fake_trainer
):
    from comarl import checkpoint

    found = [tmp_path / "checkpoints" / "step_2", tmp_path / "checkpoints" / "step_4"]
    checks = []
    monkeypatch.setattr(
        checkpoint, "completed_checkpoints", lambda out: found if out == str(tmp_path) else []
    )
    monkeypatch.setattr(checkpoint, "check_resumable", lambda *args: checks.append(args))
    monkeypatch.setenv("WORLD_SIZE", "4")
    (tmp_path / "data.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    (tmp_path / "rewards.py").write_text("def longer(a, b):\n    return [len(x) for x in a]\n")
    spec = tmp_path / "run.yaml"
    common = (
        f"task: function\ndataset: {tmp_path / 'data.jsonl'}\n"
        f"reward_funcs: ['{tmp_path / 'rewards.py'}:longer']\n"
    )
    spec.write_text(common + f"agents: [x, y, z]\nargs: {{output_dir: {tmp_path}, data_parallel: true}}\n")
    assert main(["train", str(spec), "--resume"]) == 0
    spec.write_text(common + f"model: m\nnum_agents: 3\nargs: {{output_dir: {tmp_path}}}\n")
    assert main(["train", str(spec), "--resume"]) == 0
    # the newest checkpoint; WORLD_SIZE processes under data_parallel, one without; the team's sources
    assert [(c[0], c[1], c[2], c[3], c[5]) for c in checks] == [
        (found[1], fake_trainer.__name__, 3, 4, ["x", "y", "z"]),
        (found[1], fake_trainer.__name__, 3, 1, ["m", "m", "m"]),
    ]
    assert fake_trainer.trained == [True, True]


def test_cli_train_code_and_writing_read_the_spec_source_and_turns(tmp_path, monkeypatch, fake_trainer):
    from types import SimpleNamespace

    from comarl import evaluation

    calls = []

    class Env:
        def close(self):
            calls.append("closed")

    def load_items(split, source):
        calls.append((split, source))
        return [{"id": f"{split}-{source}"}] * 4

    protocol = SimpleNamespace(
        default_source="local",
        load_items=load_items,
        make_env=lambda num_agents, num_turns: calls.append(("env", num_agents, num_turns)) or Env(),
    )
    monkeypatch.setattr(evaluation, "task_protocol", lambda task: protocol)
    spec = tmp_path / "run.yaml"
    spec.write_text("task: writing\nmodel: m\nnum_agents: 3\nsource: tldr\nargs: {num_turns: 2}\n")
    assert main(["train", str(spec)]) == 0
    assert calls == [("env", 3, 2), ("train", "tldr"), ("eval", "tldr"), "closed"]
    made = fake_trainer.made[0]
    assert made["train_dataset"][0] == {"id": "train-tldr"} and made["eval_dataset"][0] == {"id": "eval-tldr"}
    assert (made["model"], made["agents"], made["num_agents"]) == ("m", None, 3)
    calls.clear()
    spec.write_text("task: writing\nmodel: m\n")
    assert main(["train", str(spec)]) == 0
    assert calls == [("env", 2, 1), ("train", "local"), ("eval", "local"), "closed"]


def _function_spec(tmp_path, dataset, *, reward="rewards.py:longer", extra=""):
    (tmp_path / "rewards.py").write_text(
        "def longer(a, b):\n    return [len(x) for x in a]\n\nnot_a_function = 3\n"
    )
    reward = reward.replace("rewards.py", str(tmp_path / "rewards.py"))
    spec = tmp_path / "run.yaml"
    spec.write_text(
        f"task: function\nmodel: m\ndataset: {dataset}\nreward_funcs: ['{reward}']\n{extra}"
        "args: {max_steps: 1, progress_bar: false, prompts_per_step: 1}\n"
    )
    return str(spec)


def test_cli_function_task_reads_json_and_jsonl_and_formats_the_prompt_column(tmp_path, fake_trainer):
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n\n{"text": "b"}\n  \n')  # blank lines are skipped
    (tmp_path / "eval.json").write_text('[{"text": "c"}]')
    extra = f"eval_dataset: {tmp_path / 'eval.json'}\nprompt_column: text\n"
    assert main(["train", _function_spec(tmp_path, tmp_path / "train.jsonl", extra=extra)]) == 0
    made = fake_trainer.made[0]
    assert made["train_dataset"] == [{"text": "a"}, {"text": "b"}] and made["eval_dataset"] == [{"text": "c"}]
    assert made["formatters"]({"text": "hello", "prompt": "no"}) == "hello"
    assert [f.__name__ for f in made["reward_func"]] == ["longer"]


def test_cli_function_task_loads_the_train_split_of_a_hub_dataset(tmp_path, monkeypatch, fake_trainer):
    import datasets

    loads = []

    def load_dataset(name, split=None):
        loads.append((name, split))
        return [{"prompt": "a"}] if split == "train" else {"train": [{"prompt": "a"}]}

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert main(["train", _function_spec(tmp_path, "user/prompts")]) == 0
    assert loads == [("user/prompts", "train")] and fake_trainer.made[0]["train_dataset"] == [{"prompt": "a"}]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.jsonl", None, "dataset: {path} does not exist"),
        ("missing.json", None, "dataset: {path} does not exist"),
        ("dict.json", '{"prompt": "a"}', "dataset: {path} must hold a JSON list of objects"),
        ("numbers.json", "[1, 2]", "prompt_column='prompt': the first item of dataset has no such key (int)"),
        (
            "keys.jsonl",
            '{"text": "a", "b": 1, "a": 2}\n',
            "prompt_column='prompt': the first item of dataset has no such key (['a', 'b', 'text'])",
        ),
    ],
)
def test_cli_function_task_refuses_each_bad_dataset(tmp_path, capsys, fake_trainer, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert main(["train", _function_spec(tmp_path, path)]) == 2
    assert capsys.readouterr().err == f"comarl: error: {message.format(path=path)}\n"
    assert fake_trainer.made == []


def test_cli_function_task_checks_the_eval_datasets_prompt_column_too(tmp_path, capsys, fake_trainer):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "eval.jsonl").write_text('{"question": "a"}\n')
    spec = _function_spec(
        tmp_path, tmp_path / "train.jsonl", extra=f"eval_dataset: {tmp_path / 'eval.jsonl'}\n"
    )
    assert main(["train", spec]) == 2
    assert capsys.readouterr().err == (
        "comarl: error: prompt_column='prompt': the first item of eval_dataset has no such key (['question'])\n"
    )


def test_cli_function_task_an_empty_dataset_is_the_trainers_one_line_error(tmp_path, qwen_bpe, capsys):
    """An empty dataset has no first item to check: the trainer says it is too small (no IndexError)."""
    (tmp_path / "empty.jsonl").write_text("\n")
    spec = _function_spec(tmp_path, tmp_path / "empty.jsonl")
    text = (tmp_path / "run.yaml").read_text().replace("model: m", f"model: {qwen_bpe}")
    (tmp_path / "run.yaml").write_text(text)
    assert main(["train", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("comarl: error: prompts_per_step=1 but the training dataset has 0 items") and (
        err.count("\n") == 1
    )


def test_cli_function_task_a_hub_dataset_that_cannot_load_is_one_line(tmp_path, capsys, monkeypatch):
    import datasets

    def load_dataset(name, split=None):
        raise ConnectionError(
            "Couldn't reach 'user/prompts' on the Hub (LocalEntryNotFoundError)\nmore detail"
        )

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert main(["train", _function_spec(tmp_path, "user/prompts")]) == 2
    assert capsys.readouterr().err == (
        "comarl: error: dataset: cannot load 'user/prompts' (Couldn't reach 'user/prompts' on the Hub "
        "(LocalEntryNotFoundError)); give a .json/.jsonl path or a datasets hub name\n"
    )


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("longer", "reward_funcs: 'longer' must look like 'module:function' or 'file.py:function'"),
        ("missing.py:longer", "reward_funcs: missing.py does not exist"),
        (
            "no_such_module_xyz:longer",
            "reward_funcs: cannot import 'no_such_module_xyz': No module named 'no_such_module_xyz'",
        ),
        ("rewards.py:shorter", "reward_funcs: {rewards} has no function 'shorter'"),
        ("rewards.py:not_a_function", "reward_funcs: {rewards} has no function 'not_a_function'"),
    ],
)
def test_cli_function_task_refuses_each_bad_reward_function(tmp_path, capsys, fake_trainer, reward, message):
    (tmp_path / "data.jsonl").write_text('{"prompt": "a"}\n')
    assert main(["train", _function_spec(tmp_path, tmp_path / "data.jsonl", reward=reward)]) == 2
    assert capsys.readouterr().err == f"comarl: error: {message.format(rewards=tmp_path / 'rewards.py')}\n"
    assert fake_trainer.made == []


def test_cli_reward_function_file_in_a_folder_whose_name_has_a_colon(tmp_path, fake_trainer):
    """The function is what follows the last ':' ('package.module:function' or 'path/to/file.py:function')."""
    folder = tmp_path / "a:b"
    folder.mkdir()
    (tmp_path / "data.jsonl").write_text('{"prompt": "a"}\n')
    spec = _function_spec(tmp_path, tmp_path / "data.jsonl")
    (folder / "rewards.py").write_text("def longer(a, b):\n    return [len(x) for x in a]\n")
    text = (
        (tmp_path / "run.yaml").read_text().replace(str(tmp_path / "rewards.py"), str(folder / "rewards.py"))
    )
    (tmp_path / "run.yaml").write_text(text)
    assert main(["train", spec]) == 0
    assert [f.__name__ for f in fake_trainer.made[0]["reward_func"]] == ["longer"]


def test_cli_fields_lists_a_trainers_fields_and_refuses_an_unknown_one(capsys):
    assert main(["fields"]) == 0  # magrpo by default
    lines = capsys.readouterr().out.splitlines()
    assert (
        "output_dir                 Run folder for config, metrics, plot, samples and agents (None = no files)."
        in lines
    )
    assert main(["fields", "ppo"]) == 2
    assert capsys.readouterr().err == (
        "comarl: error: unknown trainer 'ppo'; choose one of magrpo, mareinforce, marloo, maremax, iac, maac, "
        "ippo, mappo, madpo, marlhf\n"
    )


def test_cli_bench_runs_the_checkouts_script_with_its_flags(tmp_path, capsys, monkeypatch):
    import subprocess
    import sys

    from comarl import cli

    commands = []
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda command, check: commands.append(command) or subprocess.CompletedProcess(command, 3),
    )
    script = str(Path(cli.__file__).resolve().parents[2] / "benchmarks" / "bench.py")
    assert main(["bench", "--quick", "--repeats", "0", "--threads", "2", "--device", "cuda"]) == 3
    assert main(["bench"]) == 3  # the script's exit status is comarl's
    assert commands == [
        [sys.executable, script, "--threads", "2", "--device", "cuda", "--quick", "--repeats", "0"],
        [sys.executable, script, "--threads", "1", "--device", "cpu"],
    ]
    # an installed comarl (no source checkout beside it) says so
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "comarl" / "cli.py"))
    assert main(["bench"]) == 2
    assert capsys.readouterr().err == (
        f"comarl: error: comarl bench runs {tmp_path / 'benchmarks' / 'bench.py'}, which only a source checkout "
        "has; clone the repository and run it there\n"
    )
    assert len(commands) == 2
