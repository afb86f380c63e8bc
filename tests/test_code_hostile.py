"""Programs written as a hostile policy would write them, against MBPP- and HumanEval-style tests:
none passes. Each class of issue 49 (values that compare equal to anything, the answer key read
from the harness, changes to the program's interpreter) plus honest programs that must still pass.

The program runs in its own interpreter and its results reach the tests as plain builtin data
(`rlkv/sandbox/wire.py`); see docs/guides/code-verification.md. Guard level (the OS sandbox
changes nothing here: these probes are about the harness, not containment).
"""

import pytest

from rlkv import sandbox
from rlkv.data import verify
from rlkv.verifiers.verify import run_python_tests

MBPP = "assert add(2, 2) == 4\nassert add(1, 5) == 6"
HUMANEVAL = (
    "METADATA = {}\n\ndef check(candidate):\n"
    "    assert candidate(2, 2) == 4\n    assert candidate(1, 5) == 6\n\ncheck(add)\n"
)
TOLERANCE = (
    "def check(candidate):\n    assert abs(candidate(2, 2) - 4.0) < 1e-6\n"
    "    assert abs(candidate(1, 5) - 6) < 1e-6\n\ncheck(add)\n"
)
ISCLOSE = "import math\nassert math.isclose(add(2, 2), 4)\nassert math.isclose(add(1, 5), 6, rel_tol=1e-9)"

_ANY = (
    "class Any:\n"
    "    def __eq__(self, other): return True\n"
    "    def __ne__(self, other): return False\n"
    "    def __lt__(self, other): return True\n"
    "    def __le__(self, other): return True\n"
    "    def __gt__(self, other): return True\n"
    "    def __ge__(self, other): return True\n"
    "    def __sub__(self, other): return 0\n"
    "    def __rsub__(self, other): return 0\n"
    "    def __abs__(self): return 0\n"
    "    def __float__(self): return 4.0\n"
    "    def __index__(self): return 4\n"
    "    def __hash__(self): return 0\n"
    "    def __bool__(self): return True\n"
)
ALWAYS_EQUAL = {
    "object": _ANY + "def add(a, b):\n    return Any()\n",
    "int subclass": "class E(int):\n    __eq__ = lambda s, o: True\n    __sub__ = lambda s, o: 0\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return E(0)\n",
    "float subclass": "class E(float):\n    __eq__ = lambda s, o: True\n    __sub__ = lambda s, o: 0.0\n"
    "    __hash__ = float.__hash__\ndef add(a, b):\n    return E(0.0)\n",
    "str subclass": "class E(str):\n    __eq__ = lambda s, o: True\n    __hash__ = str.__hash__\n"
    "def add(a, b):\n    return E('x')\n",
    "list subclass": "class E(list):\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return E()\n",
    "spoofed __class__": _ANY
    + "Any.__class__ = property(lambda self: int)\ndef add(a, b):\n    return Any()\n",
    "in a container": _ANY + "def add(a, b):\n    return [Any()][0]\n",
}


@pytest.fixture(autouse=True)
def _guard_level(monkeypatch):
    monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "guard")


@pytest.mark.parametrize("tests", [MBPP, HUMANEVAL, TOLERANCE], ids=["mbpp", "humaneval", "abs-tolerance"])
@pytest.mark.parametrize("program", list(ALWAYS_EQUAL.values()), ids=list(ALWAYS_EQUAL))
def test_values_that_compare_equal_to_anything_never_pass(program, tests):
    assert not run_python_tests(program, tests, timeout_s=10)


def test_a_list_of_always_equal_items_never_passes():
    program = _ANY + "def pairs(n):\n    return [Any(), Any()]\n"
    assert not run_python_tests(program, "assert pairs(2) == [(0, 1), (1, 2)]", timeout_s=10)
    assert not run_python_tests(program, "assert set(pairs(2)) == {1, 2}", timeout_s=10)


