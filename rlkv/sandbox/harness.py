"""The tests' interpreter: runs the test code against the program, which lives in another process.

The supervisor (`supervisor.py`) sends `child.py`'s guard, `wire.py`, this
file and one call line to a fresh `python -I -B -`; no line of the program ever runs here. The
program's interpreter (`child.py`'s `_rlkv_serve`) holds no frame, code object or string
of the tests: what the tests need from it (the names they read that the program defines) arrives
here as proxies, and every call sends plain-data arguments over a pipe and gets back plain data
(`wire.py`), an opaque handle, or the builtin type and message of the exception the
program raised. So the tests compare builtin values only, and nothing the program changes in its
interpreter changes how they run.

Anything that breaks the exchange (the program's process ended or wrote something that is not
plain data, a `SystemExit` raised by the program) ends this interpreter at once without success,
so a bare `except:` in the tests cannot swallow it. Success is reported by writing the nonce from
the supervisor to `result_fd` after the tests' last line; the program has neither descriptor.
"""

# No `from __future__` import: this text follows the guard's, which the program's run also starts with.

if (
    "_RlkvChannel" not in globals()
):  # imported as a module; the contained interpreter runs the wire text first
    from rlkv.sandbox.wire import (  # noqa: F401
        _rlkv_decode,
        _rlkv_encode,
        _RlkvChannel,
        _RlkvWireError,
    )


class _RlkvRemote:
    """Stands for an object of the program: callable (a call runs in the program's process) and
    iterable (its items cross as plain data); equal to itself only."""

    def __init__(self, remote_id, name, call, items):
        self._rlkv_id, self.__name__, self._rlkv_call, self._rlkv_items = remote_id, name, call, items

    def __call__(self, *args, **kwargs):
        return self._rlkv_call(self._rlkv_id, args, kwargs)

    def __iter__(self):
        return iter(self._rlkv_items(self._rlkv_id))

    def __repr__(self):
        return f"<program object {self.__name__}>"


def _rlkv_test_names(code, found=None):
    """Every name the code object and the functions it defines read (globals and attributes alike)."""
    found = set() if found is None else found
    found.update(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            _rlkv_test_names(const, found)
    return found


def _rlkv_run_tests(tests, setup, entry_point, read_fd, write_fd, nonce_fd, result_fd):
    """Run `tests` against the program served on (`read_fd`, `write_fd`); write the nonce on success.

    setup: trusted code run first in the tests' namespace (HumanEval's prompt): its names (the
    helpers the tests call, `poly`, `encode_cyclic`) stay its own, and only `entry_point` and names
    it does not define come from the program. A name of a builtin comes from the program only when
    it is the entry point, so a program defining `abs` cannot change `abs(candidate(x) - y) < tol`.
    """
    import builtins
    import importlib
    import os
    import sys

    nonce = os.read(nonce_fd, 256)
    os.close(nonce_fd)
    channel = _RlkvChannel(read_fd, write_fd)
    proxies = {}

    def fail(why):
        os._exit(3)  # no exception: nothing in the tests can catch this

    def proxy(remote_id, name="object"):
        if remote_id not in proxies:
            proxies[remote_id] = _RlkvRemote(remote_id, name, call, items)
        return proxies[remote_id]

    def own_id(obj):
        if type(obj) is _RlkvRemote:
            return obj._rlkv_id
        raise _RlkvWireError(
            f"the tests pass a {type(obj).__name__}: only plain data and program objects cross"
        )

    def answer(message):
        try:
            reply = channel.receive()
        except _RlkvWireError as e:
            fail(e)
        if type(reply) is list and len(reply) == 2 and reply[0] == "ok":
            try:
                return _rlkv_decode(reply[1], proxy)
            except _RlkvWireError as e:
                fail(e)
        if (
            type(reply) is list
            and len(reply) == 3
            and reply[0] == "exc"
            and type(reply[1]) is type(reply[2]) is str
        ):
            kind = getattr(builtins, reply[1], None)
            if isinstance(kind, type) and issubclass(kind, Exception):
                try:
                    error = kind(reply[2])
                except Exception:  # a builtin type that takes other arguments (UnicodeDecodeError)
                    error = Exception(reply[2])
                raise error
        fail(reply)  # SystemExit and the like, a malformed reply, or a value that could not cross

    def call(remote_id, args, kwargs):
        try:
            message = ["call", remote_id, [_rlkv_encode(a, own_id) for a in args]]
            message.append([[k, _rlkv_encode(v, own_id)] for k, v in kwargs.items()])
            channel.send(message)
        except (_RlkvWireError, OSError) as e:
            fail(e)
        return answer(message)

    def items(remote_id):
        try:
            channel.send(["iter", remote_id])
        except OSError as e:
            fail(e)
        return answer(None)

    tests_code = compile(tests, "<tests>", "exec")
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:  # a prompt that is only a signature (`def f(x):`) does not compile alone: then there is no setup
        setup_code = compile(setup, "<setup>", "exec") if setup else None
    except SyntaxError:
        setup_code = None
    if setup_code is not None:
        exec(setup_code, namespace)
    own = set(namespace) | set(dir(builtins))
    wanted = sorted(
        n
        for n in _rlkv_test_names(tests_code)
        if n.isidentifier() and not n.startswith("__") and (n == entry_point or n not in own)
    )
    try:
        channel.send(["names", wanted])
        reply = channel.receive()
        if type(reply) is not list or len(reply) != 2 or reply[0] != "names" or type(reply[1]) is not list:
            raise _RlkvWireError("not a names reply")
        for entry in reply[1]:
            if type(entry) is not list or len(entry) != 3 or entry[0] not in wanted:
                raise _RlkvWireError("a name the tests did not ask for")
            name, kind, value = entry
            if kind == "m" and type(value) is str:  # a module the program imported: the tests import it too
                top = value.split(".")[0]
                if top in sys.stdlib_module_names and not top.startswith("_"):
                    try:
                        namespace[name] = importlib.import_module(value)
                    except ImportError:
                        pass
            elif kind == "v":
                value = _rlkv_decode(value, lambda i, name=name: proxy(i, name))
                namespace[name] = value
            else:
                raise _RlkvWireError(f"unknown kind {kind!r}")
    except (_RlkvWireError, OSError) as e:
        fail(e)
    exec(tests_code, namespace)
    os.write(result_fd, nonce)
    os._exit(0)
