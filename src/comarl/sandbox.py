"""Run untrusted (model-written) Python in a child process, with limits, never in the trainer.

One run, top to bottom (``run_python``):

1. write the source into a fresh temporary directory (removed afterwards);
2. start, in a new session (its own process group), with a scrubbed environment::

       [unshare --user --net --pid --fork --kill-child --mount-proc]  python -I -S -c LAUNCHER ...

   ``unshare`` is used when this machine lets an unprivileged process create namespaces
   (detected once): no network, a private PID space and ``/proc``. The *launcher* sets the
   resource limits (CPU time, address space, file size, open files, processes), then forks and
   runs ``python -I program.py``; it is the program's parent, so a program that kills its parent
   kills the launcher, not the trainer. When the trainer runs as root, the whole chain runs as
   the unprivileged user ``nobody`` (root ignores the process-count limit);
3. read stdout and stderr with a size cap, until the program ends, the wall-clock timeout or
   the cap; then kill the whole process group, always, so nothing the program started survives
   (with a PID namespace, even processes that left the group die with it). The launcher ends the
   run itself a second after the timeout, should the trainer have died or hung meanwhile.

What is *not* isolated (writing to user-writable paths, and more without namespaces) is listed
in ``docs/sandbox.md``. Only POSIX systems are supported.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

REASONS = ("ok", "timeout", "cpu_time", "memory", "file_size", "output_limit", "exit_code", "killed", "error")
NOBODY = 65534
PROGRAM_FILE = "program.py"
# The only environment a program sees: nothing of the trainer's (tokens, keys, paths) leaks in.
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# The intermediate process between the trainer and the program (runs as ``python -I -S -c``).
# argv: status fd, cpu seconds, address-space bytes, file-size bytes, open files, processes (-1: none),
# interpreter, program file, wall-clock seconds. It reports "exit N", "signal N" or "error TEXT" on the
# status fd, which the program does not inherit. A PID namespace's init ignores signals from inside it, so
# the launcher reports the program's fate instead of re-raising it. It also ends the run itself a second
# after the wall-clock limit, in case the trainer does not (it was killed, or hangs).
LAUNCHER = r"""
import os, resource, signal, sys
fd = int(sys.argv[1])
os.set_inheritable(fd, False)
cpu, memory, fsize, nofile, nproc = (int(a) for a in sys.argv[2:7])
try:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    if nproc >= 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    pid = os.fork()
except (OSError, ValueError) as exc:
    os.write(fd, ("error " + repr(exc)).encode())
    os._exit(125)
if pid == 0:
    try:
        os.execv(sys.argv[7], [sys.argv[7], "-I", sys.argv[8]])
    finally:
        os._exit(127)
# The program has its own copies of stdin/stdout/stderr; this process drops its own and becomes non-dumpable,
# so that a program of the same user cannot open them (or the status fd) through /proc/<launcher>/fd.
devnull = os.open(os.devnull, os.O_RDWR)
for target in (0, 1, 2):
    os.dup2(devnull, target)
try:
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4 (Linux)
except (ImportError, OSError, AttributeError):
    pass


def expire(signum, frame):
    os.killpg(0, signal.SIGKILL)  # the run's process group; as a PID namespace's init, exiting ends the rest
    os._exit(137)


signal.signal(signal.SIGALRM, expire)
signal.setitimer(signal.ITIMER_REAL, float(sys.argv[9]))
while True:
    try:
        status = os.waitpid(pid, 0)[1]
        break
    except InterruptedError:
        continue
if os.WIFSIGNALED(status):
    os.write(fd, b"signal %d" % os.WTERMSIG(status))
    os._exit(128 + os.WTERMSIG(status))
