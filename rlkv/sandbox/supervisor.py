"""The code sandbox's supervisor: runs as `python -I -S -B supervisor.py SPEC` (standard library only).

It reads `{"program", "tests", "setup", "entry_point"}` as JSON on stdin, starts the contained
interpreters (see `rlkv.sandbox`; with tests, one for the program and one for the tests), and
prints one `rlkv-sandbox-result:{json}` line: `returncode` (None when it killed the run), `timed_out`,
`limit` (why it killed the run over a whole-program limit, else None) and `tests_passed` (None
without tests; else whether the tests' interpreter wrote this run's nonce). While the program runs
it measures the whole process tree (this supervisor is a child subreaper, so every descendant stays
under it, also after a double fork or `setsid`) and kills the tree when the processes or the sum of
their resident memory exceed the limits.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

RESULT_PREFIX = "rlkv-sandbox-result:"
_PAGE = os.sysconf("SC_PAGE_SIZE")
_POLL_FIRST_S, _POLL_MAX_S = 0.002, 0.02  # fast programs end fast; long ones are measured 50 times a second


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from every thread's /proc children list (the full /proc scan where absent)."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        for tid in tids:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        return kids
    except FileNotFoundError:
        if os.path.exists(f"/proc/{pid}"):
            return _children_by_scan(pid)
        return kids
    except OSError:
        return kids


def _children_by_scan(pid: int) -> list[int]:
    """Pids whose parent is `pid`, from every /proc/N/stat (kernels without CONFIG_PROC_CHILDREN)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children, their children, ...)."""
    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def resident_bytes(pid: int) -> int:
    """Resident memory of `pid` in bytes (0 once it is gone); shared pages count in each process."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _kill_tree(pgid: int) -> None:
    """SIGKILL the program's process group, then every descendant (re-parented here) until none is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    while True:
        for pid in _children(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _set_limits(cpu_s: int, memory_bytes: int, file_bytes: int) -> None:
    """Per-process rlimits, set in the program's process before it starts (its children inherit them)."""
    for limit, value in (
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))


def _harness(*names: str) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    texts = []
    for name in names:
        with open(os.path.join(here, name)) as f:
            texts.append(f.read())
    return "\n".join(texts)


def _program_source(spec: dict, payload: dict, fds: tuple[int, int] | None) -> str:
    """The program's interpreter's whole input: the guard, the wire format and the server, then the calls.

    fds: the (requests, replies) pipe ends it serves the tests on; None runs the program alone.
    """
    lines = [_harness("wire.py", "child.py")]
    if spec["guard"]:
        lines.append("_rlkv_guard()")
    if fds is None:
        lines.append(payload["program"])
    else:
        lines.append(f"_rlkv_serve{(payload['program'], *fds)!r}")
    return "\n".join(lines) + "\n"


def _tests_source(spec: dict, payload: dict, fds: tuple[int, int, int, int]) -> str:
    """The tests' interpreter's whole input (never the program's): guard, wire format, harness, the call."""
    lines = [_harness("wire.py", "child.py", "harness.py")]
    # without `site`, nothing imported `types` yet, and its first import reads a traceback's frame,
    # which the guard refuses: what the harness needs is imported before the guard
    lines.append("import importlib, json, types")
    if spec["guard"]:
        lines.append("_rlkv_guard()")
    args = (payload["tests"], payload.get("setup"), payload.get("entry_point"), *fds)
    lines.append(f"_rlkv_run_tests{args!r}")
    return "\n".join(lines) + "\n"


def _watch(proc: subprocess.Popen, spec: dict, own: int) -> dict:
    """Wait for the program, measuring its tree; the outcome without `tests_passed`."""
    deadline = time.monotonic() + spec["timeout_s"]
    try:
        waiter = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        waiter = None
    poll = _POLL_FIRST_S
    try:
        while proc.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"returncode": None, "timed_out": True, "limit": None}
            tree = descendants(os.getpid())
            processes = len(tree) - own
            if processes > spec["max_processes"]:
                return {
                    "returncode": None,
                    "timed_out": False,
                    "limit": f"processes: {processes} > {spec['max_processes']}",
                }
            memory = sum(resident_bytes(p) for p in tree)
            if memory > spec["memory_bytes"]:
                limit = f"memory: {memory >> 20} MiB > {spec['memory_bytes'] >> 20} MiB"
                return {"returncode": None, "timed_out": False, "limit": limit}
            if waiter is not None:
                select.select([waiter], [], [], min(poll, left))
            else:
                time.sleep(min(poll, left))
            poll = min(poll * 1.5, _POLL_MAX_S)
        return {"returncode": proc.returncode, "timed_out": False, "limit": None}
    finally:
        if waiter is not None:
            os.close(waiter)


