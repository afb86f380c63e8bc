"""Containment of model-generated code: the guard, the process-tree kill, the OS sandbox, temp-dir cleanup."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rlkv.data import sandbox
from rlkv.data.verify import run_python_tests

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
    # writing inside the program's own working directory stays allowed
    assert run_python_tests("open('scratch.txt', 'w').write('x')", "assert open('scratch.txt').read() == 'x'")


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
        f"import sys; sys.path.insert(0, {os.path.dirname(sandbox.__file__)!r})\n"
        "from sandbox import run_program\n"
        "run_program('import time\\ntime.sleep(324.5)', timeout_s=60, guard=False)\n"
    )
    caller = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (_alive_with_marker("324.5") and list(tmp_path.iterdir())):
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
    with caplog.at_level("INFO", logger="rlkv.data.sandbox"):
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
