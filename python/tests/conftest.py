"""Real processes for the package's tests: a lighthouse on 127.0.0.1:0 and one replica_agent
per group, from $LK_BIN_DIR (build/bin), in a fresh temporary directory per test. Trainers are
Python processes (``python/tests/trainers.py``) started with Debian's interpreter. Every wait is
bounded so that a hang fails the test instead of stalling CI."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BIN_DIR = Path(os.environ.get("LK_BIN_DIR", HERE.parents[1] / "build" / "bin"))
PYTHON = "/usr/bin/python3"


def wait_for(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _look_at_thread(pid, tid):
    """(state letter, system call number or None, switches so far) of a thread, from /proc;
    None when it is gone."""
    d = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{d}/status") as f:
            status = f.read()
        with open(f"{d}/syscall") as f:
            call = f.read().split()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    state = fields.get("State", "?").strip()[:1]
    switches = sum(int(fields.get(k, "0")) for k in ("voluntary_ctxt_switches",
                                                      "nonvoluntary_ctxt_switches"))
    nr = int(call[0]) if call and call[0].lstrip("-").isdigit() and int(call[0]) >= 0 else None
    return state, nr, switches


def thread_asleep(pid, tid=None, settle_s=0.02):
    """Whether thread ``tid`` (default: the main thread) of process ``pid`` is asleep in a
    system call and stays there, never switched in, for ``settle_s``: it waits on something
    that has not come (a peer, a key), not on a mutex taken in passing. The Python twin of
    tests/support/thread_state.h, for ordering a test's next event after a process blocked."""
    tid = pid if tid is None else tid

    def asleep(look):
        return look is not None and look[0] in ("S", "D") and look[1] is not None

    before = _look_at_thread(pid, tid)
    if not asleep(before):
        return False
    time.sleep(settle_s)
    after = _look_at_thread(pid, tid)
    return asleep(after) and after[1:] == before[1:]


class Proc:
    """A child process with its stderr in a log file and its stdout in a file beside it.

    The two stay apart because a trainer prints one JSON line per event on stdout while the
    C++ library it loads logs on stderr from other threads: in one shared file a log line can
    land between an event's text and its newline (it did in CI), and the event no longer parses.
    """

    def __init__(self, argv, log_path, env=None):
        self.log_path = Path(log_path)
        self.out_path = self.log_path.with_suffix(".out")
        self._log = open(self.log_path, "ab")
        self._out = open(self.out_path, "ab")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.popen = subprocess.Popen(argv, stdout=self._out, stderr=self._log,
                                      env=full_env, start_new_session=True)

    def out(self) -> str:
        """What the process printed on stdout (a trainer's JSON events)."""
        return self.out_path.read_text(errors="replace")

    def log(self) -> str:
        """Everything the process printed: its stderr log, then its stdout."""
        return self.log_path.read_text(errors="replace") + self.out()

    def wait_log(self, pattern, timeout_s=20, count=1):
        rx = re.compile(pattern)

        def found():
            hits = [m for m in rx.finditer(self.log())]
            return hits[count - 1] if len(hits) >= count else None

        return wait_for(found, timeout_s, f"/{pattern}/ in {self.log_path.name}:\n"
                        + self.log()[-3000:])

    def signal(self, sig):
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout_s):
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.log_path.name} still running after {timeout_s}s:\n"
                                 + self.log()[-3000:])

    def running(self):
        return self.popen.poll() is None

    def stop(self):
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)
        self._log.close()
        self._out.close()


class Cluster:
    """A lighthouse and the groups' agents of one test."""

    def __init__(self, tmp: Path, lighthouse_flags=()):
        self.dir = tmp
        self.procs = []
        self.sockets = {}
        self.live_dirs = {}
        self.agents = {}
        self.lighthouse = self._spawn(
            [str(BIN_DIR / "lighthouse"), "--bind", "127.0.0.1:0", "--data-dir",
             str(tmp / "lh"), *lighthouse_flags], tmp / "lighthouse.log")
        m = self.lighthouse.wait_log(r"listening address=(\S+)")
        self.url = "http://" + m.group(1)

    def _spawn(self, argv, log, env=None):
        p = Proc(argv, log, env)
        self.procs.append(p)
        return p

    def agent(self, group, extra=()):
        sock = str(self.dir / f"{group}-{len(self.procs)}.sock")
        live = self.dir / f"live-{group}"
        a = self._spawn([str(BIN_DIR / "replica_agent"), "--lighthouse", self.url, "--job",
                         "py", "--group-id", group, "--socket", sock, "--serve", "127.0.0.1:0",
                         "--heartbeat-interval-ms", "100", "--serve-dir", str(live), *extra],
                        self.dir / f"agent-{group}-{len(self.procs)}.log")
        a.wait_log("agent_listening")
        self.sockets[group] = sock
        self.live_dirs[group] = str(live)
        self.agents[group] = a
        return a

    def trainer(self, group, script_args, name=None, env=None):
        """A Python trainer process running ``trainers.py`` with ``script_args``."""
        name = name or f"trainer-{group}-{len(self.procs)}"
        full_env = {"LK_AGENT_SOCKET": self.sockets[group], "LK_GROUP_ID": group,
                    "LK_LIVE_DIR": self.live_dirs[group],
                    "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        full_env.update(env or {})
        return self._spawn([PYTHON, str(HERE / "trainers.py"), *script_args],
                           self.dir / f"{name}.log", full_env)

    def close(self):
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture
def tmp_dir():
    with tempfile.TemporaryDirectory(prefix="lk-py-") as d:
        yield Path(d)


@pytest.fixture
def cluster_factory(tmp_dir):
    made = []

    def make(lighthouse_flags=("--min-replicas", "1", "--join-timeout-ms", "300",
                               "--heartbeat-timeout-ms", "3000")):
        c = Cluster(tmp_dir, lighthouse_flags)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


__all__ = ["Cluster", "Proc", "wait_for", "thread_asleep", "signal", "sys"]