os.write(fd, b"exit %d" % os.WEXITSTATUS(status))
os._exit(os.WEXITSTATUS(status))
"""


@dataclass
class SandboxLimits:
    """Limits of one sandboxed run. Every limit applies to the program and everything it starts."""

    timeout_s: float = 10.0  # wall-clock seconds before the whole process group is killed
    cpu_s: float = 10.0  # CPU seconds (RLIMIT_CPU, rounded up); then SIGXCPU ends the program
    memory_mb: int = 1024  # address space per process in MiB (RLIMIT_AS); allocations beyond fail
    file_size_mb: int = 16  # largest file a process may write, in MiB (RLIMIT_FSIZE)
    open_files: int = 64  # open file descriptors per process (RLIMIT_NOFILE)
    # Processes (threads count) the program may have at once, itself included (RLIMIT_NPROC). Linux counts this limit
    # per *user*: with a user namespace comarl makes it per run; without one it is added to the
    # user's current count (see docs/sandbox.md); root ignores it, so root runs as ``nobody``.
    processes: int = 32
    output_bytes: int = 64_000  # bytes kept of stdout and of stderr each; more ends the run
    network: bool = False  # allow network access (False: a network namespace without interfaces)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SandboxLimits.{name}={value!r}: give a positive number of seconds")
        minimum = {"memory_mb": 64, "file_size_mb": 1, "open_files": 16, "processes": 1, "output_bytes": 1}
        for name, low in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"SandboxLimits.{name}={value!r}: give an integer >= {low} (Python itself needs that much to start)"
                )


@dataclass
class RunResult:
    """How one sandboxed run ended.

    ``reason`` is one word: ``ok`` (exit status 0), ``timeout`` (wall clock), ``cpu_time``
    (RLIMIT_CPU), ``memory`` (ended by a MemoryError: RLIMIT_AS), ``file_size`` (a write beyond
    RLIMIT_FSIZE), ``output_limit`` (more than ``output_bytes`` on stdout or stderr),
    ``exit_code`` (non-zero exit status, in ``returncode``), ``killed`` (a signal, ``returncode``
    = -signal; also when the program killed its launcher) or ``error`` (the sandbox could not
    start the program; the cause is in ``stderr``).
    """

    ok: bool  # exited with status 0 within the limits
    reason: str  # one of REASONS
    returncode: int | None  # exit status, -signal, or None when the sandbox ended the run (timeout, output)
    stdout: str  # at most output_bytes bytes of it, decoded as UTF-8 (invalid bytes replaced)
    stderr: str
    seconds: float  # wall-clock time of the run
    isolation: str = ""  # what was applied, see Isolation.describe()


@dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox apply (detected once per process, see ``detect_isolation``)."""

    unshare: tuple[str, ...]  # the unshare command prefix, () when namespaces are unavailable
    namespaces: tuple[str, ...]  # e.g. ("user", "net", "pid", "mount")
    uid: int | None  # run as this user (root drops to nobody), None: as the trainer's user
    python: str  # the interpreter of launcher and program
    processes: str  # how RLIMIT_NPROC applies: "per-run", "per-user" or "not enforced"

    def describe(self) -> str:
        """One line, e.g. ``namespaces=user,net,pid,mount uid=65534 processes=per-run python=/usr/bin/python3``."""
        user = "same" if self.uid is None else str(self.uid)
        return (
            f"namespaces={','.join(self.namespaces) or 'none'} uid={user} "
            f"processes={self.processes} python={self.python}"
        )


_detected: dict[bool, Isolation] = {}
_detect_lock = threading.Lock()


def detect_isolation(network: bool = False) -> Isolation:
    """Probe once what isolation works here, most isolated first; later calls return the cached answer.

    - user: when the trainer is root, run as ``nobody`` (if some Python interpreter works for
      nobody: ``sys.executable`` first, then the system's ``python3``), else as root with a warning;
    - namespaces: ``unshare --user --net --pid --fork --kill-child --mount-proc`` (no ``--net``
      when ``network``), else ``unshare --user [--net]``, else none;
    - processes: "per-run" with a user namespace (Linux >= 5.14 counts RLIMIT_NPROC per user
      namespace) and not root, "per-user" otherwise on Linux, "not enforced" for root or off Linux.
    """
    with _detect_lock:
        if network not in _detected:
            _detected[network] = _probe(network)
        return _detected[network]


