"""Hostile programs in the sandbox: each is contained, reported with the right reason, and the test process lives.

Where the outcome depends on what this machine allows (namespaces, running as root), the test
asserts the behaviour that ``detect_isolation()`` reports, so the report itself is checked.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import comarl.sandbox as sandbox
from comarl.sandbox import Isolation, RunResult, SandboxLimits, SandboxPool, detect_isolation, run_python

pytestmark = pytest.mark.skipif(os.name != "posix", reason="comarl.sandbox supports POSIX systems only")

FAST = SandboxLimits(timeout_s=5.0, cpu_s=5.0, memory_mb=256)


def fast(**changes: object) -> SandboxLimits:
    return SandboxLimits(**{**FAST.__dict__, **changes})


def live_members(group: int) -> list[int]:
    """Processes of process group ``group`` that are not zombies (dead, waiting for init to reap them)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
            if int(pgrp) == group and state != "Z":
                members.append(int(entry))
    return members


@pytest.fixture
def world_writable():  # noqa: ANN201
    """A directory anyone may write, outside pytest's private (0700) tree, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="comarl-test-shared-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class RecordingPopen(subprocess.Popen):
    """subprocess.Popen that remembers the pid of every process it starts (the sandbox's group leaders)."""

    pids: list[int] = []

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        RecordingPopen.pids.append(self.pid)


# ---------------------------------------------------------------------------- plain runs


def test_ok_run_returns_output_and_reads_stdin():
    result = run_python(
        "import sys\nprint(sys.stdin.read().upper())\nprint('err', file=sys.stderr)", FAST, "abc"
    )
    assert (result.ok, result.reason, result.returncode) == (True, "ok", 0)
    assert result.stdout == "ABC\n" and result.stderr == "err\n"
    assert result.isolation == detect_isolation().describe()


def test_runs_in_isolated_mode_in_a_fresh_directory_that_is_removed():
    result = run_python(
        "import os, sys\nprint(sys.flags.isolated, os.getcwd(), sorted(os.listdir('.')))", FAST
    )
    isolated, cwd, listing = result.stdout.split(" ", 2)
    assert isolated == "1" and Path(cwd).name.startswith("comarl-sandbox-")
    assert listing.strip() == "['program.py']"
    assert not Path(cwd).exists()


def test_the_launcher_keeps_no_stream_a_program_could_open_through_proc():
    """The launcher (the program's parent) kept the trainer's pipes as its stdin/stdout/stderr and stayed dumpable:
    a program of the same user opened /proc/<launcher>/fd/1 and read or wrote what the trainer reads. After the
    fork it points them at /dev/null and turns non-dumpable, so its fds are not even listed to the program."""
    probe = (
        "import os\n"
        "try:\n"
        "    print(sorted(os.readlink(f'/proc/{os.getppid()}/fd/{n}') for n in (0, 1, 2)))\n"
        "except OSError as error:\n"
        "    print(type(error).__name__)\n"
    )
    result = run_python(probe, FAST)
    assert result.ok, result.stderr
    # only a program that runs as the real root (no user namespace) may read the launcher's fds: /dev/null there
    iso = detect_isolation()
    as_root = iso.uid is None and os.geteuid() == 0 and "user" not in iso.namespaces
    expected = str(["/dev/null"] * 3) if as_root else "PermissionError"
    assert result.stdout.strip() == expected


def test_exit_status_is_reported_but_os_exit_0_is_a_success():
    """sys.exit(3) is a failure; os._exit(0) before any test ran is exit 0, which is why the code task decides
    success by a marker printed at the very end, never by the exit status alone."""
    three = run_python("import sys\nsys.exit(3)", FAST)
    assert (three.ok, three.reason, three.returncode) == (False, "exit_code", 3)
    early = run_python("import os\nos._exit(0)\nassert False", FAST)
    assert (early.ok, early.reason, early.returncode) == (True, "ok", 0)
    raised = run_python("raise ValueError('bad input 7')", FAST)
    assert (raised.reason, raised.returncode) == ("exit_code", 1)
    assert raised.stderr.strip().splitlines()[-1] == "ValueError: bad input 7"


def test_limits_are_validated_with_the_field_named():
    with pytest.raises(ValueError, match=r"SandboxLimits.timeout_s=0: give a positive number of seconds"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match=r"SandboxLimits.memory_mb=8: give an integer >= 64"):
        SandboxLimits(memory_mb=8)
    with pytest.raises(ValueError, match=r"SandboxLimits.processes=0: give an integer >= 1"):
        SandboxLimits(processes=0)
    with pytest.raises(ValueError, match=r"SandboxPool: max_workers=0"):
        SandboxPool(max_workers=0)


# ---------------------------------------------------------------------------- hostile programs


def test_infinite_loop_times_out_in_about_the_timeout():
    result = run_python("while True:\n    pass", fast(timeout_s=1.0, cpu_s=10.0))
    assert (result.ok, result.reason, result.returncode) == (False, "timeout", None)
    assert 1.0 <= result.seconds < 1.8


def test_cpu_time_limit_ends_a_busy_program():
    result = run_python("while True:\n    pass", fast(timeout_s=10.0, cpu_s=1.0))
    assert (result.reason, result.returncode) == ("cpu_time", -signal.SIGXCPU)
    assert result.seconds < 4.0  # 1 s of CPU; more wall time only when the machine is busy


def test_memory_bomb_is_stopped_by_the_address_space_limit():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", fast(memory_mb=128))
    assert (result.ok, result.reason, result.returncode) == (False, "memory", 1)
    assert result.stderr.strip().splitlines()[-1] == "MemoryError"


def test_huge_output_is_capped_and_ends_the_run():
    result = run_python("while True:\n    print('x' * 999)", fast(output_bytes=10_000))
    assert (result.ok, result.reason, result.returncode) == (False, "output_limit", None)
    assert result.stdout == ("x" * 999 + "\n") * 10 and len(result.stdout) == 10_000
    assert result.seconds < 2.0


def test_file_size_limit():
    result = run_python("open('big', 'wb').write(b'0' * (3 * 2**20))", fast(file_size_mb=1))
    assert (result.reason, result.returncode) == ("file_size", 1)
    assert "[Errno 27] File too large" in result.stderr


def test_fork_bomb_is_contained_and_every_process_is_dead_afterwards(monkeypatch):
    """A fork bomb under a low process limit and a short timeout; then no process of its group remains.

    The bomb sleeps when a fork fails, so it does not burn this shared machine's CPUs.
    """
    if detect_isolation().processes == "not enforced":
        pytest.skip(
            "RLIMIT_NPROC is not enforced here (root with no interpreter usable by 'nobody', or not Linux)"
        )
    bomb = (
        "import os, sys, time\n"
        "told = False\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        if not told:\n"
        "            print('limit reached', flush=True)\n"
        "            told = True\n"
        "        time.sleep(0.01)\n"
    )
    RecordingPopen.pids = []
    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    result = run_python(bomb, fast(timeout_s=1.0, processes=8))
    assert (result.ok, result.reason) == (False, "timeout")
    assert "limit reached" in result.stdout  # forks really failed at the limit
    assert result.seconds < 2.0
    (leader,) = RecordingPopen.pids
    deadline = time.perf_counter() + 3.0  # SIGKILL lands asynchronously; give the kernel a moment
    while live_members(leader) and time.perf_counter() < deadline:
        time.sleep(0.02)
    assert live_members(leader) == []


def test_a_process_that_leaves_the_group_dies_with_the_pid_namespace(world_writable):
    """A grandchild that calls setsid() escapes killpg; a PID namespace still takes it down with the run."""
    shared = world_writable
    escapee = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    open({str(shared / 'started')!r}, 'w').write('started')\n"
        "    time.sleep(1.0)\n"
        f"    open({str(shared / 'escaped')!r}, 'w').write('still alive')\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\n"
    )
    result = run_python(escapee, FAST)
    assert result.reason == "ok"
    assert (shared / "started").read_text() == "started"  # it could write there
    time.sleep(1.5)
    if "pid" in detect_isolation().namespaces:
        assert not (shared / "escaped").exists()
    else:  # documented: without a PID namespace a process that leaves the group outlives the run
        assert (shared / "escaped").read_text() == "still alive"


