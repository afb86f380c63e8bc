"""Plain data across the boundary between the program's interpreter and the tests' (standard library only).

Both contained interpreters get this file's text ahead of their harness (`child.py` for the
program, `harness.py` for the tests). A value crosses as one line of tagged JSON: None, bool,
int, float, complex, str, bytes, bytearray, range, and list, tuple, dict, set, frozenset of these.
Anything else the program hands over crosses as an opaque handle (`["h", id]`) that the tests can
only pass back or iterate. The decoder builds builtin objects of exactly these types from the tags
and refuses anything else, so whatever bytes the program's side writes, the tests only ever compare
builtin values (`2 == 2.0` still holds; no `__eq__` of the program runs).
"""

# No `from __future__` import: in a run without tests the program's text follows this file's.

_RLKV_MAX_DEPTH = 100  # nesting deeper than this does not cross (a list that holds itself, ...)
_RLKV_MAX_LINE = 64 << 20  # bytes in one message


class _RlkvWireError(Exception):
    """A value that cannot cross, or a message that is not valid tagged plain data."""


def _rlkv_encode(obj, handle, depth=0):
    """`obj` as tagged JSON-ready lists; `handle(obj)` gives the id of anything that is not plain data.

    Subclasses of the plain types cross as their base type's value (a namedtuple as a tuple, a
    Counter as a dict, an IntEnum as an int): what crosses is a value, never the subclass.
    """
    if depth > _RLKV_MAX_DEPTH:
        raise _RlkvWireError(f"nested deeper than {_RLKV_MAX_DEPTH} levels")
    enc = _rlkv_encode
    if obj is None:
        return ["n"]
    if obj is True or obj is False:
        return ["b", int(obj)]
    if isinstance(obj, int):
        return ["i", hex(int.__int__(obj))]
    if isinstance(obj, float):
        return ["f", float.hex(float.__float__(obj))]
    if isinstance(obj, complex):
        return ["c", float.hex(complex.real.__get__(obj)), float.hex(complex.imag.__get__(obj))]
    if isinstance(obj, str):
        return ["s", str.__str__(obj)]
    if isinstance(obj, bytes):
        return ["y", bytes.hex(obj)]
    if isinstance(obj, bytearray):
        return ["Y", bytearray.hex(obj)]
    if type(obj) is range:
        return ["r", hex(obj.start), hex(obj.stop), hex(obj.step)]
    for kind, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
        if isinstance(obj, kind):
            return [tag, [enc(x, handle, depth + 1) for x in kind.__iter__(obj)]]
    if isinstance(obj, dict):
        return ["d", [[enc(k, handle, depth + 1), enc(v, handle, depth + 1)] for k, v in dict.items(obj)]]
    return ["h", handle(obj)]


def _rlkv_decode(data, resolve, depth=0):
    """The builtin value tagged `data` describes; `resolve(id)` gives the object behind a handle.

    Raises `_RlkvWireError` for anything but well-formed tags of the plain types (an unhashable
    dict key or set element included).
    """
    if depth > _RLKV_MAX_DEPTH + 1:
        raise _RlkvWireError(f"nested deeper than {_RLKV_MAX_DEPTH} levels")
    dec = _rlkv_decode
    try:
        if type(data) is not list or not data or type(data[0]) is not str:
            raise _RlkvWireError("not a tagged value")
        tag, args = data[0], data[1:]
        if tag == "n" and not args:
            return None
        if tag == "b" and args in ([0], [1]):
            return args[0] == 1
        if tag == "i" and len(args) == 1 and type(args[0]) is str:
            return int(args[0], 16)
        if tag == "f" and len(args) == 1 and type(args[0]) is str:
            return float.fromhex(args[0])
        if tag == "c" and len(args) == 2 and all(type(a) is str for a in args):
            return complex(float.fromhex(args[0]), float.fromhex(args[1]))
        if tag == "s" and len(args) == 1 and type(args[0]) is str:
            return args[0]
        if tag in ("y", "Y") and len(args) == 1 and type(args[0]) is str:
            return (bytes if tag == "y" else bytearray).fromhex(args[0])
        if tag == "r" and len(args) == 3 and all(type(a) is str for a in args):
            return range(*(int(a, 16) for a in args))
        if tag in ("l", "t", "S", "F") and len(args) == 1 and type(args[0]) is list:
            kind = {"l": list, "t": tuple, "S": set, "F": frozenset}[tag]
            return kind(dec(x, resolve, depth + 1) for x in args[0])
        if tag == "d" and len(args) == 1 and type(args[0]) is list:
            pairs = args[0]
            if not all(type(p) is list and len(p) == 2 for p in pairs):
                raise _RlkvWireError("a dict is a list of [key, value] pairs")
            return {dec(k, resolve, depth + 1): dec(v, resolve, depth + 1) for k, v in pairs}
        if tag == "h" and len(args) == 1 and type(args[0]) is int:
            return resolve(args[0])
    except (ValueError, TypeError, OverflowError, RecursionError) as e:  # bad hex, unhashable key, ...
        raise _RlkvWireError(f"malformed {data[0] if data else 'value'!r}: {type(e).__name__}") from None
    raise _RlkvWireError(f"unknown or malformed tag {tag!r}")


class _RlkvChannel:
    """Newline-delimited JSON messages over a pair of pipe file descriptors."""

    def __init__(self, read_fd, write_fd):
        import json
        import os

        self.read_fd, self.write_fd, self.buffer = read_fd, write_fd, b""
        self.dumps, self.loads, self.read, self.write = json.dumps, json.loads, os.read, os.write

    def send(self, message):
        data = (self.dumps(message) + "\n").encode("ascii")  # ensure_ascii: one line, no raw newline
        view = memoryview(data)
        while view:
            view = view[self.write(self.write_fd, view) :]

    def receive(self):
        """The next message; `_RlkvWireError` at the end of the stream or for a line that is not JSON."""
        parts, size = [self.buffer], len(self.buffer)
        while b"\n" not in parts[-1]:  # only the newest chunk is searched: linear in the message
            if size > _RLKV_MAX_LINE:
                raise _RlkvWireError(f"a message over {_RLKV_MAX_LINE} bytes")
            chunk = self.read(self.read_fd, 1 << 20)
            if not chunk:
                raise _RlkvWireError("the other side closed the channel")
            parts.append(chunk)
            size += len(chunk)
        line, _, self.buffer = b"".join(parts).partition(b"\n")
        try:
            return self.loads(line)
        except (ValueError, RecursionError):
            raise _RlkvWireError("a message that is not JSON") from None