def _start(
    prefix: list[str], source: str, cwd: str, fds: tuple[int, ...], limits: tuple, site: bool = True
) -> subprocess.Popen:
    """A contained `python -I -B -` in its own session with `limits`, fed `source`, keeping only `fds`.

    site=False adds `-S`: the tests' interpreter needs the standard library alone, and `site` (with
    the .pth files of an installed Python) can cost several times an interpreter's own start.
    """
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    env["TMPDIR"] = env["HOME"] = cwd if cwd != "/" else "/tmp"
    proc = subprocess.Popen(
        [*prefix, os.path.realpath(sys.executable), "-I", "-B", *([] if site else ["-S"]), "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
        start_new_session=True,
        pass_fds=fds,
        preexec_fn=lambda: _set_limits(*limits),
    )
    for fd in fds:
        os.close(fd)
    try:
        proc.stdin.write(source.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    return proc


def supervise(spec: dict, payload: dict) -> dict:
    """Run the payload contained as `spec` says, clean up everything it left, and report how it ended.

    With tests, two interpreters: the tests' (`harness.py`, outside the OS sandbox; it alone
    holds the nonce and the result pipe) and the program's (`child.py`'s server). They
    share one pair of pipes and nothing else.
    """
    _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the caller's death reaches us
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphaned descendants become our children
    if os.getppid() != spec["parent"]:
        return {"returncode": None, "timed_out": False, "limit": None, "tests_passed": None}
    with_tests = payload.get("tests") is not None
    nonce = secrets.token_hex(32).encode()
    result_r = None
    workdirs = [tempfile.mkdtemp(prefix="rlkv-tests-")] if with_tests else []
    if not spec["os_sandbox"]:
        workdirs.append(tempfile.mkdtemp(prefix="rlkv-code-"))
    procs = []
    limits = (int(spec["timeout_s"]) + 1, spec["process_memory_bytes"], spec["file_bytes"])
    outcome = {"returncode": None, "timed_out": False, "limit": None}
    try:
        program_fds = None
        if with_tests:
            nonce_r, nonce_w = os.pipe()
            result_r, result_w = os.pipe()
            requests_r, requests_w = os.pipe()
            replies_r, replies_w = os.pipe()
            os.write(nonce_w, nonce)
            os.close(nonce_w)
            fds = (replies_r, requests_w, nonce_r, result_w)
            # the program's interpreter starts at once: its guard refuses other processes' /proc
            # entries (the tests' stdin among them); the OS sandbox gives it its own /proc
            procs.append(_start([], _tests_source(spec, payload, fds), workdirs[0], fds, limits, site=False))
            program_fds = (requests_r, replies_w)
        source = _program_source(spec, payload, program_fds)
        cwd = "/" if spec["os_sandbox"] else workdirs[-1]
        procs.append(_start(spec["prefix"], source, cwd, program_fds or (), limits))
        own = (1 if spec["os_sandbox"] else 0) + (1 if with_tests else 0)  # the outer `unshare`, the tests
        outcome = _watch(procs[0], spec, own=own)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup below runs to its end
        for proc in reversed(procs):
            _kill_tree(proc.pid)
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
    outcome["tests_passed"] = None
    if result_r is not None:  # every writer is dead now: read to the end, bounded
        reported = b""
        while len(reported) <= len(nonce) and (chunk := os.read(result_r, 4096)):
            reported += chunk
        os.close(result_r)
        outcome["tests_passed"] = secrets.compare_digest(reported, nonce)
    return outcome


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(3)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_sigterm)
    result = supervise(json.loads(sys.argv[1]), json.loads(sys.stdin.read()))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
