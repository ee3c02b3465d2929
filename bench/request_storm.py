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

# ---------------------------------------------------------------------------- protobuf, by hand


def _varint(n):
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def pb(fields):
    """Encodes [(number, value)]: int -> varint, bool -> varint, str/bytes -> length-delimited."""
    out = bytearray()
    for num, v in fields:
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, int):
            out += _varint(num << 3) + _varint(v)
        else:
            data = v.encode() if isinstance(v, str) else v
            out += _varint(num << 3 | 2) + _varint(len(data)) + data
    return bytes(out)


def pb_varint_field(data, want):
    """The first varint field `want` of a protobuf message, or None (for ErrorResponse.code)."""
    i = 0
    try:
        while i < len(data):
            key, i = _read_varint(data, i)
            num, wt = key >> 3, key & 7
            if wt == 0:
                v, i = _read_varint(data, i)
                if num == want:
                    return v
            elif wt == 2:
                n, i = _read_varint(data, i)
                i += n
            elif wt == 1:
                i += 8
            elif wt == 5:
                i += 4
            else:
                return None
    except IndexError:
        return None
    return None


def _read_varint(data, i):
    shift = result = 0
    while True:
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


# ---------------------------------------------------------------------------- HTTP, by hand


def build_request(method, target, headers, body):
    head = f"{method} {target} HTTP/1.1\r\n"
    for k, v in headers:
        head += f"{k}: {v}\r\n"
    return head.encode("latin-1") + b"\r\n" + body


STATUS_LINE = re.compile(rb"^HTTP/1\.[01] ([1-5][0-9][0-9]) [^\r\n]*$")


class Malformed(Exception):
    pass


