"""The pure parts of the benchmark driver (medians, schedules, ratios, targets, the markdown tables), the floor, and
comarl's and the floor's runners on a small workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench import (  # noqa: E402
    Case,
    agent_parallel_rows,
    build_cases,
    comparisons,
    markdown,
    median,
    probe_machine,
    probe_text,
    process_threads,
    schedule,
    summarize,
    targets,
    trials_text,
)


def run(
    library: str, mode: str, agents: int, cps: float, rss: float = 500.0, cpu_cps: float | None = None
) -> dict:
    """A runner's RESULT line with the fields the driver reads."""
    return {
        "library": library,
        "mode": mode,
        "agents": agents,
        "completions_per_s": cps,
        "tokens_per_s": cps * 32,
        "completions_per_cpu_s": cps if cpu_cps is None else cpu_cps,
        "seconds": 128 * agents / cps,
        "cpu_seconds": 128 * agents / cps,
        "peak_rss_mb": rss,
    }


def test_median_by_hand():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError, match="median: no values"):
        median([])


def test_cases_put_comarl_next_to_each_peer_and_odd_repeats_run_backwards():
    cases = build_cases([1, 2], floor_agents=[1])
    assert cases[:4] == [
        Case("comarl", "peer", 1),
        Case("comlrl", "peer", 1),
        Case("floor", "peer", 1),
        Case("trl", "peer", 1),
    ]
    assert Case("trl", "peer", 2) not in cases and Case("floor", "batched", 2) not in cases
    assert Case("comarl-ap", "peer", 2) in cases and Case("comarl-ap", "peer", 1) not in cases
    assert len(cases) == 2 * (4 + 3)
    plan = schedule(cases[:2], repeats=3)
    assert plan == [cases[0], cases[1], cases[1], cases[0], cases[0], cases[1]]


def test_summary_takes_medians_and_ratios_compare_like_with_like():
    runs = [
        run("comarl", "batched", 2, 10.0, rss=600, cpu_cps=12.0),
        run("comarl", "batched", 2, 30.0, rss=640, cpu_cps=12.0),
        run("comarl", "batched", 2, 20.0, rss=620, cpu_cps=12.0),
        run("comlrl", "batched", 2, 4.0, rss=700, cpu_cps=3.0),
        run("floor", "batched", 2, 16.0, rss=800),
    ]
    summary = summarize(runs)
    ours = summary[Case("comarl", "batched", 2)]
    assert ours["completions_per_s"] == 20.0 and ours["peak_rss_mb"] == 620 and ours["repeats"] == 3
    rows = {r["peer"]: r for r in comparisons(summary)}
    assert rows["comlrl"]["ratio"] == pytest.approx(5.0)  # 20 / 4
    assert rows["comlrl"]["cpu_ratio"] == pytest.approx(4.0)  # 12 / 3
    assert rows["floor"]["overhead"] == pytest.approx(0.8)  # 16 / 20: faster than the floor
    found = targets(list(rows.values()))
    assert found["comlrl_batched_2"] == {"value": pytest.approx(5.0), "needed": 5.0, "met": True}
    assert found["floor"]["met"] and found["rss"]["value"] == pytest.approx(620 / 700)


def test_targets_report_what_is_missed():
    summary = summarize(
        [
            run("comarl", "peer", 1, 6.0, rss=520),
            run("trl", "peer", 1, 5.0, rss=500),
            run("floor", "peer", 1, 9.0),
        ]
    )
    found = targets(comparisons(summary))
    assert found["trl_peer_1"] == {"value": pytest.approx(1.2), "needed": 1.5, "met": False}
    assert found["floor"] == {"value": pytest.approx(1.5), "needed": 1.3, "met": False}
    assert "rss" not in found  # RSS is compared with CoMLRL only