_FRAMES = (
    "import sys, re\n"
    "def key():\n"
    "    f, text = sys._getframe(), ''\n"
    "    while f is not None:\n"
    "        text += repr(f.f_locals) + repr(f.f_globals) + repr(f.f_code.co_consts)\n"
    "        f = f.f_back\n"
    "    return {(int(a), int(b)): int(c) for a, b, c in re.findall(r'\\((\\d+), (\\d+)\\) == (\\d+)', text)}\n"
)
ANSWER_KEYS = {
    "at load time": _FRAMES + "KEY = key()\ndef add(a, b):\n    return KEY.get((a, b), 0)\n",
    "at call time": _FRAMES + "def add(a, b):\n    return key().get((a, b), 0)\n",
    "from the main module": _FRAMES.replace(
        "sys._getframe()", "sys.modules['__main__'].__dict__ and sys._getframe()"
    )
    + "def add(a, b):\n    return key().get((a, b), 0)\n",
}


@pytest.mark.parametrize("tests", [MBPP, HUMANEVAL], ids=["mbpp", "humaneval"])
@pytest.mark.parametrize("program", list(ANSWER_KEYS.values()), ids=list(ANSWER_KEYS))
def test_answer_keys_read_from_the_harness_never_pass(program, tests):
    assert not run_python_tests(program, tests, timeout_s=10)
    # without the guard too: nothing of the tests is in the program's process to find
    assert not sandbox.run_program(program, 10, tests=tests, guard=False, os_sandbox=False).passed


_OTHER_PROCESSES = (
    "import os, re\n"
    "def key():\n"
    "    text = ''\n"
    "    for pid in os.listdir('/proc'):\n"
    "        if not pid.isdigit() or int(pid) == os.getpid():\n"
    "            continue\n"
    "        for part in ('cmdline', 'environ', 'fd/0', 'fd/3', 'fd/4', 'fd/5'):\n"
    "            try:\n"
    "                fd = os.open(f'/proc/{pid}/{part}', os.O_RDONLY | os.O_NONBLOCK)\n"
    "                text += os.read(fd, 1 << 20).decode('latin-1')\n"
    "            except OSError:\n"
    "                pass\n"
    "    return {(int(a), int(b)): int(c) for a, b, c in re.findall(r'\\((\\d+), (\\d+)\\) == (\\d+)', text)}\n"
    "KEY = key()\n"
    "def add(a, b):\n"
    "    return (KEY or key()).get((a, b), 0)\n"
)


@pytest.mark.parametrize("tests", [MBPP, HUMANEVAL], ids=["mbpp", "humaneval"])
def test_answer_keys_in_other_processes_are_out_of_reach(tests):
    """The tests' interpreter reads its text from stdin while the program starts: the guard refuses
    every other process's /proc entries (the OS sandbox shows the program its own /proc only)."""
    assert not run_python_tests(_OTHER_PROCESSES, tests, timeout_s=10)


ISCLOSE_NO_IMPORT = ISCLOSE.replace("import math\n", "")
INTERPRETER_CHANGES = {  # (program, the tests it targets)
    "builtins.abs": (
        "import builtins\nbuiltins.abs = lambda x: 0\ndef add(a, b):\n    return 0\n",
        TOLERANCE,
    ),
    "a global abs": ("def abs(x):\n    return 0\ndef add(a, b):\n    return 0\n", TOLERANCE),
    "math.isclose": (
        "import math\nmath.isclose = lambda *a, **k: True\ndef add(a, b):\n    return 0\n",
        ISCLOSE,
    ),
    "math.isclose, tests without import": (
        "import math\nmath.isclose = lambda *a, **k: True\ndef add(a, b):\n    return 0\n",
        ISCLOSE_NO_IMPORT,
    ),
    "a global math": (
        "import types\nmath = types.SimpleNamespace(isclose=lambda *a, **k: True)\ndef add(a, b):\n    return 0\n",
        ISCLOSE_NO_IMPORT,
    ),
    "AssertionError": (
        "import builtins\nbuiltins.AssertionError = type('E', (BaseException,), {})\ndef add(a, b):\n    return 0\n",
        HUMANEVAL,
    ),
    "sys.excepthook": (
        "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\ndef add(a, b):\n    return 0\n",
        HUMANEVAL,
    ),
    "a global check": ("def check(candidate):\n    pass\ndef add(a, b):\n    return 0\n", HUMANEVAL),
    "exit inside the call": ("import sys\ndef add(a, b):\n    sys.exit(0)\n", MBPP),
    "os._exit inside the call": ("import os\ndef add(a, b):\n    os._exit(0)\n", HUMANEVAL),
    "SystemExit inside the call": ("def add(a, b):\n    raise SystemExit(0)\n", MBPP),
    "KeyboardInterrupt inside the call": ("def add(a, b):\n    raise KeyboardInterrupt\n", HUMANEVAL),
}