def _probe(network: bool) -> Isolation:
    if os.name != "posix":
        raise RuntimeError(
            f"comarl.sandbox needs a POSIX system (Linux or macOS), not os.name={os.name!r}: "
            "on Windows run training inside WSL2 or a Linux container"
        )
    interpreters = [sys.executable, os.path.realpath(sys.executable), shutil.which("python3", path=SAFE_PATH)]
    interpreters = list(dict.fromkeys(p for p in interpreters if p))
    uid: int | None = None
    python = interpreters[0]
    if os.geteuid() == 0:
        usable = next((p for p in interpreters if _runs([], p, NOBODY)), None)
        if usable is not None:
            uid, python = NOBODY, usable
        else:
            warnings.warn(
                "comarl.sandbox: the trainer runs as root and no Python interpreter is usable by 'nobody', so "
                "sandboxed programs run as root: no process-count limit and write access everywhere. Run the "
                "trainer as an ordinary user, or install python3 system-wide.",
                stacklevel=3,
            )
    else:
        # Checked bare first: an interpreter that cannot run here would make every namespace probe fail too, and
        # the runs would then fail to start with no isolation reported as the cause.
        usable = next((p for p in interpreters if _runs([], p, None)), None)
        if usable is None:
            raise RuntimeError(
                f"comarl.sandbox: none of the Python interpreters {interpreters} runs a program in a fresh "
                f"temporary directory as this user (uid {os.geteuid()}): make one of them executable and readable "
                "by this user (a virtual environment under another user's home often is not), or install python3 "
                "system-wide"
            )
        python = usable
    net = () if network else ("--net",)
    candidates = [
        (
            ("--user", *net, "--pid", "--fork", "--kill-child", "--mount-proc"),
            ("user", "net", "pid", "mount"),
        ),
        (("--user", *net), ("user", "net")),
    ]
    unshare_path = shutil.which("unshare") if sys.platform.startswith("linux") else None
    prefix: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    if unshare_path is not None:
        for flags, names in candidates:
            command = (unshare_path, *flags)
            if _runs(list(command), python, uid):
                prefix, namespaces = command, tuple(n for n in names if n != "net" or not network)
                break
    if not sys.platform.startswith("linux") or (uid is None and os.geteuid() == 0):
        processes = "not enforced"
    elif "user" in namespaces and _kernel_version() >= (5, 14):  # before, RLIMIT_NPROC ignores the namespace
        processes = "per-run"
    else:
        processes = "per-user"
    return Isolation(prefix, namespaces, uid, python, processes)


def _kernel_version() -> tuple[int, int]:
    """(major, minor) of the running kernel, e.g. (5, 15) for "5.15.0-91-generic"; (0, 0) when unreadable."""
    match = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _runs(prefix: list[str], python: str, uid: int | None) -> bool:
    """Whether ``prefix + [python, -I, program.py]`` runs a trivial program in a fresh temporary directory
    (owned by ``uid`` when given, as that user) within 10 s: the way ``run_python`` will use it."""
    workdir = tempfile.mkdtemp(prefix="comarl-sandbox-probe-")
    try:
        program = os.path.join(workdir, PROGRAM_FILE)
        with open(program, "w") as f:
            f.write("print('ok')\n")
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(program, uid, uid)
        result = subprocess.run(
            [*prefix, python, "-I", program],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=_environment(workdir),
            cwd=workdir,
            timeout=10,
            **_as_user(uid),
        )
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        _remove_tree(workdir)
    return result.returncode == 0 and result.stdout == b"ok\n"


