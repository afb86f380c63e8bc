"""What runs inside the contained interpreter before the model's program (standard library only).

The supervisor (`sandbox_supervisor.py`) sends this file's text followed by one call line to a
fresh `python -I -B -`: `_rlkv_guard()` (the guard level's audit hook), then either the program
itself or `_rlkv_run_tests(program, tests, nonce_fd, result_fd)` (the test harness).

The harness reports success by writing a nonce to `result_fd`; the nonce comes from the supervisor
through `nonce_fd`, which is read and closed before the program's first line. It is held in the
frame of a suspended generator (`_rlkv_keeper`), which writes it only when resumed by the last
line of the genuine test code object, after every test statement ran, and only if the functions
the tests defined are still the ones they defined. Exiting early (`sys.exit`, `os._exit`,
`SystemExit`, `exit()`), killing itself, printing anything or skipping the tests leaves no nonce,
so none of these pass. The guard keeps the nonce out of reach: it refuses the ways to a
suspended generator's frame (`gi_frame`, `gc`, tracing and profiling, `/proc/<pid>/mem`, ctypes).
"""

# No `from __future__` import: in a run without tests the program's text follows this file's, and
# a future import here would change how the program compiles.


def _rlkv_guard() -> None:
    """Install the guard: an audit hook refusing process creation, signals to other processes,
    sockets, ctypes, rlimit changes, frame introspection, and file changes outside the working dir.

    Audit hooks cannot be removed and run for C-level events, so rebinding `sys.audit` or module
    attributes lifts nothing; the hook reads only its default arguments. The Python-level events
    (`subprocess.Popen`, `shutil.rmtree`) can be skipped by a program that replaces `sys.audit`,
    so what they guard is also refused below them: `_posixsubprocess` (the only way `subprocess`
    and `multiprocessing`'s spawn/forkserver start processes) cannot be imported, and the `os`
    calls they reach are C-level events. `dir_fd`-relative calls: a directory outside the working
    dir cannot be opened, so every directory fd the program holds is inside it, and relative paths
    are checked against the working dir (stricter than the kernel's view, never looser).
    """
    import os
    import sys

    refused = frozenset((
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "os.kill", "os.killpg", "signal.pthread_kill", "subprocess.Popen", "pty.spawn",
        "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
        "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "resource.setrlimit",
        "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "webbrowser.open", "sys.remote_exec", "sys._current_frames", "sys._current_exceptions",
        "sys.settrace", "sys.setprofile", "sys.addaudithook", "sys.monitoring.register_callback",
        "code.__new__",
    ))  # fmt: skip
    refused_imports = frozenset(("_posixsubprocess", "_ctypes"))
    frame_attributes = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame"))
    path_events = {
        "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.chflags": 1,
        "os.utime": 1, "os.truncate": 1, "shutil.rmtree": 1, "os.rename": 2, "os.link": 2,
        "os.symlink": 2,
    }  # fmt: skip
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    root = os.path.realpath(os.getcwd())

    def resolve(path, realpath=os.path.realpath, fsdecode=os.fsdecode, readlink=os.readlink):
        try:
            if isinstance(
                path, int
            ):  # an fd: the file it is open on (fchmod on stdout would reach /dev/null)
                path = readlink(f"/proc/self/fd/{path}")
            return realpath(fsdecode(path))
        except Exception:
            return None

    def inside(full, root=root, sep=os.sep):
        return full is not None and (full == root or full.startswith(root + sep))

    def hook(
        event, args, refused=refused, refused_imports=refused_imports, frame_attributes=frame_attributes,
        path_events=path_events, write_flags=write_flags, inside=inside, resolve=resolve,
        isdir=os.path.isdir,
    ):  # fmt: skip
        if event in refused:
            raise PermissionError(f"{event} is disabled in rlkv code verification")
        if event == "import":
            if args[0] in refused_imports:
                raise PermissionError(f"importing {args[0]} is disabled in rlkv code verification")
        elif event == "object.__getattr__":
            if args[1] in frame_attributes:
                raise PermissionError(f"reading .{args[1]} is disabled in rlkv code verification")
        elif event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return  # an fd the program already holds: nothing new is reached
            full = resolve(path)
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writes and not inside(full):
                raise PermissionError(f"rlkv code verification: writing {path!r} is disabled")
            if full is not None and full.startswith("/proc/") and full.endswith("/mem"):
                raise PermissionError(f"rlkv code verification: reading {path!r} is disabled")
            if not inside(full) and (full is None or isdir(full)):
                raise PermissionError(f"rlkv code verification: opening the directory {path!r} is disabled")
        elif event in path_events:
            for path in args[: path_events[event]]:
                if not inside(resolve(path)):
                    raise PermissionError(f"rlkv code verification: {event} on {path!r} is disabled")

    sys.addaudithook(hook)


def _rlkv_keeper(nonce_fd, result_fd, tests_code, getframe, read, write, close, exit_):
    """Hold the supervisor's nonce in this suspended frame; write it once the tests' last line resumes us.

    Resumed from anywhere but the genuine test code, or with a test function replaced or deleted,
    it raises and ends, so the harness's own resume later fails too.
    """
    nonce = read(nonce_fd, 256)
    close(nonce_fd)
    defined = {}  # function name -> the code objects the tests bind to it
    for const in tests_code.co_consts:
        if hasattr(const, "co_flags") and const.co_flags & 1 and not const.co_name.startswith("<"):
            defined.setdefault(const.co_name, []).append(const)  # CO_OPTIMIZED: a function, not a class body
    yield
    caller = getframe(1)
    if caller.f_code is not tests_code:
        raise PermissionError(
            "rlkv code verification: the tests' completion can only be reported by the tests"
        )
    for name, codes in defined.items():
        if not any(getattr(caller.f_globals.get(name), "__code__", None) is code for code in codes):
            raise PermissionError(f"rlkv code verification: the test function {name!r} was replaced")
    write(result_fd, nonce)
    exit_(0)


def _rlkv_run_tests(program: str, tests: str, nonce_fd: int, result_fd: int) -> None:
    """Run `program`, then `tests` in the same namespace; on success the tests' last line reports it."""
    import os
    import signal
    import sys

    tests_code = compile(tests + "\n__rlkv_tests_done__()\n", "<tests>", "exec")
    keeper = _rlkv_keeper(
        nonce_fd, result_fd, tests_code, sys._getframe, os.read, os.write, os.close, os._exit
    )
    next(keeper)
    run, getsignal, set_signal, setitimer = exec, signal.getsignal, signal.signal, signal.setitimer
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    run(compile(program, "<program>", "exec"), namespace)
    # a handler or timer the program left could rebind the tests' names between two test lines
    for timer in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF):
        setitimer(timer, 0)
    for sig in signal.valid_signals():
        if callable(getsignal(sig)):
            set_signal(sig, signal.SIG_DFL)
    namespace["__rlkv_tests_done__"] = keeper.__next__
    run(tests_code, namespace)
    raise SystemExit(1)  # unreachable unless the tests' last line did not report (it exits 0)
