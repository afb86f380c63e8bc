"""Containment for model-generated code (the code verifier's test runs).

Two levels, chosen by `RLKV_CODE_SANDBOX` (`auto`, the default; `guard`; `namespace`):

- `guard` (always on): the program runs in a fresh `python -I -B` under a supervisor process,
  in its own session, with rlimits (address space, CPU time, file size), a private temporary
  working directory and an in-interpreter guard: an audit hook, installed before the program's
  first line, that refuses process creation (fork, exec, spawn, os.system, subprocess), signals,
  sockets, ctypes, rlimit changes, and writes, deletes or renames outside the working directory.
  When the program ends or times out the supervisor (a Linux child subreaper) kills every
  process the program left, also those in new sessions, and removes the working directory; it
  does so too when the caller is killed (parent-death signal). The guard stops accidents and
  the usual destructive calls of model code; it is not a security boundary against code written
  to escape it.
- `namespace` (an OS sandbox, with util-linux `unshare` and user namespaces): additionally a
  private network namespace (no interface but a down loopback), a PID namespace (every process
  of the program dies with it), every mount read-only, a private tmpfs as working directory and
  `/tmp`, and the program as an unprivileged user that cannot remount.

`auto` uses `namespace` where it works and `guard` elsewhere; `namespace` makes its absence an
error. The level in use is logged once per process.

This module is also the supervisor's script, run with the standard library alone (its one rlkv
import, the `UserError` marker, falls back to `Exception` there).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

try:  # run as the supervisor script (python -I -S), only the standard library is there
    from rlkv.errors import UserError
except ImportError:  # pragma: no cover - exercised in the supervisor process
    UserError = Exception

logger = logging.getLogger(__name__)

CONTAINMENT_ENV = "RLKV_CODE_SANDBOX"
LEVELS = ("auto", "guard", "namespace")
MEMORY_BYTES = 2 << 30
FILE_BYTES = 64 << 20
_SUPERVISOR_GRACE_S = 15.0
_RESULT_PREFIX = "rlkv-sandbox-result:"


class SandboxError(RuntimeError, UserError):
    """The requested code containment is unknown or not available on this machine."""


# Prepended to every verified program. An audit hook cannot be removed once added; the hook
# reads only its own default arguments, so the program cannot rebind what it checks.
GUARD = r"""
def _rlkv_guard():
    import os, sys
    refused = frozenset((
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "os.kill", "os.killpg", "signal.pthread_kill", "subprocess.Popen", "pty.spawn",
        "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
        "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "resource.setrlimit",
        "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "webbrowser.open", "sys.remote_exec",
    ))
    path_events = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
                   "os.chflags": 1, "os.utime": 1, "os.truncate": 1, "shutil.rmtree": 1,
                   "os.rename": 2, "os.link": 2, "os.symlink": 2}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    root = os.path.realpath(os.getcwd())

    def inside(path, root=root, realpath=os.path.realpath, fsdecode=os.fsdecode, sep=os.sep):
        if isinstance(path, int):
            return True
        try:
            full = realpath(fsdecode(path))
        except Exception:
            return False
        return full == root or full.startswith(root + sep)

    def hook(event, args, refused=refused, path_events=path_events, write_flags=write_flags,
             inside=inside):
        if event in refused:
            raise PermissionError(f"{event} is disabled in rlkv code verification")
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writes and not inside(path):
                raise PermissionError(f"rlkv code verification: writing {path!r} is disabled")
        elif event in path_events:
            for path in args[: path_events[event]]:
                if not inside(path):
                    raise PermissionError(f"rlkv code verification: {event} on {path!r} is disabled")

    sys.addaudithook(hook)
_rlkv_guard()
del _rlkv_guard
"""


@dataclass(frozen=True)
class RunResult:
    """How a contained program ended: its exit status (None when killed at the timeout)."""

    returncode: int | None
    timed_out: bool
    containment: str

    @property
    def passed(self) -> bool:
        """True when the program exited 0 within its time."""
        return self.returncode == 0 and not self.timed_out


# The OS sandbox: a user, network, PID and mount namespace; every mount remounted read-only,
# fresh tmpfs on the temporary directories, then a nested user namespace (uid nobody, no
# capabilities over these mounts) runs the program in /tmp.
_NAMESPACE_SETUP = r"""
for mp in $(awk '{print $5}' /proc/self/mountinfo); do
    mount -o remount,bind,ro "$mp" 2>/dev/null || true
done
for d in /tmp /var/tmp /dev/shm; do
    if [ -d "$d" ]; then mount -t tmpfs -o size=256m,mode=1777 tmpfs "$d" || exit 97; fi
