"""Child processes and ports on this machine: what `splitserve up` and the bench experiments
both need when they start processes of their own.
"""

from __future__ import annotations

import ctypes
import signal
import socket

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For Popen's preexec_fn: the child gets SIGTERM when its parent dies, even by SIGKILL."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the loopback interface by default); another process may
    take it before the caller binds it."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