def test_markdown_tables():
    summary = summarize(
        [
            run("comarl", "peer", 1, 6.0),
            run("comarl", "peer", 2, 5.0),
            run("comlrl", "peer", 1, 4.0, rss=700),
            run("floor", "peer", 1, 5.0),
        ]
    )
    text = markdown(comparisons(summary), summary)
    assert "| peer | 1 | comlrl | 6.00 | 4.00 | **1.50x** | 1.50x | 192 | 128 | 500 | 700 |" in text
    assert "| peer | 1 | 6.00 | 5.00 | **0.83x** | 500 | 500 |" in text
    assert "| peer | 21.3 / 51.2 | 1.00 / 2.40 |" in text  # seconds per epoch for 1 and 2 agents
    assert "| 2 agents, peer semantics: >= 1.5x CoMLRL's completions/s |" not in text  # not measured here


def test_gpu_runs_add_the_peak_gpu_memory_columns():
    summary = summarize(
        [
            {**run("comarl", "batched", 1, 6.0), "peak_gpu_mb": 100.0},
            {**run("comarl", "batched", 1, 6.0), "peak_gpu_mb": 140.0},
            {**run("comlrl", "batched", 1, 2.0, rss=700), "peak_gpu_mb": 300.0},
        ]
    )
    assert summary[Case("comarl", "batched", 1)]["peak_gpu_mb"] == 120.0  # median of the repeats
    text = markdown(comparisons(summary), summary)
    assert "| comarl RSS MiB | peer RSS MiB | comarl GPU MiB | peer GPU MiB |" in text
    assert (
        "| batched | 1 | comlrl | 6.00 | 2.00 | **3.00x** | 3.00x | 192 | 64 | 500 | 700 | 120 | 300 |"
        in text
    )


def test_agent_parallel_rows_compare_with_one_process_and_comlrl_and_give_the_scaling():
    summary = summarize(
        [
            run("comarl", "batched", 1, 20.0),  # 6.4 s per epoch
            run("comarl", "batched", 2, 20.0),  # 12.8 s
            run("comarl-ap", "batched", 2, 32.0, cpu_cps=16.0),  # 8.0 s
            run("comlrl", "batched", 2, 8.0),
            run("comarl-ap", "batched", 3, 24.0),  # 16.0 s
        ]
    )
    rows = agent_parallel_rows(summary)
    two, three = rows
    assert two["vs_one_process"] == pytest.approx(1.6) and two["vs_comlrl"] == pytest.approx(4.0)
    assert two["cpu_vs_comlrl"] == pytest.approx(2.0)  # 16 / 8 completions per CPU second
    assert two["scaling"] == pytest.approx(8.0 / 6.4) and three["scaling"] == pytest.approx(16.0 / 6.4)
    assert three["vs_one_process"] is None and three["vs_comlrl"] is None
    # the target: seconds(N) / seconds(1) / N, worst case 2.5 / 3 < 1
    found = targets(comparisons(summary), rows)
    assert found["scaling"] == {"value": pytest.approx(2.5 / 3), "needed": 1.0, "met": True}
    # agent-parallel runs never enter the one-core comparisons
    assert all(r["peer"] != "comarl-ap" for r in comparisons(summary))
    text = markdown(comparisons(summary), summary)
    assert "| batched | 2 | 32.00 | 1.60x | 4.00x | 2.00x | 8.0 | 1.25 | 500 |" in text
    assert "| batched | 3 | 24.00 | - | - | - | 16.0 | 2.50 | 500 |" in text
    assert "one process per agent, one thread each; the rows above run in one process with one thread" in text


def test_agent_processes_split_the_threads_of_a_one_process_run():
    # --threads 2: the one-process runs get 2 threads; two agent processes one each (the same 2 cores)
    assert process_threads(Case("comlrl", "peer", 2), 2) == 2
    assert process_threads(Case("comarl-ap", "peer", 2), 2) == 1
    assert process_threads(Case("comarl-ap", "peer", 2), 4) == 2
    assert process_threads(Case("comarl-ap", "peer", 3), 2) == 1  # never fewer than one
    summary = summarize(
        [
            {**run("comarl", "batched", 2, 20.0), "threads": 2},
            {**run("comarl-ap", "batched", 2, 32.0), "threads": 1},
        ]
    )
    assert (
        "one process per agent, one thread each; the rows above run in one process with 2 threads"
        in markdown(comparisons(summary), summary)
    )


