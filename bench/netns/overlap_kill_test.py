"""CTest overlap_inflight_kill_test: a kill while an overlapped exchange is on a slow link.

Two sites in network namespaces (bench/netns/links.py), linked at 40 Mbit/s with 20 ms RTT, one
group of one diloco_trainer each, --outer-overlap, a model of 428k parameters: its exchange
(about 1.7 MB each way) takes several times as long as the inner steps of an outer step, so
site 0's trainer spends most of every outer step waiting for an exchange in flight. Site 1's
trainer is killed after step 3 and its group comes back (a fresh agent and trainer). Asserted:
site 0's exchange in flight was cut short by the lost member (`outer_step_aborted ...
overlapped=true`) and retried; site 1's new life healed from site 0's live state (`heal_fetched
from=peers`); both reach T; every step's param_hash agrees between the sites; every process that
was not killed exits 0. Never a speed.

Needs root, ip netns, tc and /dev/net/tun; otherwise it prints LK_TEST_SKIPPED and passes as
skipped (CTest SKIP_REGULAR_EXPRESSION).

    overlap_kill_test.py BUILD_DIR
"""

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from links import HUB_IP, Links, site_ip  # noqa: E402
from shaped_links import Procs, field, wait_for_line  # noqa: E402

STEPS = 10
MODEL = ["--model-width", "128", "--layers", "2", "--heads", "4", "--seq-len", "16",
         "--batch", "8", "--inner-steps", "4", "--eval-batches", "0"]


def skip(why):
    print(f"LK_TEST_SKIPPED: {why}")
    sys.exit(0)


def check_environment():
    if os.geteuid() != 0:
        skip("needs root for ip netns and tc")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        skip("no ip or tc (iproute2)")
    if not os.path.exists("/dev/net/tun"):
        skip("no /dev/net/tun")
    probe = f"lkok{os.getpid()}-probe"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        skip("cannot create a network namespace here")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def thread_asleep(pid, settle_s=0.02):
    """Whether process ``pid``'s main thread is asleep in a system call and stays there, never
    switched in, for ``settle_s`` (python/tests/conftest.py's thread_asleep, for one process):
    it waits on something that has not come, not on a mutex taken in passing."""

    def look():
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(x.split(":", 1) for x in f.read().splitlines() if ":" in x)
            with open(f"/proc/{pid}/syscall") as f:
                call = f.read().split()
        except OSError:
            return None
        nr = int(call[0]) if call and call[0].isdigit() else None
        switches = sum(int(fields.get(k, "0")) for k in ("voluntary_ctxt_switches",
                                                          "nonvoluntary_ctxt_switches"))
        asleep = fields.get("State", "?").strip()[:1] in ("S", "D") and nr is not None
        return (nr, switches) if asleep else None

    before = look()
    if before is None:
        return False
    time.sleep(settle_s)
    return look() == before


