#!/usr/bin/env python3
"""A storm of mutated requests against a running lighthouse and replica_agent.

Starts a real lighthouse (token files, admin token) and a real replica_agent (--serve and its Unix
socket) on loopback, builds a baseline in job "storm" with valid requests, records its /status,
then sends mutations of real requests (JSON and protobuf bodies with byte flips, truncations,
wrong methods, odd paths and queries, bad/missing/other-job tokens, bad Content-Type, oversized
and chunked bodies, pipelined garbage, half-closed connections) to the lighthouse's TCP port, the
agent's Unix socket and the agent's --serve port over a few concurrent connections.

Checks: both processes stay alive (checked periodically and at the end), every answer is a
well-formed HTTP response, answers of 500 and above are findings, a well-framed request whose
connection closes without an answer is a finding, and job "storm"'s record in /status (groups,
quorum id, members, committed step, checkpoints, a KV key) is unchanged at the end. Job "storm"'s
token is never sent with a body that could be valid, so every request aimed at it is refused;
meanwhile valid authenticated traffic runs in job "other", which is not compared.

The agent's Unix socket trusts its peer (same uid), so a mutated request there may be valid: a
mutated hello registers this script as a trainer, and a valid goodbye from it ends the agent
cleanly ("finished", exit 0). Such an exit is by design: it is counted and the agent restarted.
Any other exit of either process is a finding.

Python 3 standard library only. Exit status 0 when there is no finding, 1 otherwise.
"""

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from request_storm_wire import Conn, Malformed, build_request, reason_code  # noqa: E402
import request_storm_mutations as mutations  # noqa: E402

# ---------------------------------------------------------------------------- the services