def test_the_floor_samples_what_it_scores_and_its_log_probs_equal_a_per_row_forward(qwen_bpe):
    """floor.py shares each prompt's cache among its G rows, in sampling and in the update: its samples hold no
    EOS (min_new_tokens = max_new_tokens) and its log-probs are a plain per-row forward's. Its decode step
    (comarl's LlamaDecoder) draws what the model's own forward (--plain-decoding) draws."""
    import torch
    from floor import completion_logprobs, generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_bpe, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    enc = tokenizer(["def add(a, b):", "alice and bob meet at the"], return_tensors="pt", padding=True)
    samples = []
    for plain in (False, True):
        torch.manual_seed(0)
        samples.append(
            generate(model, enc["input_ids"], enc["attention_mask"], tokenizer.eos_token_id, plain, 3, 5)
        )
    ids = samples[0]
    assert torch.equal(ids, samples[1])
    assert ids.shape == (6, 5) and not (ids == tokenizer.eos_token_id).any()
    logp = completion_logprobs(model, enc["input_ids"], enc["attention_mask"], ids, G=3)
    prompt_ids = enc["input_ids"].repeat_interleave(3, dim=0)
    mask = torch.cat([enc["attention_mask"].repeat_interleave(3, dim=0), torch.ones_like(ids)], dim=1)
    logits = model(
        input_ids=torch.cat([prompt_ids, ids], dim=1),
        attention_mask=mask,
        position_ids=(mask.cumsum(1) - 1).clamp(min=0),
    ).logits[:, prompt_ids.shape[1] - 1 : -1]
    expected = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)


def test_probe_text_gives_each_probe_before_and_after():
    before = {
        "mkl_4_rows_us": 80.0,
        "onednn_packed_4_rows_us": 42.5,
        "mkl_32_rows_us": 140.0,
        "page_fault_us": 0.85,
    }
    after = {
        "mkl_4_rows_us": 24.0,
        "onednn_packed_4_rows_us": 40.0,
        "mkl_32_rows_us": 141.5,
        "page_fault_us": 2.0,
    }
    assert probe_text(before, after) == (
        "Machine probe, one core, before / after the runs: MKL product 4 x 256 -> 1024 80 / 24 µs; oneDNN packed, "
        "the same 42.5 / 40 µs; MKL product 32 x 256 -> 1024 140 / 141.5 µs; page fault 0.85 / 2 µs."
    )
    # A probe without oneDNN (a torch build without it) leaves that line out.
    del before["onednn_packed_4_rows_us"]
    assert "oneDNN" not in probe_text(before, after)


def test_trials_text_counts_comarls_runs_that_packed_per_row_count():
    """Only comarl's runs count (the floor decodes with the same step); medians of their trials; no line without."""
    trial = {"rows": 4, "plain_ms": 4.0, "packed_ms": 5.0, "packing_ms": 10.0, "packs": False}
    runs = [
        {"library": "comarl", "decode_trials": [trial]},
        {"library": "comarl", "decode_trials": [{**trial, "plain_ms": 6.0, "packs": True}]},
        {"library": "comarl", "decode_trials": [{**trial, "plain_ms": 4.5}, {**trial, "rows": 32}]},
        {"library": "floor", "decode_trials": [{**trial, "packs": True}]},
        {"library": "trl"},
    ]
    assert trials_text(runs) == (
        "comarl's decode step, its packing trial in each run (median ms per step plain / packed, per packing): "
        "4 rows packed in 1 of 3 (4.50 / 5.00 ms, 10.0 ms); 32 rows packed in 0 of 1 (4.00 / 5.00 ms, 10.0 ms)."
    )
    assert trials_text(runs[3:]) == ""


