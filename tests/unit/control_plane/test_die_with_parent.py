"""Children started with `die_with_parent` (instances under `splitserve up`, the clusters and the
vLLM server of `splitserve bench`) end when their parent is killed, even by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PARENT = """
import subprocess, sys, time
from common.process import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, waiting for its reaper
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_child_ends_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    assert _alive(child_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)


def test_an_instance_that_exits_during_start_up_is_named():
    from control_plane.launcher import InstanceProcess, _exited_instance

    running = InstanceProcess("prefill", subprocess.Popen([sys.executable, "-c",
                                                           "import time; time.sleep(30)"]))
    crashed = InstanceProcess("decode", subprocess.Popen([sys.executable, "-c",
                                                          "raise SystemExit(3)"]))
    try:
        crashed.process.wait(30)
        message = _exited_instance([running, crashed], None)
        assert message is not None and "decode instance exited" in message
        assert "status 3" in message
        assert _exited_instance([running], None) is None
    finally:
        running.process.kill()
        running.process.wait()