class Services:
    def __init__(self, bindir, root):
        self.bindir, self.root = bindir, root
        self.tokens = {
            "storm": "storm-" + os.urandom(8).hex(),
            "other": "other-" + os.urandom(8).hex(),
            "agentjob": "agent-" + os.urandom(8).hex(),
        }
        self.read_only = "ro-" + os.urandom(8).hex()
        self.admin = "admin-" + os.urandom(8).hex()
        with open(f"{root}/tokens", "w") as f:
            for job, t in self.tokens.items():
                f.write(f"{job} {t}\n")
            f.write(f"role=read-only {self.read_only}\n")
        with open(f"{root}/admin.token", "w") as f:
            f.write(self.admin + "\n")
        with open(f"{root}/agent.token", "w") as f:
            f.write(self.tokens["agentjob"] + "\n")
        self.lh = self.agent = None
        self.agent_starts = 0
        self.agent_exits = []  # monotonic times at which a clean agent exit was seen
        self.lh_addr = self.serve_addr = None
        self.socket_path = f"{root}/agent.sock"
        # Files for the shard server behind --serve: its own step directory and another root's.
        # Bytes only (no manifest): a file read needs none, and the list then shows no step.
        self.serve_dir = f"{root}/serve"
        for sub, name in (("step-000000000001", "shard-0.bin"),
                          ("g1/step-000000000002", "shard-1.bin")):
            os.makedirs(f"{self.serve_dir}/{sub}", exist_ok=True)
            with open(f"{self.serve_dir}/{sub}/{name}", "wb") as f:
                f.write(os.urandom(256 << 10))

    @staticmethod
    def _wait_log(path, pattern, proc, bound_s=20):
        deadline = time.monotonic() + bound_s
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            try:
                with open(path, errors="replace") as f:
                    for line in f:
                        m = rx.search(line)
                        if m:
                            return m
            except FileNotFoundError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"{path}: exited with {proc.returncode} before '{pattern}'")
            time.sleep(0.02)
        raise RuntimeError(f"{path}: no '{pattern}' within {bound_s} s")

    def start_lighthouse(self):
        log = f"{self.root}/lighthouse.log"
        self.lh = subprocess.Popen(
            [f"{self.bindir}/lighthouse", "--bind", "127.0.0.1:0", "--data-dir", f"{self.root}/lh",
             "--token-file", f"{self.root}/tokens", "--admin-token-file", f"{self.root}/admin.token",
             "--min-replicas", "1", "--join-timeout-ms", "100",
             # Groups of the baseline stay healthy and remembered for the whole run, so that
             # their record can only change through a request.
             "--heartbeat-timeout-ms", "3600000", "--group-grace-ms", "0"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT)
        m = self._wait_log(log, r"listening address=([0-9.]+):([0-9]+)", self.lh)
        self.lh_addr = (m.group(1), int(m.group(2)))

    def start_agent(self):
        self.agent_starts += 1
        log = f"{self.root}/agent-{self.agent_starts}.log"
        self.agent_log = log
        self.agent = subprocess.Popen(
            [f"{self.bindir}/replica_agent", "--lighthouse",
             f"http://{self.lh_addr[0]}:{self.lh_addr[1]}", "--job", "agentjob", "--group-id", "a0",
             "--node-rank", "0", "--nodes", "1", "--socket", self.socket_path, "--serve",
             "127.0.0.1:0", "--token-file", f"{self.root}/agent.token",
             "--serve-dir", self.serve_dir,
             "--heartbeat-interval-ms", "200", "--drain-timeout-ms", "1000"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT)
        m = self._wait_log(log, r"agent_listening .*serve=([0-9.]+):([0-9]+)", self.agent)
        self.serve_addr = (m.group(1), int(m.group(2)))
        # This script says hello as one trainer of eight: the group's size is then fixed, the
        # mutated hellos (of a group of one) are refused, and a goodbye that decodes ends the
        # agent (by design) only once eight ranks registered and all said goodbye.
        status, _, body = call(self.socket_path, "POST", "/v1/trainer/hello",
                               b'{"group_rank":0,"group_size":8}')
        if status != 200:
            raise RuntimeError(f"agent hello: {status} {body[:200]!r}")

    def stop(self):
        for p in (self.agent, self.lh):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (self.agent, self.lh):
            if p is not None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def call(address, method, target, body=b"", token=None, ctype="application/json", timeout_s=10):
    """One well-formed request on a fresh connection: (status, headers, body)."""
    headers = [("Host", "storm"), ("Content-Length", str(len(body)))]
    if ctype:
        headers.append(("Content-Type", ctype))
    if token:
        headers.append(("Authorization", f"Bearer {token}"))
    c = Conn(address, timeout_s)
    try:
        c.send(build_request(method, target, headers, body))
        return c.read_answer()
    finally:
        c.close()


def jcall(address, method, target, obj, token, timeout_s=10):
    status, _, body = call(address, method, target, json.dumps(obj).encode(), token,
                           timeout_s=timeout_s)
    if status >= 300:
        raise RuntimeError(f"{method} {target}: {status} {body[:300]!r}")
    return json.loads(body) if body else {}


# ---------------------------------------------------------------------------- the baseline


def make_baseline(svc):
    """Job "storm": one group in a quorum, one committed step, a checkpoint and a KV key."""
    lh, t = svc.lh_addr, svc.tokens["storm"]
    agent = {"job": "storm", "group_id": "s0", "incarnation": "s0-inc", "node_rank": 0, "nodes": 1}
    jcall(lh, "POST", "/v1/heartbeat", dict(agent, step=0, address="127.0.0.1:9"), t)
    q = jcall(lh, "POST", "/v1/quorum",
              dict(agent, step=0, timeout_ms=10000, group_size=1, address="127.0.0.1:9"), t)
    qid = q["quorum_id"]
    jcall(lh, "POST", "/v1/commit", dict(agent, quorum_id=qid, step=1, state_hash="abc"), t)
    jcall(lh, "POST", "/v1/checkpoints",
          {"job": "storm", "step": 1, "location": "/storm/step-1", "group_id": "s0"}, t)
    status, _, _ = call(lh, "PUT", f"/v1/kv/storm/{qid}/base-key", b"base-value", t,
                        "application/octet-stream")
    if status != 204:
        raise RuntimeError(f"baseline KV put: {status}")
    return agent, qid


def storm_record(svc, qid):
    """What must not change: job storm's fields in /status, its checkpoints and its KV key."""
    st = jcall(svc.lh_addr, "GET", "/status?job=storm", None, svc.admin)
    jobs = [j for j in st.get("jobs", []) if j.get("job") == "storm"]
    rec = {"jobs": [j.get("job") for j in st.get("jobs", [])
                    if j.get("job") not in ("other", "agentjob")]}
    if jobs:
        j = jobs[0]
        rec.update({
            "quorum_id": j.get("quorum_id"), "committed_step": j.get("committed_step"),
            "finished_step": j.get("finished_step"), "quorum_changes": j.get("quorum_changes"),
            "members": [(m.get("group_id"), m.get("incarnation"), m.get("step"))
                        for m in j.get("members", [])],
            "groups": [(g.get("group_id"), g.get("incarnation"), g.get("step"), g.get("state"),
                        g.get("draining"), g.get("generation"), g.get("nodes"))
                       for g in j.get("groups", [])],
            "checkpoints": [(c.get("step"), c.get("location")) for c in j.get("checkpoints", [])],
        })
    status, _, body = call(svc.lh_addr, "GET", f"/v1/kv/storm/{qid}/base-key?timeout_ms=0", b"",
                           svc.tokens["storm"], None)
    rec["kv"] = (status, body.decode("latin-1"))
    return rec


# ---------------------------------------------------------------------------- the storm


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.sent = 0
        self.by = collections.Counter()  # (listener, endpoint, status or outcome)
        self.kinds = collections.Counter()
        self.findings = []
        self.informational = collections.Counter()
        self.deferred = []

    def add(self, listener, endpoint, outcome, kind=None):
        with self.lock:
            self.by[(listener, endpoint, outcome)] += 1
            if kind:
                self.kinds[kind] += 1

    def maybe_finding(self, listener, text):
        """On the agent's listeners a request in flight while the agent ends (a goodbye that
        decoded) may go unanswered: decided at the end, against the times of those exits."""
        if listener == "lighthouse":
            return self.finding(text)
        with self.lock:
            self.deferred.append((time.monotonic(), text))

    def settle(self, exits, slack_s):
        for t, text in self.deferred:
            if any(t - slack_s <= e <= t + slack_s for e in exits):
                with self.lock:
                    self.informational["no_answer_while_agent_exiting"] += 1
            else:
                self.finding(text)
        self.deferred = []

    def finding(self, text):
        with self.lock:
            if len(self.findings) < 200:
                self.findings.append(text)
            self.informational["findings"] += 1


def worker(idx, args, svc, bases, tally, stop, budget, rng_seed):
    rng = random.Random(rng_seed)
    conns = {}
    listeners = [("lighthouse", 5), ("socket", 3), ("serve", 2)]
    weighted = [name for name, w in listeners for _ in range(w)]
    token_pool = [None, "", "x", "bad-" + "0" * 40, svc.tokens["other"], svc.read_only,
                  svc.tokens["agentjob"], svc.tokens["storm"], svc.admin, "a" * 5000]
    while not stop.is_set():
        with tally.lock:
            if tally.sent >= budget:
                return
            tally.sent += 1
        listener = weighted[rng.randrange(len(weighted))]
        address = {"lighthouse": svc.lh_addr, "socket": svc.socket_path,
                   "serve": svc.serve_addr}[listener]
        base = rng.choice(bases[listener])
        if rng.random() < args.raw_share:
            pool = token_pool
            if listener == "lighthouse" and base.changes:
                pool = [t for t in token_pool if t not in mutations.token_pool_valid_for_storm]
            m, kind = mutations.raw_mutation(base, rng, pool)
        else:
            m, kind = mutations.mutate(base, rng, token_pool,
                                       forbid_valid=(listener == "lighthouse"))
        if args.skip_kv_exact and listener == "lighthouse" and _is_exact_kv(m.data):
            tally.add(listener, base.endpoint, "skipped_exact_kv")
            continue
        endpoint = base.endpoint
        key = (listener, m.oneshot)
        head_only = m.data.startswith(b"HEAD ")
        for attempt in range(2):
            conn = None if m.oneshot else conns.pop(key, None)
            reused = conn is not None
            try:
                if conn is None:
                    conn = Conn(address, args.timeout_s)
                    conn.open()
                conn.send(m.data)
                if m.half_close:
                    conn.half_close()
                answers = []
                while True:
                    try:
                        answers.append(conn.read_answer(head_only and not answers))
                    except EOFError:
                        conn.close()
                        break
                    if not m.half_close:
                        break
            except (ConnectionResetError, BrokenPipeError) as e:
                conn.close()
                if reused and attempt == 0:
                    continue  # a keep-alive connection the server closed while idle
                tally.add(listener, endpoint, "reset" if m.framed else "reset_malformed", kind)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                tally.add(listener, endpoint, "refused_connect", kind)
                time.sleep(0.05)  # the agent may be restarting after a goodbye
                break
            except socket.timeout:
                conn.close()
                tally.add(listener, endpoint, "timeout", kind)
                if m.framed and endpoint not in LONG_POLLS:
                    tally.finding(f"{listener} {endpoint} {kind}: no answer in {args.timeout_s} s "
                                  f"request={m.data[:300]!r}")
                break
            except Malformed as e:
                conn.close()
                tally.add(listener, endpoint, "malformed_answer", kind)
                tally.finding(f"{listener} {endpoint} {kind}: malformed answer: {e} "
                              f"request={m.data[:300]!r}")
                break
            if not answers and reused and attempt == 0:
                continue  # as above: closed while idle, before this request
            for status, headers, body in answers:
                code = reason_code(headers, body)
                tally.add(listener, endpoint, str(status), kind)
                if status >= 500:
                    tally.add(listener, endpoint, f"{status}:{code}")
                    if not (status in (503, 504) and code in OK_5XX):
                        tally.finding(f"{listener} {endpoint} {kind}: {status} {code} "
                                      f"{body[:200]!r} request={m.data[:300]!r}")
            if not answers:
                if m.framed:
                    tally.add(listener, endpoint, "closed_without_answer", kind)
                    tally.maybe_finding(listener, f"{listener} {endpoint} {kind}: closed without "
                                        f"an answer request={m.data[:300]!r}")
                else:
                    tally.add(listener, endpoint, "closed_without_answer_malformed", kind)
            keep = (not m.oneshot and conn.sock is not None and answers and
                    answers[-1][1].get("connection", "").lower() != "close")
            if keep:
                conns[key] = conn
            else:
                conn.close()
            break


# Answers of 503/504 that are backpressure or a long-poll's deadline, not a failure of the
# server: the agent's worker queue, the lighthouse's buffer budget, a quorum's wait.
OK_5XX = {"WORKERS_BUSY", "BUFFER_BUDGET", "WAIT_TIMEOUT", "AGENT_EXITING", "SHUTTING_DOWN"}
LONG_POLLS = {"/v1/trainer/poll", "/v1/trainer/notice", "/v1/trainer/kv", "/v1/quorum",
              "/v1/watch", "/v1/kv", "/v1/trainer/commit", "/v1/trainer/checkpoint"}


def _is_exact_kv(data):
    line = data.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) < 2:
        return False
    target = parts[1].split(b"?", 1)[0]
    return target in (b"/v1/kv",)


def valid_other_traffic(svc, stop, tally):
    """Valid, authenticated requests of job "other" while the storm runs: its record changes,
    which is allowed; job storm's must not."""
    t = svc.tokens["other"]
    a = {"job": "other", "group_id": "o0", "incarnation": "o0-inc", "node_rank": 0, "nodes": 1}
    step = 0
    while not stop.is_set():
        try:
            jcall(svc.lh_addr, "POST", "/v1/heartbeat", dict(a, step=step), t)
            q = jcall(svc.lh_addr, "POST", "/v1/quorum",
                      dict(a, step=step, timeout_ms=2000, group_size=1), t)
            step += 1
            jcall(svc.lh_addr, "POST", "/v1/commit",
                  dict(a, quorum_id=q["quorum_id"], step=step), t)
            with tally.lock:
                tally.informational["valid_other_job_steps"] += 1
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            with tally.lock:
                tally.informational["valid_other_job_errors"] += 1
                tally.informational[f"valid_other_job_error {str(e)[:80]}"] += 1
        stop.wait(0.05)


def agent_exit_is_clean(svc):
    """True when the agent ended because a (mutated but valid) goodbye finished its trainers."""
    if svc.agent.returncode != 0:
        return False
    with open(svc.agent_log, errors="replace") as f:
        text = f.read()
    return "finished" in text


def monitor(svc, stop, tally, args):
    while not stop.wait(args.check_every_s):
        if svc.lh.poll() is not None:
            tally.finding(f"lighthouse exited with {svc.lh.returncode}: see "
                          f"{svc.root}/lighthouse.log")
            stop.set()
            return
        if svc.agent.poll() is not None:
            if agent_exit_is_clean(svc):
                with tally.lock:
                    tally.informational["agent_clean_exits_after_goodbye"] += 1
                svc.agent_exits.append(time.monotonic())
                svc.start_agent()
            else:
                tally.finding(f"agent exited with {svc.agent.returncode}: see {svc.agent_log}")
                stop.set()
                return
        for name, address in (("lighthouse", svc.lh_addr), ("serve", svc.serve_addr)):
            try:
                status, _, _ = call(address, "GET", "/healthz", timeout_s=5)
                if status != 200:
                    tally.maybe_finding(name, f"{name} /healthz answered {status}")
            except (OSError, EOFError, Malformed) as e:
                tally.maybe_finding(name, f"{name} /healthz failed: {e}")
        with tally.lock:
            tally.informational["health_checks"] += 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="directory of lighthouse and replica_agent")
    ap.add_argument("--requests", type=int, default=300000)
    ap.add_argument("--connections", type=int, default=4, help="concurrent client connections")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout-s", type=float, default=5.0, help="wait for one answer")
    ap.add_argument("--raw-share", type=float, default=0.2,
                    help="share of requests damaged at the framing level (own connection)")
    ap.add_argument("--check-every-s", type=float, default=2.0, help="liveness check period")
    ap.add_argument("--skip-kv-exact", action="store_true",
                    help="never send the exact path /v1/kv to the lighthouse (it aborted on it)")
    ap.add_argument("--dir", default=None, help="work directory (default: a new one in $TMPDIR)")
    ap.add_argument("--json", default=None, help="write the figures here as JSON")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory (logs, state) even when there is no finding")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    root = args.dir or tempfile.mkdtemp(prefix="lk-storm-")
    os.makedirs(root, exist_ok=True)
    print(f"request_storm seed={seed} dir={root}", flush=True)
    svc = Services(os.path.abspath(args.bin), root)
    tally = Tally()
    stop = threading.Event()
    threads = []
    ok = False
    try:
        svc.start_lighthouse()
        svc.start_agent()
        agent, qid = make_baseline(svc)
        mutations.token_pool_valid_for_storm.update({svc.tokens["storm"], svc.admin})
        before = storm_record(svc, qid)
        bases = {"lighthouse": mutations.lighthouse_bases(svc, agent, qid),
                 "socket": mutations.socket_bases(), "serve": mutations.serve_bases(svc)}
        started = time.monotonic()
        threads.append(threading.Thread(target=valid_other_traffic, args=(svc, stop, tally)))
        threads.append(threading.Thread(target=monitor, args=(svc, stop, tally, args)))
        workers = [threading.Thread(target=worker, args=(i, args, svc, bases, tally, stop,
                                                         args.requests, seed * 1000 + i))
                   for i in range(args.connections)]
        for t in threads + workers:
            t.daemon = True
            t.start()
        last = time.monotonic()
        while any(w.is_alive() for w in workers):
            time.sleep(0.2)
            if time.monotonic() - last > 10:
                last = time.monotonic()
                print(f"request_storm_progress sent={tally.sent} "
                      f"findings={tally.informational['findings']}", flush=True)
        elapsed = time.monotonic() - started
        stop.set()
        for t in threads:
            t.join(timeout=15)
        if svc.agent.poll() is not None and agent_exit_is_clean(svc):
            svc.agent_exits.append(time.monotonic())
        tally.settle(svc.agent_exits, args.check_every_s + 3)
        for name, p in (("lighthouse", svc.lh), ("agent", svc.agent)):
            if p.poll() is not None and not (name == "agent" and agent_exit_is_clean(svc)):
                tally.finding(f"{name} not alive at the end (exit {p.returncode})")
        after = storm_record(svc, qid) if svc.lh.poll() is None else {"lighthouse": "gone"}
        if after != before:
            tally.finding(f"job storm's record changed: before={before} after={after}")
        report(args, seed, root, tally, elapsed, before, after)
        ok = tally.informational["findings"] == 0
    finally:
        stop.set()
        svc.stop()
    if ok and not args.keep and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    elif not ok:
        print(f"request_storm: logs and state kept in {root}")
    return 0 if ok else 1