def read_rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def main(build):
    check_environment()
    out = tempfile.mkdtemp(prefix="lk-overlap-kill-", dir=os.environ.get("TMPDIR", "/tmp"))
    print(f"logs in {out}")
    tag = f"lkok{os.getpid()}"
    procs = Procs()
    failures = []

    def expect(ok, what):
        print(("ok: " if ok else "FAILED: ") + what)
        if not ok:
            failures.append(what)

    with Links(tag, 2, "40mbit", 20.0, build, out) as links:
        token = secrets.token_hex(16)
        token_file = os.path.join(out, "tokens")
        with open(token_file, "w") as f:
            f.write(f"kill {token}\n")
        job_token = os.path.join(out, "job-token")
        with open(job_token, "w") as f:
            f.write(token + "\n")
        os.chmod(token_file, 0o600)
        os.chmod(job_token, 0o600)
        lh = procs.start(links.exec("hub", [
            os.path.join(build, "bin", "lighthouse"), "--bind", f"{HUB_IP}:0",
            "--data-dir", os.path.join(out, "lh"), "--token-file", token_file,
            "--min-replicas", "2", "--join-timeout-ms", "2000",
            "--heartbeat-timeout-ms", "2000"]), os.path.join(out, "lighthouse.log"))
        lh_addr = field(wait_for_line(lh.log_path, "listening address=", lh), "address")

        def start_group(g, life):
            sock = os.path.join(out, f"g{g}.{life}.sock")
            agent = procs.start(links.exec(g, [
                os.path.join(build, "bin", "replica_agent"), "--lighthouse", f"http://{lh_addr}",
                "--job", "kill", "--group-id", f"g{g}", "--socket", sock,
                "--token-file", job_token, "--serve", f"{site_ip(g)}:0",
                "--serve-dir", os.path.join(out, f"live-g{g}"),
                "--heartbeat-interval-ms", "100"]), os.path.join(out, f"agent-g{g}.{life}.log"))
            wait_for_line(agent.log_path, "agent_listening", agent)
            # The token lets the trainer read its healing peers' live state from their agents.
            env = dict(os.environ, LK_AGENT_SOCKET=sock, LK_GROUP_ID=f"g{g}",
                       LK_TOKEN_FILE=job_token)
            log = os.path.join(out, f"trainer-g{g}.{life}.jsonl")
            trainer = procs.start(links.exec(g, [
                os.path.join(build, "bin", "diloco_trainer"), "--group-rank", "0",
                "--group-size", "1", "--outer-steps", str(STEPS), "--seed", "3",
                "--bind-host", site_ip(g), "--log", log, "--op-timeout-ms", "60000",
                "--live-dir", os.path.join(out, f"live-g{g}"), "--outer-overlap"] + MODEL),
                log + ".stderr", env=env)
            return agent, trainer, log

        a0, t0, log0 = start_group(0, 0)
        a1, t1, log1 = start_group(1, 0)
        deadline = time.time() + 240
        while time.time() < deadline and not any(r["step"] >= 3 for r in read_rows(log0)):
            if t0.poll() is not None:
                break
            time.sleep(0.05)
        expect(any(r["step"] >= 3 for r in read_rows(log0)), "site 0 committed step 3")
        # Site 0's exchange of the next step is on the link (it takes longer than the inner
        # steps around it) once site 0's trainer has done those and waits for it to land: its
        # main thread is asleep. The kill then lands while the exchange is in flight.
        deadline_in_flight = time.time() + 60
        while not thread_asleep(t0.pid):
            if time.time() > deadline_in_flight:
                expect(False, "site 0's trainer waits for its exchange in flight (within 60 s)")
                break
            time.sleep(0.005)
        t1.kill()
        t1.wait(30)
        expect(a1.wait(30) == 3, "site 1's agent exits 3 (a trainer of its group died)")
        a1b, t1b, log1b = start_group(1, 1)
        rc0 = t0.wait(max(1, deadline - time.time()))
        rc1 = t1b.wait(max(1, deadline - time.time()))
        expect(rc0 == 0, f"site 0's trainer exits 0 (got {rc0})")
        expect(rc1 == 0, f"site 1's new trainer exits 0 (got {rc1})")
        for a in (a0, a1b):
            try:
                a.wait(30)
            except subprocess.TimeoutExpired:
                pass
        procs.stop_all()

    with open(log0 + ".stderr") as f:
        fast = f.read()
    with open(log1b + ".stderr") as f:
        back = f.read()
    aborted = [x for x in fast.splitlines() if "outer_step_aborted" in x]
    expect(any("overlapped=true" in x for x in aborted),
           "site 0's exchange in flight was cut short by the kill (outer_step_aborted "
           "overlapped=true)")
    expect("heal_fetched from=peers" in back, "site 1's new life healed from site 0's live state")
    rows0, rows1 = read_rows(log0), read_rows(log1b)
    expect(bool(rows0) and rows0[-1]["step"] == STEPS, "site 0 reached T")
    expect(bool(rows1) and rows1[-1]["step"] == STEPS, "site 1's new life reached T")
    hashes = {}
    for r in rows0 + read_rows(log1) + rows1:
        hashes.setdefault(r["step"], set()).add(r["param_hash"])
    expect(sorted(hashes) == list(range(1, STEPS + 1)), "every step committed")
    expect(all(len(h) == 1 for h in hashes.values()), "every step's param_hash agrees")
    if failures:
        print(f"{len(failures)} check(s) failed; logs in {out}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(os.path.abspath(sys.argv[1])))