done
cd /tmp || exit 97
exec unshare --user "$@"
"""
_NAMESPACE_PREFIX = [
    "unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
    "--mount", "--mount-proc", "--propagation", "private", "sh", "-c", _NAMESPACE_SETUP, "sh",
]  # fmt: skip


def _sandboxed_python() -> str:
    """The interpreter's real path: a venv's `bin/python` may live under /tmp, which the sandbox
    replaces with a fresh tmpfs; programs run isolated (-I) and need only the standard library."""
    return os.path.realpath(sys.executable)


@functools.cache
def os_sandbox_available() -> bool:
    """True when `unshare` can make the namespaces the `namespace` level needs (checked once per process)."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            [*_NAMESPACE_PREFIX, _sandboxed_python(), "-I", "-c", "pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@functools.cache
def _log_level(level: str) -> None:
    if level == "namespace":
        logger.info(
            "code verification: guard + OS sandbox (unshare: no network, read-only root, PID namespace)"
        )
    else:
        logger.warning(
            "code verification: guard only (own session, rlimits, audit-hook guard, tree kill); no OS sandbox "
            "here. Set %s=namespace to require one (needs util-linux unshare and user namespaces).",
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
            "--mount` (util-linux) is missing or user namespaces are not permitted; install util-linux "
            f"or enable user namespaces, or set {CONTAINMENT_ENV}=guard"
        )
    level = "namespace" if wanted == "namespace" or (wanted == "auto" and os_sandbox_available()) else "guard"
    _log_level(level)
    return level


def run_program(
    source: str, timeout_s: float, *, guard: bool = True, os_sandbox: bool | None = None
) -> RunResult:
    """Run Python `source` contained (see the module docstring) and report how it ended.

    `guard` prepends the audit-hook guard; `os_sandbox` None follows `active_containment()`.
    Output is discarded. Never raises for anything the program does.
    """
    if os_sandbox is None:
        os_sandbox = active_containment() == "namespace"
    if guard:
        source = GUARD + "\n" + source
    spec = {"timeout_s": float(timeout_s), "os_sandbox": bool(os_sandbox), "parent": os.getpid()}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    level = "namespace" if os_sandbox else "guard"
    try:
        out, _ = proc.communicate(source, timeout=timeout_s + _SUPERVISOR_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the supervisor cleans up on SIGTERM
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return RunResult(None, True, level)
    for line in out.splitlines():
        if line.startswith(_RESULT_PREFIX):
            report = json.loads(line[len(_RESULT_PREFIX) :])
            return RunResult(report["returncode"], report["timed_out"], level)
    logger.debug("code sandbox supervisor exited %s without a result", proc.returncode)
    return RunResult(proc.returncode or 1, False, level)


# ---- the supervisor: runs as `python -I -S -B sandbox.py SPEC` with the program on stdin ----


def _set_limits(cpu_s: int) -> None:
    import resource

    for limit, value in (
        (resource.RLIMIT_AS, MEMORY_BYTES),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, FILE_BYTES),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))


def _prctl(option: int, value: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _children() -> list[int]:
    """Pids whose parent is this process (orphans of the program land here: we are a subreaper)."""
    me, kids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me:
                kids.append(int(entry))
    return kids


def _kill_tree(pgid: int) -> None:
    """SIGKILL the program's process group, then every descendant (re-parented here) until none is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    while True:
        for pid in _children() if sys.platform.startswith("linux") else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _supervise(spec: dict) -> dict:
    timeout_s = spec["timeout_s"]
    if sys.platform.startswith("linux"):
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the caller's death reaches us
        _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphaned descendants become our children
    if os.getppid() != spec["parent"]:
        return {"returncode": None, "timed_out": False}
    source = sys.stdin.read()
    workdir = None if spec["os_sandbox"] else tempfile.mkdtemp(prefix="rlkv-code-")
    proc = None
    try:
        cmd = [sys.executable, "-I", "-B", "-"]
        if spec["os_sandbox"]:
            cmd = [*_NAMESPACE_PREFIX, _sandboxed_python(), "-I", "-B", "-"]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        env["TMPDIR"] = env["HOME"] = workdir or "/tmp"
        _set_limits(int(timeout_s) + 1)  # on this process too (it needs little): the program inherits them
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=workdir or "/",
            env=env,
            start_new_session=True,
        )
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)  # a blocking wait, interrupted at the timeout
        try:
            proc.stdin.write(source.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            return {"returncode": proc.wait(), "timed_out": False}
        except _TimedOut:
            return {"returncode": None, "timed_out": True}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup below runs to its end
        if proc is not None:
            _kill_tree(proc.pid)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


class _TimedOut(Exception):
    """The program's time is up (raised by the SIGALRM handler)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _TimedOut


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(3)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_sigterm)
    result = _supervise(json.loads(sys.argv[1]))
    print(_RESULT_PREFIX + json.dumps(result), flush=True)