class Conn:
    """One client connection (TCP or Unix) that reads whole HTTP/1.1 answers."""

    def __init__(self, address, timeout_s):
        self.address = address
        self.timeout_s = timeout_s
        self.sock = None
        self.buf = b""

    def open(self):
        if isinstance(self.address, str):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(self.timeout_s)
        s.connect(self.address)
        self.sock, self.buf = s, b""

    def close(self):
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock, self.buf = None, b""

    def send(self, data):
        if self.sock is None:
            self.open()
        self.sock.sendall(data)

    def half_close(self):
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _fill(self):
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise EOFError
        self.buf += chunk

    def read_answer(self, head_only=False):
        """One answer: (status, headers dict, body). EOFError when closed before one began,
        Malformed when what came is not HTTP, socket.timeout when it stalls."""
        while b"\r\n\r\n" not in self.buf:
            if len(self.buf) > 65536:
                raise Malformed("answer head over 64 KiB")
            try:
                self._fill()
            except EOFError:
                if self.buf:
                    raise Malformed("closed inside an answer head")
                raise
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        m = STATUS_LINE.match(lines[0])
        if not m:
            raise Malformed(f"bad status line {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            if b":" not in line:
                raise Malformed(f"bad header line {line[:80]!r}")
            k, v = line.split(b":", 1)
            headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        status = int(m.group(1))
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            return self.read_answer(head_only)
        if "content-length" not in headers:
            raise Malformed("answer without Content-Length")
        try:
            n = int(headers["content-length"])
        except ValueError:
            raise Malformed("bad Content-Length in answer")
        if head_only:  # the answer to HEAD has the length of a body that it does not carry
            n = 0
        while len(self.buf) < n:
            try:
                self._fill()
            except EOFError:
                raise Malformed("closed inside an answer body")
        body, self.buf = self.buf[:n], self.buf[n:]
        return status, headers, body


def _reason_names():
    """ErrorResponse.Code's numbers and names, from the proto file beside this script."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common", "proto",
                        "lightkeeper.proto")
    names = {}
    try:
        with open(path) as f:
            text = f.read()
        block = text[text.index("message ErrorResponse"):]
        block = block[block.index("enum Code"):block.index("}")]
        for name, num in re.findall(r"([A-Z_][A-Z0-9_]*)\s*=\s*([0-9]+);", block):
            names[int(num)] = name
    except (OSError, ValueError):
        pass
    return names


REASON_NAMES = _reason_names()


def reason_code(headers, body):
    ct = headers.get("content-type", "")
    if "json" in ct:
        try:
            v = json.loads(body)
            return str(v.get("code", "")) if isinstance(v, dict) else ""
        except ValueError:
            return ""
    if "protobuf" in ct:
        code = pb_varint_field(body, 3)
        return REASON_NAMES.get(code, f"#{code}") if code is not None else ""
    return ""


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


# ---------------------------------------------------------------------------- the requests


class Base:
    """A real request before mutation. `body_fmt` is "json", "proto" or "raw"; `state` says what
    a valid copy with the right token would do ("change" for the lighthouse's job storm: such a
    request must be mutated into an invalid or unauthenticated one)."""

    def __init__(self, endpoint, method, path, query="", body=b"", ctype="", token=None,
                 changes=False):
        self.endpoint, self.method, self.path, self.query = endpoint, method, path, query
        self.body, self.ctype, self.token, self.changes = body, ctype, token, changes


def lighthouse_bases(svc, agent, qid):
    t = svc.tokens["storm"]
    a = agent
    msgs = {
        "/v1/heartbeat": (dict(a, step=1, phase="inner", address="127.0.0.1:9"),
                          pb([(1, a["job"]), (2, a["group_id"]), (3, a["incarnation"]), (4, 0),
                              (5, 1), (6, 1), (7, "inner"), (8, "127.0.0.1:9")])),
        "/v1/quorum": (dict(a, step=1, timeout_ms=200, group_size=1),
                       pb([(1, a["job"]), (2, a["group_id"]), (3, a["incarnation"]), (5, 1), (6, 1),
                           (7, 200), (13, 1)])),
        "/v1/commit": (dict(a, quorum_id=qid, step=2, state_hash="def"),
                       pb([(1, a["job"]), (2, a["group_id"]), (3, a["incarnation"]), (5, qid),
                           (6, 2), (8, "def")])),
        "/v1/leave": (dict(a, reason="preempted"),
                      pb([(1, a["job"]), (2, a["group_id"]), (3, a["incarnation"]),
                          (4, "preempted")])),
        "/v1/checkpoints": ({"job": "storm", "step": 2, "location": "/storm/step-2"},
                            pb([(1, "storm"), (2, 2), (3, "/storm/step-2")])),
        "/v1/admin/drain": ({"job": "storm", "group_id": "s0"}, pb([(1, "storm"), (2, "s0")])),
        "/v1/admin/forget": ({"job": "storm"}, pb([(1, "storm")])),
    }
    out = []
    for path, (obj, proto) in msgs.items():
        token = svc.admin if path.startswith("/v1/admin") else t
        out.append(Base(path, "POST", path, body=json.dumps(obj).encode(),
                        ctype="application/json", token=token, changes=True))
        out.append(Base(path, "POST", path, body=proto, ctype="application/x-protobuf",
                        token=token, changes=True))
    out += [
        Base("/v1/kv", "PUT", f"/v1/kv/storm/{qid}/k1", body=b"value", token=t,
             ctype="application/octet-stream", changes=True),
        Base("/v1/kv", "GET", f"/v1/kv/storm/{qid}/base-key", "timeout_ms=0", token=t),
        Base("/v1/kv", "GET", f"/v1/kv/storm/{qid}/missing", "timeout_ms=0", token=t),
        Base("/v1/watch", "GET", "/v1/watch", f"job=storm&quorum_id={qid}&timeout_ms=0", token=t),
        Base("/v1/checkpoints", "GET", "/v1/checkpoints", "job=storm", token=t),
        Base("/status", "GET", "/status", "job=storm", token=svc.admin),
        Base("/metrics", "GET", "/metrics", token=svc.admin),
        Base("/healthz", "GET", "/healthz"),
        Base("/", "GET", "/"),
    ]
    return out


def socket_bases():
    def both(endpoint, obj, proto, method="POST"):
        return [Base(endpoint, method, endpoint, body=json.dumps(obj).encode(),
                     ctype="application/json"),
                Base(endpoint, method, endpoint, body=proto, ctype="application/x-protobuf")]

    out = []
    out += both("/v1/trainer/hello", {"group_rank": 0, "group_size": 1}, pb([(1, 0), (2, 1)]))
    out += both("/v1/trainer/poll", {"group_rank": 0, "group_size": 1, "step": 0},
                pb([(1, 0), (2, 1), (3, 0)]))
    # Rank 7 never says hello (the first hello fixes the group's size at 1), so a goodbye that
    # decodes is refused; one whose flips turn it into rank 0 ends the agent, by design.
    out += both("/v1/trainer/goodbye", {"group_rank": 7}, pb([(1, 7)]))
    out += both("/v1/trainer/phase", {"group_rank": 0, "peer_wait": True}, pb([(1, 0), (2, 1)]))
    out += both("/v1/trainer/commit", {"group_rank": 0, "step": 1, "quorum_id": 1},
                pb([(1, 0), (2, 1)]))
    out += both("/v1/trainer/checkpoint", {"step": 1, "location": "/agent/step-1"},
                pb([(1, 1), (2, "/agent/step-1")]))
    out += [
        Base("/v1/trainer/notice", "GET", "/v1/trainer/notice", "quorum_id=1&timeout_ms=0"),
        Base("/v1/trainer/kv", "PUT", "/v1/trainer/kv/1/key", body=b"v",
             ctype="application/octet-stream"),
        Base("/v1/trainer/kv", "GET", "/v1/trainer/kv/1/key", "timeout_ms=0"),
        Base("/v1/agent/status", "GET", "/v1/agent/status"),
        Base("/healthz", "GET", "/healthz"),
    ]
    return out


def serve_bases(svc):
    t = svc.tokens["agentjob"]
    return [
        Base("/v1/agent/status", "GET", "/v1/agent/status", token=t),
        Base("/v1/shards", "GET", "/v1/shards/files/root/step-00000000001/shard-0.bin", token=t),
        Base("/v1/shards", "GET", "/v1/shards/manifest/root/step-00000000001", token=t),
        Base("/healthz", "GET", "/healthz"),
        Base("/v1/trainer/hello", "POST", "/v1/trainer/hello", body=b'{"group_rank":0}',
             ctype="application/json", token=t),
    ]


# ---------------------------------------------------------------------------- mutations

METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT", "post",
           "G\x01T", "X" * 40, ""]
CTYPES = ["", "application/json", "application/x-protobuf", "text/plain", "application/json; x=1",
          "application/x-protobuf\x7f", "multipart/form-data; boundary=x", "*/*", "a" * 300]
PATH_SUFFIXES = ["/", "/..", "/../status", "%2e%2e", "/%2e%2e/%2e%2e/etc/passwd", "%", "%zz",
                 "%00", "%0d%0aX: y", "//", "/.", "?", "#frag", ";x", "%2f", "/v1/kv", "\u00e9"]
QUERIES = ["", "job=", "job=storm&job=other", "quorum_id=99999999999", "quorum_id=-1",
           "timeout_ms=-5", "timeout_ms=1e9", "timeout_ms=0x10", "job=%", "job=%zz&%=%",
           "job=storm%00", "=&&==&", "a" * 2000, "job=" + "x" * 300, "quorum_id=&timeout_ms="]
ODD_PATHS = ["/v1/kv", "/v1/kv/", "/v1/kv//", "/v1/kv/storm", "/v1/kv/storm/", "/v1/kv/storm/x/k",
             "/v1/kv/storm/99999999999/k", "/v1/kv/../../status", "/v1/", "/v1", "/v1/k",
             "/v1/trainer/kv", "/v1/trainer/kv/", "/v1/trainer/k", "/v1/trainer/kv/x",
             "/v1/trainer/kv/%2e%2e/%2e%2e", "/v1/shards", "/v1/shards/", "/v1/shards/files",
             "/v1/shards/files/", "/v1/shards/files/a/b", "/v1/shards/files/../../../etc/passwd",
             "/v1/shards/manifest/..", "/v1/admin", "/v1/admin/", "/v1/admin/drain/x", "*",
             "http://x/status", "/%", "/%2", "/\u00ff", "/status/..", "/metrics?", "/v1/watch/"]


def flip(b, rng, n):
    if not b:
        return b
    b = bytearray(b)
    for _ in range(n):
        i = rng.randrange(len(b))
        b[i] = rng.choice([b[i] ^ (1 << rng.randrange(8)), rng.randrange(256), 0, 0xFF, 0x22,
                           0x7B, 0x0A, 0x80])
    return bytes(b)


class Mutated:
    """The bytes to send and how to send them."""

    def __init__(self, data, framed, half_close=False, oneshot=False):
        self.data, self.framed, self.half_close, self.oneshot = data, framed, half_close, oneshot


def mutate_body(base, rng):
    b = base.body
    op = rng.randrange(8)
    if op == 0 or not b:
        return flip(b or b"{}", rng, rng.randint(1, 8))
    if op == 1:
        return b[:rng.randrange(len(b))]
    if op == 2:
        return b + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    if op == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    if op == 4:
        return b"{" * rng.randint(1, 5000)  # deep nesting
    if op == 5:
        return b'{"job":' + b'"' + b"x" * rng.randint(100, 70000) + b'"}'
    if op == 6:  # a JSON body with its types turned
        return rng.choice([b"[]", b"null", b'"s"', b"1e999", b'{"job":1,"step":"x"}',
                           b'{"step":-1}', b'{"step":1e30}', b'{"quorum_id":99999999999}',
                           b'{"job":"storm","unknown_field":1}', b'{"job":"storm",}',
                           b'{"job":"\\ud800"}', b"\xff\xfe"])
    return flip(b, rng, 1) + b"}{"


def mutate(base, rng, token_pool, forbid_valid):
    """A mutation of `base`. With forbid_valid, the result must be refused: it carries no valid
    token of job storm or the admin, or its body is broken beyond decoding."""
    method, path, query, body, ctype = base.method, base.path, base.query, base.body, base.ctype
    token = base.token
    extra = []
    kinds = []
    n_ops = rng.randint(1, 3)
    ops = rng.sample(range(10), n_ops)
    for op in ops:
        if op == 0:
            token = rng.choice(token_pool)
            kinds.append("token")
        elif op == 1:
            body = mutate_body(base, rng)
            kinds.append("body")
        elif op == 2:
            method = rng.choice(METHODS)
            kinds.append("method")
        elif op == 3:
            path = rng.choice([path + rng.choice(PATH_SUFFIXES), rng.choice(ODD_PATHS),
                               path[:rng.randrange(1, len(path) + 1)],
                               path.replace("/", "/%2e%2e/", 1), path.upper()])
            kinds.append("path")
        elif op == 4:
            query = rng.choice(QUERIES)
            kinds.append("query")
        elif op == 5:
            ctype = rng.choice(CTYPES)
            kinds.append("ctype")
        elif op == 6:
            extra.append(rng.choice([("Accept", "application/x-protobuf"), ("Accept", "*/*"),
                                     ("Expect", "100-continue"), ("Expect", "200-ok"),
                                     ("Connection", "keep-alive, close"), ("X-" + "a" * 100, "b"),
                                     ("Authorization", "Basic Zm9vOmJhcg=="),
                                     ("Authorization", "Bearer"), ("Authorization", "Bearer  "),
                                     ("Range", "bytes=0-1"), ("Range", "bytes=-99999999999999"),
                                     ("Accept", "x" * 2000), ("Content-Type", "text/plain")]))
            kinds.append("header")
        elif op == 7:
            body = body + b"x" * rng.choice([1 << 16, (4 << 20) + 1, 70000])
            kinds.append("oversize")
        else:
            token = None
            kinds.append("no_token")
    if forbid_valid and token in token_pool_valid_for_storm and method not in ("GET", "HEAD"):
        if method == "PUT":
            # A KV value is opaque bytes that no decoder refuses: refuse it by its token.
            token = None
        else:
            # Keep the token and break the body in a way no decoder accepts (field number 0
            # in protobuf, a NUL in JSON).
            body = b"\x00{" + body
    headers = [("Host", "storm")]
    if ctype:
        headers.append(("Content-Type", ctype))
    if token:
        headers.append(("Authorization", f"Bearer {token}"))
    headers += extra
    if len(body) > (4 << 20):
        # Larger than the lighthouse's body limit: the answer is 413 before the body is read.
        pass
    headers.append(("Content-Length", str(len(body))))
    target = path + ("?" + query if query else "")
    try:
        data = build_request(method, target, headers, body)
    except UnicodeEncodeError:
        data = build_request(method, target.encode("utf-8").decode("latin-1"), headers, body)
    return Mutated(data, framed=True), "+".join(sorted(kinds))


token_pool_valid_for_storm = set()


def raw_mutation(base, rng, token_pool):
    """Framing-level damage: the request is sent on its own connection, then half-closed."""
    token = rng.choice(token_pool)
    headers = [("Host", "storm"), ("Content-Type", base.ctype or "application/json")]
    if token:
        headers.append(("Authorization", f"Bearer {token}"))
    target = base.path + ("?" + base.query if base.query else "")
    op = rng.randrange(8)
    body = base.body
    if op == 0:  # chunked body
        data = build_request(base.method, target, headers + [("Transfer-Encoding", "chunked")],
                             b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        return Mutated(data, framed=False, half_close=True, oneshot=True), "raw_chunked"
    if op == 1:  # conflicting lengths
        data = build_request(base.method, target, headers + [("Content-Length", str(len(body))),
                                                             ("Content-Length", "3")], body)
        return Mutated(data, framed=False, half_close=True, oneshot=True), "raw_two_lengths"
    if op == 2:  # a length larger than what follows
        data = build_request(base.method, target,
                             headers + [("Content-Length", str(len(body) + 100))], body)
        return Mutated(data, framed=False, half_close=True, oneshot=True), "raw_short_body"
    if op == 3:  # pipelined garbage after a request
        data = build_request(base.method, target, headers + [("Content-Length", str(len(body)))],
                             body) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))
        return Mutated(data, framed=False, half_close=True, oneshot=True), "raw_pipelined_garbage"
    if op == 4:  # pipelined requests
        one = build_request("GET", "/healthz", [("Host", "x")], b"")
        data = one + build_request(base.method, target,
                                   headers + [("Content-Length", str(len(body)))], body) + one
        return Mutated(data, framed=False, half_close=True, oneshot=True), "raw_pipelined"
    if op == 5:  # bytes of the whole request flipped
        data = build_request(base.method, target, headers + [("Content-Length", str(len(body)))],
                             body)
        return Mutated(flip(data, rng, rng.randint(1, 6)), framed=False, half_close=True,
                       oneshot=True), "raw_flip"
    if op == 6:  # the request cut short, then half-closed
        data = build_request(base.method, target, headers + [("Content-Length", str(len(body)))],
                             body)
        return Mutated(data[:rng.randrange(len(data))], framed=False, half_close=True,
                       oneshot=True), "raw_truncated"
    garbage = rng.choice([b"\r\n\r\n", b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                          b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 2000 + b"\r\n",
                          b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS hello
                          b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                          bytes(rng.randrange(256) for _ in range(rng.randint(1, 512)))])
    return Mutated(garbage, framed=False, half_close=True, oneshot=True), "raw_garbage"


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
            m, kind = raw_mutation(base, rng, token_pool if listener != "lighthouse" or
                                   not base.changes else [t for t in token_pool if t not in
                                                          token_pool_valid_for_storm])
        else:
            m, kind = mutate(base, rng, token_pool, forbid_valid=(listener == "lighthouse"))
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
        token_pool_valid_for_storm.update({svc.tokens["storm"], svc.admin})
        before = storm_record(svc, qid)
        bases = {"lighthouse": lighthouse_bases(svc, agent, qid), "socket": socket_bases(),
                 "serve": serve_bases(svc)}
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