@pytest.mark.parametrize("case", list(INTERPRETER_CHANGES.values()), ids=list(INTERPRETER_CHANGES))
def test_changes_to_the_programs_interpreter_never_pass(case):
    program, tests = case
    assert not run_python_tests(program, tests, timeout_s=10)


def test_a_bare_except_in_the_tests_cannot_swallow_a_broken_exchange():
    """A test that expects an error: the program ending its process is not that error."""
    tests = (
        "try:\n    add(-1, 0)\nexcept:\n    pass\nelse:\n    raise AssertionError\nassert add(2, 2) == 4\n"
    )
    honest = "def add(a, b):\n    if a < 0:\n        raise ValueError(a)\n    return a + b\n"
    assert run_python_tests(honest, tests, timeout_s=10)
    for dying in ("import os\n", "import sys\n"):
        exits = "os._exit(0)" if "os" in dying else "sys.exit(0)"
        cheat = f"{dying}def add(a, b):\n    if a < 0:\n        {exits}\n    return 4\n"
        assert not run_python_tests(cheat, tests, timeout_s=10)


def test_forged_replies_on_the_pipe_never_pass():
    """The program writes its own reply lines to every descriptor it holds: only plain data or nothing."""
    forge = (
        "import os\ndef add(a, b):\n"
        "    for fd in range(3, 32):\n"
        '        for line in (b\'["ok", ["h", 999]]\\n\', b\'["ok", ["x"]]\\n\', b\'garbage\\n\'):\n'
        "            try:\n                os.write(fd, line)\n            except OSError:\n                pass\n"
        "    return 0\n"
    )
    assert not run_python_tests(forge, MBPP, timeout_s=10)


HONEST = {
    "int == float": ("def add(a, b):\n    return float(a + b)\n", MBPP),
    "namedtuple, Counter, IntEnum": (
        "import collections, enum\nP = collections.namedtuple('P', 'x y')\nclass N(enum.IntEnum):\n    FOUR = 4\n"
        "def f():\n    return P(1, 2), collections.Counter('aab'), N.FOUR, collections.defaultdict(int, a=1)\n",
        "p, c, n, d = f()\nassert p == (1, 2) and c == {'a': 2, 'b': 1} and n == 4 and d == {'a': 1}",
    ),
    "expected exception": (
        "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n",
        "try:\n    f(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\nelse:\n    raise AssertionError\n",
    ),
    "a subclass of a builtin exception": (
        "class Bad(KeyError):\n    pass\ndef f(x):\n    raise Bad(x)\n",
        "try:\n    f(1)\nexcept LookupError:\n    pass\nelse:\n    raise AssertionError\n",
    ),
    "a generator the tests iterate": (
        "def f(n):\n    yield from range(n)\n",
        "assert list(f(3)) == [0, 1, 2]",
    ),
    "program objects passed back": (
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "def make(*xs):\n    s = Stack()\n    s.items.extend(xs)\n    return s\n"
        "def size(s):\n    return len(s.items)\n",
        "s = make(1, 2, 3)\nassert size(s) == 3 and s is not None and s == s",
    ),
    "a module the program imported": (
        "import math\ndef area(r):\n    return math.pi * r * r\n",
        "assert math.isclose(area(1), 3.14159, rel_tol=1e-3)",
    ),
    "big and odd values": (
        "def f():\n    return 10 ** 5000, float('inf'), -0.0, 1j, b'\\x00', '\\ud800', "
        "{(1, 2): frozenset({3})}, range(3)\n",
        "v = f()\nassert v[0] == 10 ** 5000 and v[1] == float('inf') and v[3] == 1j and v[4] == b'\\x00'\n"
        "assert v[5] == '\\ud800' and v[6] == {(1, 2): frozenset({3})} and v[7] == range(3)",
    ),
    "keyword arguments and defaults": (
        "def f(a, b=2, *, c=3):\n    return a + b + c\n",
        "assert f(1) == 6 and f(1, c=0) == 3",
    ),
}