def _as_user(uid: int | None) -> dict[str, object]:
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _environment(workdir: str) -> dict[str, str]:
    """The whole environment of a sandboxed program: a minimal PATH, a UTF-8 locale, HOME = its directory."""
    return {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _user_process_count(uid: int) -> int:
    """Processes (threads included) of real user ``uid`` now, from /proc: what Linux's RLIMIT_NPROC counts."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # the process ended while we looked
        if int(fields.get("Uid", "-1 0").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def run_python(source: str, limits: SandboxLimits | None = None, stdin: str = "") -> RunResult:
    """Run ``source`` as ``python -I program.py`` in a fresh directory under ``limits``; never raises for
    anything the program does."""
    limits = SandboxLimits() if limits is None else limits
    iso = detect_isolation(limits.network)
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="comarl-sandbox-")
    try:
        program = os.path.join(workdir, PROGRAM_FILE)
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        if iso.uid is not None:
            os.chown(workdir, iso.uid, iso.uid)
            os.chown(program, iso.uid, iso.uid)
        nproc = -1
        # The launcher counts too, and so does unshare where it forks (--fork: it waits for the namespace's PID 1).
        own = 1 + ("--fork" in iso.unshare)
        if iso.processes == "per-run":
            nproc = limits.processes + own
        elif iso.processes == "per-user":
            nproc = _user_process_count(os.getuid() if iso.uid is None else iso.uid) + limits.processes + own
        return _run(iso, limits, workdir, program, nproc, stdin.encode("utf-8"), start)
    finally:
        _remove_tree(workdir)


def _run(
    iso: Isolation, limits: SandboxLimits, workdir: str, program: str, nproc: int, stdin: bytes, start: float
) -> RunResult:
    status_read, status_write = os.pipe()
    command = [
        *iso.unshare,
        iso.python,
        "-I",
        "-S",
        "-c",
        LAUNCHER,
        str(status_write),
        str(math.ceil(limits.cpu_s)),
        str(limits.memory_mb * 2**20),
        str(limits.file_size_mb * 2**20),
        str(limits.open_files),
        str(nproc),
        iso.python,
        program,
        str(limits.timeout_s + 1.0),
    ]
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=_environment(workdir),
            start_new_session=True,  # its own session and process group, killed whole below
            pass_fds=(status_write,),
            close_fds=True,
            **_as_user(iso.uid),
        )
    except OSError as exc:
        os.close(status_read)
        os.close(status_write)
        return RunResult(False, "error", None, "", f"could not start: {exc!r}", 0.0, iso.describe())
    os.close(status_write)
    try:
        stdout, stderr, ended_by = _communicate(proc, stdin, limits, start + limits.timeout_s)
    finally:
        _kill_group(proc)
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]
        with os.fdopen(status_read, "rb") as f:
            os.set_blocking(f.fileno(), False)
            status = (f.read() or b"").decode("ascii", "replace")
    seconds = time.perf_counter() - start
    out, err = stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    reason, returncode = _reason(ended_by, status, proc.returncode, err)
    if reason == "error":
        err = f"{err}\nsandbox launcher: {status}".strip()
    return RunResult(reason == "ok", reason, returncode, out, err, seconds, iso.describe())


def _communicate(
    proc: subprocess.Popen, stdin: bytes, limits: SandboxLimits, deadline: float
) -> tuple[bytes, bytes, str | None]:
    """Feed stdin and read stdout/stderr (each capped at ``output_bytes``) until both close, the deadline or
    the cap. Returns the output and ``"timeout"``/``"output_limit"`` when the sandbox ended the run."""
    selector = selectors.DefaultSelector()
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # type: ignore[union-attr]
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    stdin_fd = proc.stdin.fileno()  # type: ignore[union-attr]
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(stdin_fd, False)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()  # type: ignore[union-attr]
    ended_by, exited_at = None, None
    try:
        while any(fd in selector.get_map() for fd in buffers):
            now = time.perf_counter()
            if now >= deadline:
                ended_by = "timeout"
                break
            if exited_at is None and _has_exited(proc):
                exited_at = now
            elif exited_at is not None and now - exited_at > 0.2:
                break  # the program is gone; something it left behind holds the pipes open
            for key, _ in selector.select(min(deadline - now, 0.05)):
                if key.fd == stdin_fd:
                    try:
                        pending = pending[os.write(stdin_fd, pending[:65536]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]  # the program stopped reading: fine
                    if not pending:
                        selector.unregister(stdin_fd)
                        proc.stdin.close()  # type: ignore[union-attr]
                    continue
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                room = limits.output_bytes - len(buffer)
                buffer += chunk[:room]
                if len(chunk) > room:
                    ended_by = "output_limit"
            if ended_by is not None:
                break
        # The pipes close when the program's side does (the launcher drops its copies once the program starts);
        # the launcher reports the program's end after reaping it, so wait for it, unreaped, up to the deadline.
        while ended_by is None and not _has_exited(proc):
            if time.perf_counter() >= deadline:
                ended_by = "timeout"
                break
            time.sleep(0.002)
    finally:
        selector.close()
    return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), ended_by  # type: ignore[union-attr]


def _has_exited(proc: subprocess.Popen) -> bool:
    """Whether the outermost process ended, without reaping it (its pid stays the group's id until reaped)."""
    if hasattr(os, "waitid"):
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None
    return proc.poll() is not None


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's whole process group (the leader may already be gone; its group may not).

    Called before the leader is reaped, so the group id cannot have been reused. A process that is
    forking while the signal arrives takes its child down too (the kernel restarts such forks), so
    one signal reaches every member; they finish dying (and are reaped by init) asynchronously.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _reason(
    ended_by: str | None, status: str, launcher_code: int | None, stderr: str
) -> tuple[str, int | None]:
    """The one-word reason and the program's return code, from who ended the run and the launcher's report."""
    if ended_by is not None:
        return ended_by, None
    kind, _, value = status.partition(" ")
    if kind == "error":
        return "error", None
    # A program of the trainer's user can open the launcher's status pipe via /proc and write to it: a report
    # that is not exactly "exit N" / "signal N" counts as none rather than raising in the trainer.
    if kind in ("exit", "signal") and not (value.isascii() and value.isdigit()):
        kind = "tampered"
    if kind == "signal":
        number = int(value)
        if number == signal.SIGXCPU:
            return "cpu_time", -number
        if number == signal.SIGXFSZ:
            return "file_size", -number
        return "killed", -number
    if kind != "exit":  # no (usable) report: the launcher was killed (by the program, or the OOM killer)
        return "killed", launcher_code
    code = int(value)
    if code == 0:
        return "ok", 0
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    if last.startswith("MemoryError"):
        return "memory", code
    if "[Errno 27]" in last:  # EFBIG: Python ignores SIGXFSZ, so the write fails instead
        return "file_size", code
    return "exit_code", code


def _remove_tree(path: str) -> None:
    """Delete the run's directory even if the program made parts of it read-only."""

    def make_writable(func, target, _exc):  # noqa: ANN001, ANN202
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)

    shutil.rmtree(path, onerror=make_writable)  # onexc only exists from Python 3.12


class SandboxPool:
    """Runs many programs concurrently, at most ``max_workers`` at once (default ``os.cpu_count()``).

    Each worker thread only waits on its child process; the programs are the processes.
    Use as a context manager, or call ``close()``.
    """

    def __init__(self, max_workers: int | None = None, limits: SandboxLimits | None = None) -> None:
        if max_workers is not None and (isinstance(max_workers, bool) or max_workers < 1):
            raise ValueError(f"SandboxPool: max_workers={max_workers!r}; give a positive integer or None")
        self.max_workers = max_workers or os.cpu_count() or 1
        self.limits = SandboxLimits() if limits is None else limits
        self._executor = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="comarl-sandbox")
        self.runs = 0  # programs run so far

    def run_many(self, sources: Sequence[str], stdins: Sequence[str] | None = None) -> list[RunResult]:
        """Run every source (with its ``stdins`` entry as standard input, if given) under the pool's limits;
        results in input order."""
        stdins = [""] * len(sources) if stdins is None else stdins
        if len(stdins) != len(sources):
            raise ValueError(f"SandboxPool.run_many: {len(sources)} sources but {len(stdins)} stdins")
        detect_isolation(self.limits.network)  # probe once here, not in every worker at the same time
        results = list(self._executor.map(lambda s, i: run_python(s, self.limits, i), sources, stdins))
        self.runs += len(results)
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
