"""Containment for model-generated code (the code verifier's test runs).

Two levels, chosen by `RLKV_CODE_SANDBOX` (`auto`, the default; `guard`; `namespace`):

- `guard` (always on): the program runs in a fresh `python -I -B` under a supervisor process
  (`supervisor.py`), in its own session, with per-process rlimits (address space, CPU
  time, file size), a private temporary working directory and an in-interpreter guard
  (`child.py`): an audit hook, installed before the program's first line, that refuses
  process creation (fork, exec, spawn, `os.system`, `_posixsubprocess`, so `subprocess` and
  multiprocessing's spawn/forkserver), signals to other processes, sockets, ctypes, rlimit
  changes, frame introspection, other processes' `/proc` entries, opening directories outside the
  working directory, and writes, deletes or renames outside it. Replacing `sys.audit` lifts none
  of it. With tests, the tests run in a second contained interpreter (`harness.py`) that
  calls the program's functions over a pipe pair, values crossing as plain data
  (`wire.py`).
- `namespace` (an OS sandbox, with util-linux `unshare` and user namespaces): additionally a
  private network namespace (no interface but a down loopback), a PID namespace (every process
  of the program dies with it), every mount read-only, a private tmpfs as working directory and
  `/tmp`, the program as an unprivileged user that cannot remount, and `RLIMIT_NPROC` in its
  user namespace.

At both levels the supervisor measures the whole process tree while the program runs and kills
it over a total: `RLKV_CODE_MAX_PROCESSES` processes (default 64) or `RLKV_CODE_MEMORY_MB` of
summed resident memory (default 2048, also each process's address-space limit). When the
program ends, times out or is killed, every process it left dies (also those in new sessions)
and its working directory is removed, also when the caller is killed.

`auto` uses `namespace` where it works and `guard` elsewhere (with a warning, once);
`namespace` makes its absence an error. The level in use is logged once per process.

This module runs with the standard library alone (its one rlkv import, the `UserError` marker,
falls back to `Exception` there).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

try:  # imported alone (its folder on sys.path, no rlkv package): only the standard library is there
    from rlkv.errors import UserError
except ImportError:  # pragma: no cover - exercised when imported alone
    UserError = Exception

logger = logging.getLogger(__name__)

CONTAINMENT_ENV = "RLKV_CODE_SANDBOX"
MEMORY_ENV = "RLKV_CODE_MEMORY_MB"
PROCESSES_ENV = "RLKV_CODE_MAX_PROCESSES"
LEVELS = ("auto", "guard", "namespace")
MEMORY_BYTES = 2 << 30
MAX_PROCESSES = 64
FILE_BYTES = 64 << 20
_SUPERVISOR_GRACE_S = 15.0
_RESULT_PREFIX = "rlkv-sandbox-result:"  # = supervisor.RESULT_PREFIX (this module imports no sibling)
_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")


class SandboxError(RuntimeError, UserError):
    """The requested code containment or its limits are unknown, invalid or not available here."""


@dataclass(frozen=True)
class RunResult:
    """How a contained program ended.

    returncode: its exit status (None when killed at the timeout or over a limit); timed_out;
    containment: `guard` or `namespace`; limit: why it was killed over a whole-program limit
    (None if it was not); tests_passed: whether the test harness reported that every test ran
    and passed (None when run without tests).
    """

    returncode: int | None
    timed_out: bool
    containment: str
    limit: str | None = None
    tests_passed: bool | None = None

    @property
    def passed(self) -> bool:
        """With tests: the harness reported success. Without: the program exited 0. Never over a limit or time."""
        if self.timed_out or self.limit is not None:
            return False
        if self.tests_passed is not None:
            return self.tests_passed
        return self.returncode == 0


# The OS sandbox: a user, network, PID and mount namespace; every mount remounted read-only,
# fresh tmpfs on the temporary directories, then a nested user namespace (uid nobody, no
# capabilities over these mounts, RLIMIT_NPROC counted in it alone) runs the program in /tmp.
_NAMESPACE_SETUP = r"""
for mp in $(awk '{print $5}' /proc/self/mountinfo); do
    mount -o remount,bind,ro "$mp" 2>/dev/null || true
done
for d in /tmp /var/tmp /dev/shm; do
    if [ -d "$d" ]; then mount -t tmpfs -o size=256m,mode=1777 tmpfs "$d" || exit 97; fi