def report(args, seed, root, tally, elapsed, before, after):
    by_listener = collections.Counter()
    by_status = collections.Counter()
    by_endpoint = collections.defaultdict(collections.Counter)
    for (listener, endpoint, outcome), n in tally.by.items():
        if ":" in outcome:  # the 5xx detail lines, counted already
            continue
        by_listener[listener] += n
        by_status[outcome] += n
        by_endpoint[f"{listener} {endpoint}"][outcome] += n
    answered = sum(n for k, n in by_status.items() if k.isdigit())
    print(f"\nrequest_storm_done requests={tally.sent} seconds={elapsed:.1f} "
          f"requests_per_s={tally.sent / max(elapsed, 1e-9):.0f} answers={answered} "
          f"findings={tally.informational['findings']} seed={seed}")
    print("\nper listener: " + ", ".join(f"{k} {v}" for k, v in sorted(by_listener.items())))
    print("per outcome: " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())))
    print("\nper endpoint (listener endpoint: outcome count ...):")
    for ep in sorted(by_endpoint):
        print(f"  {ep}: " + " ".join(f"{k}={v}" for k, v in sorted(by_endpoint[ep].items())))
    five = {f"{l} {e} {o}": n for (l, e, o), n in tally.by.items() if ":" in o}
    if five:
        print("\n5xx answers (status:reason): " + ", ".join(f"{k}={v}" for k, v in sorted(five.items())))
    print("\nother: " + ", ".join(f"{k}={v}" for k, v in sorted(tally.informational.items())))
    print(f"\njob storm unchanged: {before == after}")
    if tally.findings:
        print("\nfindings:")
        for f in tally.findings[:50]:
            print("  " + f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": tally.sent, "seconds": elapsed, "seed": seed, "dir": root,
                       "per_listener": by_listener, "per_outcome": by_status,
                       "per_endpoint": by_endpoint, "five_xx": five,
                       "informational": tally.informational, "findings": tally.findings,
                       "storm_unchanged": before == after}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