def test_the_machine_probe_times_small_products_and_page_faults():
    """bench.py records these before and after its runs: the machine's state, which moved the ratios between runs."""
    probe = probe_machine(Path(sys.executable))
    assert set(probe) == {"mkl_4_rows_us", "mkl_32_rows_us", "onednn_packed_4_rows_us", "page_fault_us"}
    # Microseconds: a 4-row product of a 1 MiB weight and a page fault take more than nothing and less than 10 ms.
    assert all(0 < value < 10_000 for value in probe.values()), probe
    assert probe["mkl_32_rows_us"] > probe["mkl_4_rows_us"] / 2  # 8x the rows cost more than half as much


@pytest.mark.slow
def test_comarl_and_floor_runners_train_the_workload_and_report_its_work(tmp_path):
    """Each runner trains one epoch of the first 8 prompts (one batched step) and prints one RESULT line with the
    work it did: 8 prompts x G=4 completions of exactly 32 tokens per agent (a runner that breaks with comarl's
    API, as run_comarl's generate counter did when the engines took seeds, fails here, not in `comarl bench`)."""
    from workload import build_workload

    from comarl.llama_decoder import cpu_packing_available

    workload = build_workload(tmp_path / "workload")
    for script, agents in (("run_comarl.py", 2), ("floor.py", 1)):
        command = [sys.executable, str(BENCHMARKS / script), "--workload", str(workload), "--mode", "batched"]
        done = subprocess.run(
            [*command, "--prompts", "8", "--agents", str(agents)], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert len(lines) == 1, done.stdout[-2000:]
        result = json.loads(lines[0].removeprefix("RESULT "))
        assert (result["prompts"], result["completions"], result["tokens"]) == (
            8,
            32 * agents,
            32 * 32 * agents,
        )
        if cpu_packing_available():  # the decode step's packing trial: once, at 8 prompts x G = 32 rows
            (trial,) = result["decode_trials"]
            assert trial["rows"] == 32 and trial["plain_ms"] > 0 and trial["packed_ms"] > 0
            assert isinstance(trial["packs"], bool)


@pytest.mark.slow
def test_ablations_and_profile_scripts_run_on_the_workload(tmp_path):
    """The measuring scripts that no benchmark run calls still run with comarl's API: ablations.py prints every
    variant's time for both step sizes, profile_comarl.py the trainer's phases (both broke unnoticed once), and
    malloc_ablation.py comarl with and without keep_freed_memory."""
    from workload import build_workload

    workload = str(build_workload(tmp_path / "workload"))
    ablations = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "ablations.py"),
            "--workload",
            workload,
            "--prompts",
            "8",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ablations.returncode == 0, ablations.stderr[-3000:]
    rows = [line for line in ablations.stdout.splitlines() if line.startswith("  ")]
    # 8 generate and 3 update variants, at 1 and at 8 prompts per step
    assert len(rows) == 2 * 11, ablations.stdout
    assert sum("(the engine now)" in row for row in rows) == 2
    assert sum("(the trainer now)" in row for row in rows) == 2
    profile = subprocess.run(
        [sys.executable, str(BENCHMARKS / "profile_comarl.py"), "--workload", workload, "--mode", "batched"]
        + ["--prompts", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert profile.returncode == 0, profile.stderr[-3000:]
    assert "1 agent(s), mode batched: 1 steps" in profile.stdout
    assert {"time/generate", "time/update"} <= {line.split()[0] for line in profile.stdout.splitlines()[1:]}
    malloc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "malloc_ablation.py"),
            "--workload",
            workload,
            "--libraries",
            "comarl",
        ]
        + ["--modes", "batched", "--prompts", "8", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert malloc.returncode == 0, malloc.stderr[-3000:]
    assert "comarl: x" in malloc.stdout and "comarl --glibc-malloc" in malloc.stdout, malloc.stdout
