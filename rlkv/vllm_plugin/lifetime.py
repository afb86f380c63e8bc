"""vLLM's engine processes die with the rlkv command that started them (`kill -9` included).

vLLM runs its engine core and workers in child processes and has no parent-death watch: when the
process that started them is killed with SIGKILL, they keep running (and keep their memory: host
memory on CPU, device memory on a GPU, where the rerun may then fail to start). An rlkv command that
starts vLLM sets `EXIT_WITH_PARENT_ENV` to its own pid (`exit_with_parent_env`); the plugin, which vLLM
loads in each of its processes, then asks Linux to SIGKILL every process below that one when its
parent dies (`prctl(PR_SET_PDEATHSIG)`): directly in processes vLLM spawns (they load the plugin
anew), and through an at-fork hook in processes it forks (which inherit the loaded plugin). A chain of
parents dies link by link. A vLLM engine started from a user's own Python (no variable) is left as
vLLM makes it. Linux only; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

EXIT_WITH_PARENT_ENV = "RLKV_EXIT_WITH_PARENT"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_hooked = False


def exit_with_parent_env() -> dict[str, str]:
    """The environment entry that makes vLLM's processes below this one exit when their parent dies."""
    return {EXIT_WITH_PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a process below the rlkv command: SIGKILL this process when its parent exits."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # a sandbox refusing prctl: the process lives as vLLM made it
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def install() -> None:
    """Tie this process and the ones it forks to their parents when an rlkv command asked for it."""
    global _hooked
    owner = os.environ.get(EXIT_WITH_PARENT_ENV)
    if not owner or _hooked:
        return
    _hooked = True
    if str(os.getpid()) != owner:
        die_with_parent()
    os.register_at_fork(after_in_child=die_with_parent)
