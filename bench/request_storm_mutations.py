"""The requests of bench/request_storm.py: real requests of each listener (Base) and their
mutations. Python 3 standard library only."""

import json

from request_storm_wire import build_request, pb

# ---------------------------------------------------------------------------- the requests


class Base:
    """A real request before mutation. `body_fmt` is "json", "proto" or "raw"; `state` says what
    a valid copy with the right token would do ("change" for the lighthouse's job storm: such a
    request must be mutated into an invalid or unauthenticated one)."""

    def __init__(self, endpoint, method, path, query="", body=b"", ctype="", token=None,
                 changes=False, headers=()):
        self.endpoint, self.method, self.path, self.query = endpoint, method, path, query
        self.body, self.ctype, self.token, self.changes = body, ctype, token, changes
        self.headers = list(headers)


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
    shard = "/v1/shards/files/_/step-000000000001/shard-0.bin"
    return [
        Base("/v1/agent/status", "GET", "/v1/agent/status", token=t),
        Base("/v1/shards", "GET", shard, token=t, headers=[("Range", "bytes=0-99")]),
        Base("/v1/shards", "GET", shard, token=t, headers=[("Range", "bytes=-4096")]),
        Base("/v1/shards", "GET", "/v1/shards/files/g1/step-000000000002/shard-1.bin", token=t),
        Base("/v1/shards", "GET", "/v1/shards/checkpoints", token=t),
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


# The tokens that would make a request aimed at job storm valid (its job token, the admin's):
# filled in by the storm once the services run.
token_pool_valid_for_storm = set()


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
                                     ("Range", "bytes=5-2"), ("Range", "bytes=0-1,3-4"),
                                     ("Range", "bytes=18446744073709551615-"),
                                     ("Range", "bytes=-0"), ("Range", "items=0-1"),
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
    headers = [("Host", "storm")] + base.headers
    if ctype:
        headers.append(("Content-Type", ctype))
    if token:
        headers.append(("Authorization", f"Bearer {token}"))
    headers += extra
    headers.append(("Content-Length", str(len(body))))
    target = path + ("?" + query if query else "")
    try:
        data = build_request(method, target, headers, body)
    except UnicodeEncodeError:
        data = build_request(method, target.encode("utf-8").decode("latin-1"), headers, body)
    return Mutated(data, framed=True), "+".join(sorted(kinds))



def raw_mutation(base, rng, token_pool):
    """Framing-level damage: the request is sent on its own connection, then half-closed."""
    token = rng.choice(token_pool)
    headers = [("Host", "storm"), ("Content-Type", base.ctype or "application/json")] + base.headers
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