def test_a_run_ends_at_its_timeout_even_when_the_trainer_died(world_writable):
    """The trainer kills a run at its timeout; if the trainer itself is killed (OOM killer, preemption) during
    the run, the launcher ends the run a second after the timeout instead of leaving it asleep forever."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", "from comarl.sandbox import *\nrun_python('import time\\ntime.sleep(60)', "
         "SandboxLimits(timeout_s=1.0))"],
        env={**os.environ, "TMPDIR": str(world_writable)},
    )  # fmt: skip

    def running() -> list[str]:  # live processes of that run (not of the probes): their command line names it
        run, found = f"{world_writable}/comarl-sandbox-".encode(), []
        for entry in os.listdir("/proc"):
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
                if run in command and b"comarl-sandbox-probe-" not in command:
                    found.append(entry)
        return found

    try:
        deadline = time.perf_counter() + 4.0
        while not running() and time.perf_counter() < deadline:
            time.sleep(0.05)
        assert running(), "the run did not start"
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.perf_counter() + 4.0  # timeout 1 s + 1 s of grace, on a busy machine
    while running() and time.perf_counter() < deadline:
        time.sleep(0.05)
    left = running()
    for pid in left:  # do not leave them behind when the test fails
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)
    assert left == []


def test_writing_outside_its_directory(world_writable):
    """The fresh working directory is not a jail: a world-writable path is writable from the sandbox.

    A path only the trainer's user may write is protected only when the program runs as another user
    (the trainer is root and runs programs as 'nobody'); stronger isolation needs a container.
    """
    shared = world_writable
    private = world_writable / "private"  # reachable, but writable by the trainer's user only
    private.mkdir()
    private.chmod(0o755)
    program = (
        "for path in {paths!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('written by the sandbox')\n"
        "        print('wrote', flush=True)\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__, flush=True)\n"
    ).format(paths=[str(shared / "a.txt"), str(private / "b.txt")])
    result = run_python(program, FAST)
    assert result.reason == "ok"
    shared_line, private_line = result.stdout.splitlines()
    assert shared_line == "wrote" and (shared / "a.txt").read_text() == "written by the sandbox"
    if detect_isolation().uid is not None:
        assert private_line == "PermissionError" and not (private / "b.txt").exists()
    else:
        assert private_line == "wrote"


def test_the_parents_environment_does_not_leak(monkeypatch):
    monkeypatch.setenv("COMARL_TEST_SECRET", "hunter2-token")
    program = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "print('hunter2' in str(os.environ))\n"
        "try:\n"
        f"    print('hunter2' in open('/proc/{os.getpid()}/environ').read())\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    result = run_python(program, FAST)
    names, in_environ, via_proc = result.stdout.splitlines()
    assert names == "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']"
    assert in_environ == "False"
    iso = detect_isolation()
    if "mount" in iso.namespaces:
        assert via_proc == "FileNotFoundError"  # a private /proc: the trainer's pid does not exist there
    elif iso.uid is not None:
        assert via_proc == "PermissionError"
    else:  # documented: a program of the same user can read the trainer's /proc/<pid>/environ
        assert via_proc == "True"


def test_killing_its_parent_does_not_kill_the_trainer():
    """The program's parent is the sandbox's launcher, not this process: killing it ends the run, not us."""
    me = os.getpid()
    program = "import os, time\nprint(os.getppid(), flush=True)\nos.kill(os.getppid(), 9)\ntime.sleep(0.3)\nprint('after')"
    result = run_python(program, FAST)
    assert os.getpid() == me and run_python("print(1)", FAST).stdout == "1\n"  # this process still works
    parent = int(result.stdout.splitlines()[0])
    assert parent != me
    if "pid" in detect_isolation().namespaces:
        # the launcher is the namespace's init, which ignores signals from inside it
        assert (parent, result.reason, result.stdout.splitlines()[1]) == (1, "ok", "after")
    else:
        assert (result.reason, result.returncode) == ("killed", -signal.SIGKILL)


def test_killing_the_trainer_by_pid_fails():
    iso = detect_isolation()
    if "pid" not in iso.namespaces and iso.uid is None:
        pytest.skip("neither a PID namespace nor another user here: the program could kill this test process")
    result = run_python(f"import os\nos.kill({os.getpid()}, 9)", FAST)
    expected = "ProcessLookupError" if "pid" in iso.namespaces else "PermissionError"
    assert result.reason == "exit_code" and result.stderr.strip().splitlines()[-1].startswith(expected)


def test_network_is_off_unless_allowed():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    port = server.getsockname()[1]
    program = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    try:
        closed = run_python(program, fast(network=False))
        opened = run_python(program, fast(network=True))
        accepted = 0
        while True:
            try:
                server.accept()[0].close()
                accepted += 1
            except BlockingIOError:
                break
    finally:
        server.close()
    assert opened.stdout == "connected\n" and "net" not in detect_isolation(network=True).namespaces
    if "net" in detect_isolation().namespaces:
        assert closed.stdout != "connected\n" and accepted == 1  # only the network=True run got through
    else:  # documented: no way to drop the network for an unprivileged process here
        assert closed.stdout == "connected\n" and accepted == 2


def test_without_namespaces_the_launcher_still_shields_the_trainer(monkeypatch):
    """The plain fallback (rlimits + session + launcher, no unshare) on any POSIX machine."""
    iso = detect_isolation()
    fallback = Isolation(
        (), (), iso.uid, iso.python, "per-user" if sys.platform.startswith("linux") else "not enforced"
    )
    monkeypatch.setitem(sandbox._detected, False, fallback)
    ok = run_python("print('fine')", FAST)
    assert (ok.reason, ok.stdout, ok.isolation) == ("ok", "fine\n", fallback.describe())
    assert fallback.describe().startswith("namespaces=none ")
    killer = run_python("import os, time\nos.kill(os.getppid(), 9)\ntime.sleep(5)", FAST)
    assert (killer.reason, killer.returncode) == ("killed", -signal.SIGKILL)
    assert killer.seconds < 2.0  # the orphaned program was killed with its group, not left to sleep


def test_a_tampered_launcher_report_is_read_as_no_report_not_raised():
    """A program of the trainer's own user can open the launcher's status pipe (/proc/<launcher>/fd/N) and
    write to it; whatever it wrote must not make run_python raise (that would end a training run)."""
    for status in ("signal x", "exit 0exit 1", "exit", "signal 9signal 9", "exit 0\n"):
        assert sandbox._reason(None, status, 1, "") == ("killed", 1)
    assert sandbox._reason(None, "exit 0", 0, "") == ("ok", 0)  # the launcher's own reports still count
    assert sandbox._reason(None, "signal 24", 152, "") == ("cpu_time", -24)


def test_an_interpreter_that_cannot_run_here_is_an_error_not_a_fallback(monkeypatch):
    """A trainer that is not root, whose Python cannot run for it in a fresh directory (a virtual environment under
    another user's home): every namespace probe failed, isolation fell back to none, and every run then failed
    to start. The bare interpreter is probed first, and none working is an error naming the interpreters."""
    probed = []
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(
        sandbox, "_runs", lambda prefix, python, uid: probed.append((prefix, python)) or False
    )
    with pytest.raises(
        RuntimeError, match=r"comarl.sandbox: none of the Python interpreters \[.*\] runs a program"
    ):
        sandbox._probe(network=False)
    assert probed and all(prefix == [] for prefix, _ in probed)  # no namespace probe was tried


def test_process_limit_is_per_user_on_kernels_before_5_14(monkeypatch):
    """Linux counts RLIMIT_NPROC per user namespace only from 5.14; before, a user namespace does not make it
    per run, and every concurrent run (and the trainer's own threads) would share one small limit."""
    expected = detect_isolation().processes
    monkeypatch.setattr(sandbox.platform, "release", lambda: "5.4.0-150-generic")
    old = sandbox._probe(network=False)
    assert old.processes == ("not enforced" if expected == "not enforced" else "per-user")
    monkeypatch.setattr(sandbox.platform, "release", lambda: "5.14.0-70.el9.x86_64")
    assert sandbox._probe(network=False).processes == expected


# ---------------------------------------------------------------------------- the pool


def test_pool_runs_concurrently_and_keeps_input_order():
    sources = [f"import time\ntime.sleep(0.5)\nprint({i})" for i in range(8)]
    start = time.perf_counter()
    with SandboxPool(max_workers=4, limits=FAST) as pool:
        results = pool.run_many(sources)
        assert pool.runs == 8
    elapsed = time.perf_counter() - start
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
    assert all(isinstance(r, RunResult) and r.ok for r in results)
    assert elapsed < 2.5  # one after another would take more than 4 s


def test_pool_gives_each_program_its_own_stdin():
    with SandboxPool(max_workers=2, limits=FAST) as pool:
        results = pool.run_many(["print(input().upper())"] * 2, ["a", "b"])
        assert [r.stdout for r in results] == ["A\n", "B\n"]
        with pytest.raises(ValueError, match=r"SandboxPool.run_many: 2 sources but 1 stdins"):
            pool.run_many(["pass", "pass"], ["x"])


def test_pool_default_workers_is_the_core_count():
    with SandboxPool() as pool:
        assert pool.max_workers == os.cpu_count()


def test_memory_limit_is_the_given_mebibytes():
    """memory_mb is MiB of address space: under 128 MiB a 160 MiB buffer fails, a 32 MiB one fits."""
    program = (
        "small = bytearray(32 * 2**20)\n"
        "print('small', flush=True)\n"
        "big = bytearray(160 * 2**20)\n"
        "print('big')\n"
    )
    result = run_python(program, fast(memory_mb=128))
    assert (result.reason, result.stdout) == ("memory", "small\n")


def test_file_size_limit_is_the_given_mebibytes():
    """file_size_mb=1 lets a file grow to exactly 2**20 bytes and not one byte more."""
    program = (
        "import os\n"
        "open('a', 'wb').write(b'0' * 2**20)\n"
        "print(os.path.getsize('a'), flush=True)\n"
        "with open('b', 'wb') as f:\n"
        "    f.write(b'0' * (2**20 + 1))\n"
    )
    result = run_python(program, fast(file_size_mb=1))
    assert (result.reason, result.returncode, result.stdout) == ("file_size", 1, "1048576\n")


def test_a_program_that_restores_sigxfsz_is_reported_as_file_size():
    """Python ignores SIGXFSZ; a program that turns it back on is killed by it, which is still a file-size end."""
    program = "import signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_DFL)\nopen('big', 'wb').write(b'0' * (2 * 2**20))\n"
    result = run_python(program, fast(file_size_mb=1))
    assert (result.ok, result.reason, result.returncode) == (False, "file_size", -signal.SIGXFSZ)


def test_open_files_limit_counts_the_standard_streams():
    """open_files=20: stdin, stdout and stderr hold 3 descriptors, so 17 more opens succeed and the 18th fails."""
    program = (
        "import os\n"
        "opened = 0\n"
        "try:\n"
        "    while True:\n"
        "        os.open(os.devnull, os.O_RDONLY)\n"
        "        opened += 1\n"
        "except OSError as error:\n"
        "    print(opened, error.errno == 24)\n"  # EMFILE
    )
    result = run_python(program, fast(open_files=20))
    assert (result.reason, result.stdout) == ("ok", "17 True\n")


@pytest.mark.parametrize("forks", [True, False])
def test_process_limit_per_run_is_the_programs_own(monkeypatch, forks):
    """Per run, the program may have ``processes`` processes at once, itself included: with processes=8 it starts
    7 children, whether unshare forks (``--pid --fork``: it stays, and counts) or execs the launcher (``--user
    --net``). The limit counted unshare and the launcher too and left it 6; then it counted unshare always (8)."""
    iso = detect_isolation()
    if iso.processes != "per-run":
        pytest.skip(f"RLIMIT_NPROC is {iso.processes} here: the count depends on the user's other processes")
    if not forks:  # the fallback set-up, as on a machine without PID namespaces
        unshare = (iso.unshare[0], "--user", "--net")
        monkeypatch.setitem(
            sandbox._detected, False, Isolation(unshare, ("user", "net"), iso.uid, iso.python, "per-run")
        )
    program = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "except OSError:\n"
        "    print(children)\n"
    )
    result = run_python(program, fast(processes=8))
    assert (result.reason, result.stdout) == ("ok", "7\n")
    # one process is the program alone: it runs, and cannot start another
    alone = run_python(
        "import os\ntry:\n    os.fork()\nexcept OSError:\n    print('alone')", fast(processes=1)
    )
    assert (alone.reason, alone.stdout) == ("ok", "alone\n")


def test_cpu_limit_is_rounded_up_to_whole_seconds():
    """RLIMIT_CPU takes whole seconds: cpu_s=1.5 allows 2 s, so 1.1 s of CPU finishes (1 s would end it)."""
    program = "import time\nwhile time.process_time() < 1.1:\n    pass\nprint('done')\n"
    result = run_python(program, fast(cpu_s=1.5))
    assert (result.reason, result.stdout) == ("ok", "done\n")


def test_output_of_exactly_output_bytes_is_kept_whole_and_one_more_byte_ends_the_run():
    """The cap is output_bytes bytes kept: 10 bytes under a cap of 10 are a normal end, 11 are cut to 10."""
    exact = run_python("print('x' * 9)", fast(output_bytes=10))
    assert (exact.reason, exact.stdout) == ("ok", "x" * 9 + "\n")
    over = run_python("print('x' * 10)", fast(output_bytes=10))
    assert (over.reason, over.returncode, over.stdout) == ("output_limit", None, "x" * 10)


def test_the_environment_points_home_and_tmpdir_at_the_runs_directory():
    """The five variables a program sees: a fixed PATH, a UTF-8 locale, and HOME = TMPDIR = its own directory."""
    program = (
        "import os\n"
        "env = os.environ\n"
        "print(env['PATH'], env['LANG'], env['LC_ALL'])\n"
        "print(env['HOME'] == env['TMPDIR'] == os.getcwd())\n"
    )
    result = run_python(program, FAST)
    assert result.stdout == "/usr/local/bin:/usr/bin:/bin C.UTF-8 C.UTF-8\nTrue\n"


def test_stdin_the_program_does_not_read_is_no_error():
    """A program that exits without reading its 1 MiB of stdin closes the pipe: that ends the writing, not the run."""
    result = run_python("print('bye')", FAST, "x" * 2**20)
    assert (result.ok, result.reason, result.stdout) == (True, "ok", "bye\n")


def test_pool_runs_under_its_own_limits():
    """The pool's limits apply to each run: a cap of 5 bytes keeps 'abcde' of 'abcdefgh'."""
    with SandboxPool(max_workers=1, limits=fast(output_bytes=5)) as pool:
        (result,) = pool.run_many(["print('abcdefgh')"])
    assert (result.reason, result.stdout) == ("output_limit", "abcde")


def test_limits_refuse_endless_seconds():
    """An infinite or NaN timeout would mean no wall-clock limit at all (and NaN > 0 is False only by luck)."""
    for bad in (float("inf"), float("nan")):
        with pytest.raises(
            ValueError, match=r"SandboxLimits.timeout_s=.*: give a positive number of seconds"
        ):
            SandboxLimits(timeout_s=bad)
        with pytest.raises(ValueError, match=r"SandboxLimits.cpu_s=.*: give a positive number of seconds"):
            SandboxLimits(cpu_s=bad)


def test_the_launchers_streams_are_dev_null_even_to_a_reader_allowed_to_see_them(monkeypatch):
    """Run as this test's own user without namespaces: root may read any process's fds, and finds /dev/null there
    (the launcher dropped the trainer's pipes); any other user finds the launcher not dumpable."""
    iso = detect_isolation()
    monkeypatch.setitem(sandbox._detected, False, Isolation((), (), None, iso.python, "not enforced"))
    probe = (
        "import os\n"
        "try:\n"
        "    print(sorted(os.readlink(f'/proc/{os.getppid()}/fd/{n}') for n in (0, 1, 2)))\n"
        "except OSError as error:\n"
        "    print(type(error).__name__)\n"
    )
    result = run_python(probe, FAST)
    expected = str(["/dev/null"] * 3) if os.geteuid() == 0 else "PermissionError"
    assert (result.reason, result.stdout.strip()) == ("ok", expected)


def test_probe_picks_the_most_isolated_set_up_that_runs(monkeypatch):
    """With every probe working: root runs programs as nobody in user, net, pid and mount namespaces with a per-run
    process limit; another user runs them as itself; root with no interpreter for nobody enforces no limit."""
    monkeypatch.setattr(sandbox.sys, "platform", "linux")
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: f"/usr/bin/{name}")
    monkeypatch.setattr(sandbox.platform, "release", lambda: "6.1.0")
    monkeypatch.setattr(sandbox, "_runs", lambda prefix, python, uid: True)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    flags = ("--pid", "--fork", "--kill-child", "--mount-proc")
    assert sandbox._probe(network=False) == Isolation(
        ("/usr/bin/unshare", "--user", "--net", *flags),
        ("user", "net", "pid", "mount"),
        65534,
        sys.executable,
        "per-run",
    )
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    assert sandbox._probe(network=True) == Isolation(
        ("/usr/bin/unshare", "--user", *flags), ("user", "pid", "mount"), None, sys.executable, "per-run"
    )
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox, "_runs", lambda prefix, python, uid: uid is None)  # nothing runs as nobody
    with pytest.warns(UserWarning, match=r"sandboxed programs run as root"):
        as_root = sandbox._probe(network=False)
    assert (as_root.uid, as_root.namespaces, as_root.processes) == (
        None,
        ("user", "net", "pid", "mount"),
        "not enforced",
    )
