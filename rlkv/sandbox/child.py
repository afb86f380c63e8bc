"""What runs inside the program's contained interpreter before its first line (standard library only).

The supervisor (`supervisor.py`) sends this file's text, `wire.py`'s, and one call
line to a fresh `python -I -B -`: `_rlkv_guard()` (the guard level's audit hook), then either the
program itself (a run without tests) or `_rlkv_serve(program, read_fd, write_fd)`: the program runs,
then its functions answer the calls of the tests, which run in another interpreter
(`harness.py`) and reach this one only through that pipe pair, as plain data. Nothing of the
tests (their text, frames, code objects, expected values) and nothing that reports success is in
this process, so a program that walks its frames, exits early, kills itself, prints a marker or
rebinds names here changes nothing but its own answers.
"""

# No `from __future__` import: in a run without tests the program's text follows this file's, and
# a future import here would change how the program compiles.

if (
    "_RlkvChannel" not in globals()
):  # imported as a module; the contained interpreter runs the wire text first
    from rlkv.sandbox.wire import (  # noqa: F401
        _rlkv_decode,
        _rlkv_encode,
        _RlkvChannel,
        _RlkvWireError,
    )


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
    own_proc = f"/proc/{os.getpid()}"

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
        isdir=os.path.isdir, own_proc=own_proc,
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
            if (  # another process's /proc entries: the tests' interpreter, the supervisor, the caller
                full is not None
                and full.startswith("/proc/")
                and full.split("/")[2].isdigit()
                and full != own_proc
                and not full.startswith(own_proc + "/")
            ):
                raise PermissionError(
                    f"rlkv code verification: reading {path!r} of another process is disabled"
                )
            if not inside(full) and (full is None or isdir(full)):
                raise PermissionError(f"rlkv code verification: opening the directory {path!r} is disabled")
        elif event in path_events:
            for path in args[: path_events[event]]:
                if not inside(resolve(path)):
                    raise PermissionError(f"rlkv code verification: {event} on {path!r} is disabled")

    sys.addaudithook(hook)


def _rlkv_serve(program, read_fd, write_fd):
    """Run `program`, then answer the tests' requests over (`read_fd`, `write_fd`) until they end.

    Requests (`harness.py` sends them): `["names", [name, ...]]`, which of the names the
    tests read the program defines, each as `[name, "m", module name]` or `[name, "v", value]`;
    `["call", id, args, kwargs]`; `["iter", id]`, the object's items as a list. Replies: `["ok",
    value]`, `["exc", builtin type name, message]` for an exception the program raised, `["bad",
    why]` for a value that cannot cross. Values are `wire.py`'s tagged plain data; any other
    object stays here and crosses as a handle (an id into `objects`, which keeps it alive).
    Nothing here holds a secret or the tests' text: what the program does to this code only
    changes what it answers, and the tests' side decodes every answer as plain data.
    """
    import builtins

    channel = _RlkvChannel(read_fd, write_fd)
    exceptions = {
        v: k for k, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    objects, ids = {}, {}
    module_type = type(builtins)

    def handle(obj):
        if id(obj) not in ids:
            ids[id(obj)] = len(objects)
            objects[len(objects)] = obj
        return ids[id(obj)]

    def resolve(remote_id):
        if remote_id not in objects:
            raise _RlkvWireError(f"no program object {remote_id}")
        return objects[remote_id]

    def describe(value):
        if isinstance(value, module_type) and isinstance(getattr(value, "__name__", None), str):
            return ["m", value.__name__]
        return ["v", _rlkv_encode(value, handle)]

    def builtin_name(error):
        for kind in type(error).__mro__:
            if kind in exceptions:
                return exceptions[kind]
        return "BaseException"

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(program, "<program>", "exec"), namespace)
    while True:
        try:
            request = channel.receive()
        except _RlkvWireError:
            return  # the tests ended
        try:
            op = request[0]
            if op == "names":
                reply = ["names", [[n, *describe(namespace[n])] for n in request[1] if n in namespace]]
            elif op in ("call", "iter"):
                target = resolve(request[1])
                try:
                    if op == "call":
                        args = [_rlkv_decode(a, resolve) for a in request[2]]
                        kwargs = {k: _rlkv_decode(v, resolve) for k, v in request[3]}
                        result = target(*args, **kwargs)
                    else:
                        result = list(target)
                except BaseException as error:  # SystemExit included: the tests' side decides
                    try:
                        text = str(error)[:2000]
                    except BaseException:
                        text = ""
                    reply = ["exc", builtin_name(error), text]
                else:
                    reply = ["ok", _rlkv_encode(result, handle)]
            else:
                raise _RlkvWireError(f"unknown request {op!r}")
        except (_RlkvWireError, RecursionError, LookupError, TypeError, ValueError) as e:
            reply = ["bad", f"{type(e).__name__}: {e}"[:2000]]
        channel.send(reply)
