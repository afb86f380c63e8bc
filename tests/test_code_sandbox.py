"""Containment of model-generated code: the guard, the process-tree kill, the OS sandbox, temp-dir cleanup."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rlkv import sandbox
from rlkv.verifiers.verify import run_python_tests

NEEDS_NAMESPACE = pytest.mark.skipif(
    not sandbox.os_sandbox_available(),
    reason="no OS sandbox here: `unshare --user --net --pid --mount` is missing or not permitted",
)
LEVELS = ["guard", pytest.param("namespace", marks=NEEDS_NAMESPACE)]


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    monkeypatch.setenv(sandbox.CONTAINMENT_ENV, request.param)
    return request.param


def _alive_with_marker(marker: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry))
    return found


def test_correct_solution_passes(level):
    assert run_python_tests("def add(a, b):\n    return a + b", "assert add(2, 3) == 5", timeout_s=5)
    assert not run_python_tests("def add(a, b):\n    return a - b", "assert add(2, 3) == 5", timeout_s=5)


def test_write_outside_the_work_dir_is_contained(level, tmp_path):
    target = tmp_path / "written.txt"
    run_python_tests(f"open({str(target)!r}, 'w').write('x')", "pass", timeout_s=3)
    assert not target.exists()
    # writing inside the program's own working directory stays allowed (the tests run elsewhere)
    scratch = "def f():\n    open('scratch.txt', 'w').write('x')\n    return open('scratch.txt').read()\n"
    assert run_python_tests(scratch, "assert f() == 'x'")


def test_shell_commands_are_contained(level, tmp_path):
    target = tmp_path / "touched"
    assert not run_python_tests(f"import os\nos.system('touch {target}')", "pass", timeout_s=3)
    assert not target.exists()


def test_raw_socket_cannot_reach_the_network(level):
    program = "import _socket\n_socket.socket().connect(('127.0.0.1', 9))"
    assert not run_python_tests(program, "pass", timeout_s=3)


@pytest.mark.parametrize(
    "spawn",
    [
        "import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)",
        "import os, time\nif os.fork() == 0:\n    os.execvp('sleep', ['sleep', '{marker}'])",
    ],
    ids=["setsid-child", "fork"],
)
def test_children_are_refused_and_none_survives(level, spawn):
    marker = "321.25" if "Popen" in spawn else "321.75"
    start = time.monotonic()
    assert not run_python_tests(spawn.format(marker=marker), "pass", timeout_s=5)
    assert time.monotonic() - start < 4, "a refused child must fail the program at once, not at the timeout"
    assert _alive_with_marker(f"sleep {marker}") == []


@pytest.mark.parametrize("os_sandbox", [False, pytest.param(True, marks=NEEDS_NAMESPACE)])
def test_background_child_holding_stdout_does_not_block_and_is_killed(os_sandbox):
    """A passing program whose setsid child keeps stdout open: scored at once, and the child dies."""
    source = (
        "import subprocess, sys\n"
        "subprocess.Popen(['sleep', '322.5'], start_new_session=True, stdout=sys.stdout, stderr=sys.stderr)\n"
    )
    start = time.monotonic()
    result = sandbox.run_program(source, timeout_s=5, guard=False, os_sandbox=os_sandbox)
    assert result.passed and not result.timed_out
    assert time.monotonic() - start < 4
    assert _alive_with_marker("sleep 322.5") == []


@pytest.mark.parametrize("os_sandbox", [False, pytest.param(True, marks=NEEDS_NAMESPACE)])
def test_timeout_kills_the_whole_tree(os_sandbox):
    source = (
        "import os, subprocess, time\n"
        "subprocess.Popen(['sleep', '323.5'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '323.75'])\n"
        "time.sleep(60)\n"
    )
    result = sandbox.run_program(source, timeout_s=1.5, guard=False, os_sandbox=os_sandbox)
    assert result.timed_out and not result.passed
    assert _alive_with_marker("sleep 323.") == []


@NEEDS_NAMESPACE
def test_os_sandbox_has_no_network_and_a_read_only_root(tmp_path):
    net = (
        "import errno, _socket, sys\n"
        "try:\n    _socket.socket().connect(('127.0.0.1', 9))\n"
        "except OSError as e:\n    sys.exit(0 if e.errno == errno.ENETUNREACH else 1)\n"
        "sys.exit(1)\n"
    )
    assert sandbox.run_program(net, timeout_s=5, guard=False, os_sandbox=True).passed
    target = tmp_path / "x"
    ro = f"open({str(target)!r}, 'w')"
    assert not sandbox.run_program(ro, timeout_s=5, guard=False, os_sandbox=True).passed
    assert not target.exists()
    scratch = "open('/tmp/s', 'w').write('x'); open('s', 'w').write('y')"
    assert sandbox.run_program(scratch, timeout_s=5, guard=False, os_sandbox=True).passed


def test_temp_dir_is_removed_even_when_the_caller_is_killed(tmp_path):
    """SIGKILL the process that called the verifier: the program dies and its temp dir goes."""
    env = {**os.environ, "TMPDIR": str(tmp_path), sandbox.CONTAINMENT_ENV: "guard"}
    code = (  # the module alone (standard library only): no torch import to wait for
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.dirname(sandbox.__file__))!r})\n"
        "sys.modules['rlkv'] = None\n"  # no package import (torch writes caches to TMPDIR while loading)
        "from sandbox import run_program\n"
        "run_program('import time\\ntime.sleep(324.5)', timeout_s=60, guard=False)\n"
    )
    caller = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 30
        # tempfile probes TMPDIR with a short-lived file before the supervisor makes its dir: wait for the dir
        while not (_alive_with_marker("324.5") and any(p.is_dir() for p in tmp_path.iterdir())):
            assert time.monotonic() < deadline, "the program never started"
            time.sleep(0.05)
        assert [p.name[: len("rlkv-code-")] for p in tmp_path.iterdir()] == ["rlkv-code-"]
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    deadline = time.monotonic() + 5
    while list(tmp_path.iterdir()) or _alive_with_marker("324.5"):
        assert time.monotonic() < deadline, f"left behind: {list(tmp_path.iterdir())}"
        time.sleep(0.05)


def test_containment_setting_is_validated_and_logged(monkeypatch, caplog):
    monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "bogus")
    with pytest.raises(sandbox.SandboxError, match=f"{sandbox.CONTAINMENT_ENV}.*auto, guard, namespace"):
        sandbox.active_containment()
    monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "guard")
    sandbox._log_level.cache_clear()  # logged once per process: earlier tests may have logged it
    with caplog.at_level("INFO", logger="rlkv.sandbox"):
        assert sandbox.active_containment() == "guard"
    assert "guard" in caplog.text


def test_requiring_the_os_sandbox_where_it_is_missing_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `unshare` on this PATH
    sandbox.os_sandbox_available.cache_clear()
    try:
        monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "namespace")
        with pytest.raises(sandbox.SandboxError, match="unshare"):
            sandbox.active_containment()
        monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "auto")
        assert sandbox.active_containment() == "guard"
    finally:
        sandbox.os_sandbox_available.cache_clear()


# ---- the guard against plain-Python bypasses: each escapes without the guard, none with it ----

_NO_AUDIT = "import sys\nsys.audit = lambda *a, **k: None\n"  # skips the Python-level audit events only
GUARD_BYPASSES = {
    "audit-off subprocess": _NO_AUDIT + "import subprocess\nsubprocess.run(['mkdir', {target!r}])",
    "audit-off os.popen": _NO_AUDIT + "import os\nos.popen('mkdir {target}').read()",
    "posix_spawn": "import os\nos.waitpid(os.posix_spawn('/bin/mkdir', ['mkdir', {target!r}], {{}}), 0)",
    "multiprocessing spawn": (
        "import __main__, multiprocessing, os\ndel __main__.__file__\n"
        "p = multiprocessing.get_context('spawn').Process(target=os.mkdir, "
        "args=({target!r},))\np.start()\np.join()"
    ),
    "multiprocessing forkserver": (
        "import __main__, multiprocessing, os\ndel __main__.__file__\n"
        "p = multiprocessing.get_context('forkserver').Process(target=os.mkdir, "
        "args=({target!r},))\np.start()\np.join()"
    ),
    "open dir_fd": (
        "import os\nd = os.open({parent!r}, os.O_RDONLY)\n"
        "os.close(os.open({name!r}, os.O_WRONLY | os.O_CREAT, dir_fd=d))"
    ),
    "mkdir dir_fd": "import os\nos.mkdir({name!r}, dir_fd=os.open({parent!r}, os.O_RDONLY))",
    "rename dst_dir_fd": (
        "import os\nopen('mine', 'w').close()\n"
        "os.rename('mine', {name!r}, dst_dir_fd=os.open({parent!r}, os.O_RDONLY))"
    ),
    "symlink dir_fd": "import os\nos.symlink('/', {name!r}, dir_fd=os.open({parent!r}, os.O_RDONLY))",
    "chdir then relative write": "import os\nos.chdir({parent!r})\nopen({name!r}, 'w').close()",
    "audit-off rmtree": _NO_AUDIT + "import shutil\nshutil.rmtree({victim!r})",
    "chmod through an fd": "import os\nos.chmod(os.open({file!r}, os.O_RDONLY), 0o600)",
}


@pytest.mark.parametrize("probe", list(GUARD_BYPASSES.values()), ids=list(GUARD_BYPASSES))
def test_guard_holds_against_plain_python_bypasses(probe, tmp_path):
    def attempt(guard: bool) -> bool:
        parent = tmp_path / ("unguarded" if not guard else "guarded")
        victim = parent / "victim"
        victim.mkdir(parents=True)
        file = parent / "file"
        file.write_text("x")
        file.chmod(0o644)
        source = probe.format(
            target=str(parent / "made"), parent=str(parent), name="made", victim=str(victim), file=str(file)
        )
        sandbox.run_program(source, timeout_s=10, guard=guard, os_sandbox=False)
        made = (parent / "made").exists() or (parent / "made").is_symlink()
        return made or not victim.exists() or file.stat().st_mode & 0o777 != 0o644

    assert attempt(guard=False), "the probe must escape without the guard, or it shows nothing"
    assert not attempt(guard=True)


def test_nothing_of_the_tests_is_in_the_programs_process():
    """Without the guard a program may walk every frame and read every object of its interpreter (the
    old harness's nonce was there); now neither the tests' text nor the nonce is in that process."""
    search = (
        "import gc, os, sys\n"
        "def found():\n"
        "    seen = [repr(f.f_locals) + repr(f.f_globals) + repr(f.f_code.co_consts) for f in frames()]\n"
        "    seen += [repr(o) for o in gc.get_objects() if isinstance(o, (str, bytes, dict))]\n"
        "    return any('== 4' in s or 'nonce' in s for s in seen)\n"
        "def frames():\n    f = sys._getframe()\n    while f is not None:\n        yield f\n        f = f.f_back\n"
        "def add(a, b):\n    return 4 if found() else 0\n"
        "if found():\n    os._exit(0)\n"
    )
    tests = "assert add(2, 2) == 4"
    assert not sandbox.run_program(search, timeout_s=10, tests=tests, guard=False, os_sandbox=False).passed
    # the same search finds the tests where a harness in the program's interpreter holds their text
    harness = f"def harness(tests={tests!r}):\n    exec(program + chr(10) + tests, {{}})\n"
    shared = f"program = {search!r}\n{harness}harness()\n"
    assert sandbox.run_program(shared, timeout_s=10, guard=False, os_sandbox=False).passed
    mem = "open('/proc/self/mem', 'rb')"
    assert sandbox.run_program(mem, timeout_s=5, guard=False, os_sandbox=False).passed
    assert not sandbox.run_program(mem, timeout_s=5, guard=True, os_sandbox=False).passed
    for frames in ("sys._current_frames()", "sys.settrace(lambda *a: None)", "(lambda: (yield))().gi_frame"):
        source = f"import sys\n{frames}"
        assert sandbox.run_program(source, timeout_s=5, guard=False, os_sandbox=False).passed
        assert not sandbox.run_program(source, timeout_s=5, guard=True, os_sandbox=False).passed


# ---- whole-program limits: the supervisor measures the tree, at every level ----

_FORK_AND_HOLD = (
    "import os, time\n"
    "for _ in range({n}):\n"
    "    if os.fork() == 0:\n"
    "        block = b'x' * ({mib} << 20)\n"
    "        time.sleep(30)\n"
    "        os._exit(0)\n"
    "time.sleep({wait})\n"
)


@pytest.mark.parametrize("os_sandbox", [False, pytest.param(True, marks=NEEDS_NAMESPACE)])
def test_total_memory_of_the_tree_is_limited(os_sandbox, monkeypatch):
    """Four children of 96 MiB each stay under the per-process limit but not under the 256 MiB total."""
    monkeypatch.setenv(sandbox.MEMORY_ENV, "256")
    source = _FORK_AND_HOLD.format(n=4, mib=96, wait=8)
    start = time.monotonic()
    result = sandbox.run_program(source, timeout_s=20, guard=False, os_sandbox=os_sandbox)
    assert not result.passed and result.limit is not None and result.limit.startswith("memory")
    assert time.monotonic() - start < 8, "killed when the total passed the limit, not at the program's end"


@pytest.mark.parametrize(
    "start",
    [
        "import os\nfor _ in range(12):\n    if os.fork() == 0:\n        time.sleep(30)\n        os._exit(0)",
        "import __main__, multiprocessing\ndel __main__.__file__\nfor _ in range(12):\n"
        "    multiprocessing.get_context('spawn').Process("
        "target=time.sleep, args=(30,)).start()",
        "import __main__, multiprocessing\ndel __main__.__file__\nfor _ in range(12):\n"
        "    multiprocessing.get_context('forkserver').Process("
        "target=time.sleep, args=(30,)).start()",
    ],
    ids=["fork", "spawn", "forkserver"],
)
def test_process_count_of_the_tree_is_limited(start, monkeypatch):
    monkeypatch.setenv(sandbox.PROCESSES_ENV, "6")
    source = "import time\nif __name__ == '__main__':\n" + "".join(
        f"    {line}\n" for line in start.splitlines()
    )
    source += "    time.sleep(20)\n"
    result = sandbox.run_program(source, timeout_s=25, guard=False, os_sandbox=False)
    assert not result.passed and result.limit is not None and result.limit.startswith("processes"), result


@NEEDS_NAMESPACE
@pytest.mark.skipif(os.geteuid() == 0, reason="the kernel does not apply RLIMIT_NPROC to root's processes")
def test_os_sandbox_caps_processes_with_rlimit_nproc(monkeypatch):
    """Inside the user namespace the kernel refuses the fork past the limit (before any poll sees it)."""
    monkeypatch.setenv(sandbox.PROCESSES_ENV, "6")
    source = (
        "import os, sys, time\nmade = 0\ntry:\n    for _ in range(12):\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        made += 1\n"
        "except BlockingIOError:\n    sys.exit(0 if made < 6 else 1)\nsys.exit(1)\n"
    )
    assert sandbox.run_program(source, timeout_s=10, guard=False, os_sandbox=True).passed


@pytest.mark.parametrize("name", ["MEMORY_ENV", "PROCESSES_ENV"])
@pytest.mark.parametrize("value", ["0", "-3", "abc", "1e3", "99999999999"])
def test_limit_settings_are_validated(name, value, monkeypatch):
    monkeypatch.setenv(getattr(sandbox, name), value)
    with pytest.raises(sandbox.SandboxError, match=getattr(sandbox, name)):
        sandbox.run_program("pass", timeout_s=5)