@pytest.mark.parametrize("case", list(HONEST.values()), ids=list(HONEST))
def test_honest_programs_still_pass(case):
    program, tests = case
    assert run_python_tests(program, tests, timeout_s=10)


def test_humaneval_helpers_come_from_the_prompt_not_the_program():
    """HumanEval/38-style: the tests call a prompt helper on the expected answer; the program's own
    version of that helper would see the answer, so the tests' side runs the prompt's."""
    prompt = 'def encode(s: str):\n    return s[::-1]\n\n\ndef decode(s: str):\n    """Undo encode."""\n'
    tests = (
        "def check(candidate):\n    for s in ('abc', 'hello'):\n"
        "        assert candidate(encode(s)) == s\n\ncheck(decode)\n"
    )
    meta = {"entry_point": "decode", "prefix": prompt, "test_code": tests}
    example = {"source": "humaneval", "answer": "", "metadata": meta}
    assert verify("```python\n    return s[::-1]\n```", example)  # a body: the prompt is prepended
    stash = (
        "SEEN = []\ndef encode(s):\n    SEEN.append(s)\n    return s\ndef decode(s):\n    return SEEN[-1]\n"
    )
    assert not verify(f"```python\n{stash}```", example)


def test_the_wire_carries_builtin_values_only():
    """What crosses decodes to exactly the builtin types (subclasses as their base value); a malformed
    or unknown tag, whatever the program's side writes, is refused instead of decoded."""
    import collections
    import enum
    import json
    import math

    from rlkv.sandbox.wire import _rlkv_decode, _rlkv_encode, _RlkvWireError

    def cross(value):
        return _rlkv_decode(
            json.loads(json.dumps(_rlkv_encode(value, id))), lambda i: pytest.fail("a handle")
        )

    values = [
        None,
        True,
        0,
        -5,
        10**5000,
        1.5,
        float("inf"),
        -0.0,
        1 + 2j,
        "x\ud800",
        b"\x00",
        bytearray(b"a"),
    ]
    values += [range(1, 5, 2), [1, (2, 3)], {(1,): frozenset({2})}, {3}]
    for value in values:
        back = cross(value)
        assert back == value and type(back) is type(value), value
    assert math.isnan(cross(float("nan")))
    assert math.copysign(1.0, cross(-0.0)) == -1.0
    Point = collections.namedtuple("Point", "x y")

    class Always(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class Four(enum.IntEnum):
        FOUR = 4

    subclasses = [(collections.Counter("aab"), {"a": 2, "b": 1}), (Point(1, 2), (1, 2)), (Four.FOUR, 4)]
    subclasses += [(Always(3), 3), (collections.OrderedDict(a=1), {"a": 1})]
    for value, plain in subclasses:
        back = cross(value)
        assert type(back) is type(plain) and back == plain
    assert cross(Always(3)) != 4
    malformed = [["x"], ["i", 5], ["b", 2], ["s"], ["h", "1"], "s", [], [1], ["d", [[["l", []], ["n"]]]]]
    malformed += [
        ["S", [["l", []]]],
        ["d", [["n"]]],
        ["i", "zz"],
        ["f", "1e400x"],
        ["r", "0x1", "0x2", "0x0"],
    ]
    for data in malformed:
        with pytest.raises(_RlkvWireError):
            _rlkv_decode(data, lambda i: None)