done
cd /tmp || exit 97
nproc=$1
shift
exec unshare --user prlimit --nproc="$nproc:$nproc" -- "$@"
"""


def _namespace_prefix(max_processes: int) -> list[str]:
    """The command prefix that runs a command inside the OS sandbox with `max_processes` tasks per user."""
    return [
        "unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
        "--mount", "--mount-proc", "--propagation", "private", "sh", "-c", _NAMESPACE_SETUP, "sh",
        str(max_processes),
    ]  # fmt: skip


def _sandboxed_python() -> str:
    """The interpreter's real path: a venv's `bin/python` may live under /tmp, which the sandbox
    replaces with a fresh tmpfs; programs run isolated (-I) and need only the standard library."""
    return os.path.realpath(sys.executable)


@functools.cache
def os_sandbox_available() -> bool:
    """True when `unshare` can make the namespaces the `namespace` level needs (checked once per process)."""
    if (
        not sys.platform.startswith("linux")
        or shutil.which("unshare") is None
        or shutil.which("prlimit") is None
    ):
        return False
    try:
        probe = subprocess.run(
            [*_namespace_prefix(MAX_PROCESSES), _sandboxed_python(), "-I", "-c", "pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@functools.cache
def _log_level(level: str, chosen: bool) -> None:
    if level == "namespace" or chosen:
        logger.info(
            "code verification: %s",
            "guard + OS sandbox (unshare: no network, read-only root, PID namespace)"
            if level == "namespace"
            else f"guard only, as {CONTAINMENT_ENV}=guard asks",
        )
    else:
        logger.warning(
            "code verification: guard only (own session, rlimits, whole-tree limits, audit-hook guard, tree "
            "kill); no OS sandbox here. Set %s=namespace to require one (needs util-linux unshare and user "
            "namespaces), or %s=guard to choose this level and silence this warning.",
            CONTAINMENT_ENV,
            CONTAINMENT_ENV,
        )


def active_containment() -> str:
    """The containment level in use, `guard` or `namespace`, from `RLKV_CODE_SANDBOX` (logged once).

    Raises `SandboxError` for an unknown setting, or for `namespace` where no OS sandbox works.
    """
    wanted = os.environ.get(CONTAINMENT_ENV, "auto").strip().lower() or "auto"
    if wanted not in LEVELS:
        raise SandboxError(f"{CONTAINMENT_ENV}={wanted!r} is not one of {', '.join(LEVELS)}")
    if wanted == "namespace" and not os_sandbox_available():
        raise SandboxError(
            f"{CONTAINMENT_ENV}=namespace but no OS sandbox works here: `unshare --user --net --pid "
            "--mount` and `prlimit` (util-linux) are missing or user namespaces are not permitted; install "
            f"util-linux or enable user namespaces, or set {CONTAINMENT_ENV}=guard"
        )
    level = "namespace" if wanted == "namespace" or (wanted == "auto" and os_sandbox_available()) else "guard"
    _log_level(level, wanted == level)
    return level


def _positive_int_env(name: str, default: int, most: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise SandboxError(f"{name}={text!r} must be an integer from 1 to {most}")
    return value


def sandbox_limits() -> tuple[int, int]:
    """(total resident memory in bytes, processes) the program and everything it starts may use.

    From `RLKV_CODE_MEMORY_MB` (default 2048; also each process's address-space limit) and
    `RLKV_CODE_MAX_PROCESSES` (default 64; in the OS sandbox also RLIMIT_NPROC, which counts threads).
    Raises `SandboxError` naming the variable for a value that is not a positive integer.
    """
    memory = _positive_int_env(MEMORY_ENV, MEMORY_BYTES >> 20, 1 << 22) << 20
    return memory, _positive_int_env(PROCESSES_ENV, MAX_PROCESSES, 4096)


def run_program(
    source: str,
    timeout_s: float,
    *,
    tests: str | None = None,
    setup: str | None = None,
    entry_point: str | None = None,
    guard: bool = True,
    os_sandbox: bool | None = None,
) -> RunResult:
    """Run Python `source` contained (see the module docstring) and report how it ended.

    tests: test code run in another interpreter against the program (`harness.py`): the
    names the tests read that the program defines are proxies to it, and only plain data crosses;
    `RunResult.passed` is then True only when the tests' interpreter reported, over a channel the
    program cannot write, that every test ran and passed. setup: trusted code run before the tests
    in their interpreter (HumanEval's prompt), whose names the program cannot replace except
    `entry_point`. `guard` installs the audit-hook guard; `os_sandbox` None follows
    `active_containment()`. Output is discarded. Never raises for anything the program does;
    `SandboxError` for an invalid setting.
    """
    if os_sandbox is None:
        os_sandbox = active_containment() == "namespace"
    memory_bytes, max_processes = sandbox_limits()
    spec = {
        "timeout_s": float(timeout_s),
        "os_sandbox": bool(os_sandbox),
        "guard": bool(guard),
        "parent": os.getpid(),
        "memory_bytes": memory_bytes,
        "process_memory_bytes": memory_bytes,
        "file_bytes": FILE_BYTES,
        "max_processes": max_processes,
        "prefix": _namespace_prefix(max_processes) if os_sandbox else [],
    }
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-B", _SUPERVISOR, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    level = "namespace" if os_sandbox else "guard"
    try:
        out, _ = proc.communicate(
            json.dumps({"program": source, "tests": tests, "setup": setup, "entry_point": entry_point}),
            timeout=timeout_s + _SUPERVISOR_GRACE_S,
        )
    except subprocess.TimeoutExpired:
        proc.terminate()  # the supervisor cleans up on SIGTERM
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return RunResult(None, True, level, tests_passed=None if tests is None else False)
    for line in out.splitlines():
        if line.startswith(_RESULT_PREFIX):
            report = json.loads(line[len(_RESULT_PREFIX) :])
            return RunResult(
                report["returncode"], report["timed_out"], level, report["limit"], report["tests_passed"]
            )
    logger.debug("code sandbox supervisor exited %s without a result", proc.returncode)
    return RunResult(proc.returncode or 1, False, level, tests_passed=None if tests is None else False)
