#!/usr/bin/env python3
"""A recording relay for the route fuzzers' seed corpora.

record_relay.py LISTEN TARGET OUT_DIR TABLE

Listens on LISTEN ("127.0.0.1:PORT" or "unix:/path"), forwards every connection to TARGET (same
forms) byte for byte, and writes each HTTP request it sees from the client as one corpus file
in OUT_DIR, encoded as fuzz/route_fuzz.h decodes an input: the two choice bytes (method, token,
Content-Type; path, Accept) by the route table named TABLE (lighthouse, agent_socket,
agent_serve: the same tables as fuzz/lighthouse_routes_fuzz.cc, agent_socket_routes_fuzz.cc and
agent_serve_routes_fuzz.cc), then the path's rest, the query and the body.
Identical requests are written once (the file name is a hash of the content). Loopback only.
"""
import hashlib
import os
import socket
import sys
import threading
from urllib.parse import unquote

METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", ""]
TYPES = ["application/json", "application/x-protobuf", "", "text/plain"]
ACCEPTS = ["", "application/x-protobuf", "application/json", "*/*"]
# Kept equal to the targets' tables (fuzz/*_routes_fuzz.cc): the longest prefix wins.
TABLES = {
    "lighthouse": (["/v1/heartbeat", "/v1/quorum", "/v1/leave", "/v1/commit", "/v1/watch",
                    "/v1/kv/j/", "/v1/kv/", "/v1/kv", "/v1/checkpoints", "/status", "/metrics",
                    "/healthz", "/", "/v1/admin/drain", "/v1/admin/forget", "", "/v1/kv/j/1/",
                    "/v1/kv/k/0/"],
                   ["", "Bearer secret-j", "Bearer prom", "Bearer all-jobs", "Bearer root-token",
                    "Bearer wrong", "secret-j", "bearer root-token"]),
    "agent_socket": (["/v1/trainer/hello", "/v1/trainer/poll", "/v1/trainer/goodbye",
                      "/v1/trainer/checkpoint", "/v1/trainer/phase", "/v1/trainer/commit",
                      "/v1/trainer/notice", "/v1/trainer/kv/", "/v1/trainer/kv/1/",
                      "/v1/agent/status", "/healthz", "", "/v1/trainer/",
                      "/v1/shards/checkpoints"],
                     ["", "", "", "", "", "", "", ""]),
    "agent_serve": (["/healthz", "/v1/agent/status", "/v1/shards/checkpoints", "/v1/shards/files/",
                     "/v1/shards/files/rank-00000/step-000000000003/", "/v1/shards/",
                     "/v1/trainer/hello", "/v1/trainer/kv/1/", "", "/v1/shards/files/rank-00000/"],
                    ["", "Bearer secret-j", "Bearer wrong", "secret-j", "Bearer ", "bearer secret-j",
                     "Bearer secret-j ", "Basic c2VjcmV0LWo="]),
}
# A recorded run whose job is not "j" names it here, to be renamed "j" in JSON bodies, KV paths
# and queries: the targets' tokens are for job "j".
JOB_RENAME = os.environ.get("LK_RECORD_JOB", "")


def parse_addr(a):
    if a.startswith("unix:"):
        return socket.AF_UNIX, a[5:]
    host, port = a.rsplit(":", 1)
    return socket.AF_INET, (host, int(port))


def encode(table, method, target, headers, body):
    paths, tokens = TABLES[table]
    path, _, query = target.partition("?")
    path = unquote(path)
    if JOB_RENAME:
        body = body.replace(('"job":"%s"' % JOB_RENAME).encode(), b'"job":"j"')
        path = path.replace("/v1/kv/%s/" % JOB_RENAME, "/v1/kv/j/")
        query = query.replace("job=%s" % JOB_RENAME, "job=j")
    best = max((i for i, p in enumerate(paths) if path.startswith(p)), key=lambda i: len(paths[i]))
    m = METHODS.index(method) if method in METHODS else 7
    auth = headers.get("authorization", "")
    tok = tokens.index(auth) if auth in tokens else 0
    ct = headers.get("content-type", "")
    c = TYPES.index(ct) if ct in TYPES else 3
    acc = headers.get("accept", "")
    a = ACCEPTS.index(acc) if acc in ACCEPTS else 0
    if table == "agent_serve" and headers.get("range"):
        # The target reads the Range header from the query's "range" parameter.
        query = (query + "&" if query else "") + "range=" + headers["range"]
    b0 = m | (tok << 3) | (c << 6)
    b1 = best | (a << 6)
    return bytes([b0, b1]) + path[len(paths[best]):].encode() + b"\n" + query.encode() + b"\n" + body


class Recorder:
    def __init__(self, out, table):
        self.out, self.table, self.buf = out, table, b""

    def feed(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            n = int(headers.get("content-length", "0"))
            if len(self.buf) < end + 4 + n:
                return
            body = self.buf[end + 4:end + 4 + n]
            self.buf = self.buf[end + 4 + n:]
            parts = head[0].split(" ")
            if len(parts) < 2:
                continue
            data = encode(self.table, parts[0], parts[1], headers, body)
            name = hashlib.sha1(data).hexdigest()[:16]
            with open(os.path.join(self.out, name), "wb") as f:
                f.write(data)


def pump(src, dst, recorder):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            if recorder:
                recorder.feed(data)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main():
    listen, target, out, table = sys.argv[1:5]
    os.makedirs(out, exist_ok=True)
    fam, addr = parse_addr(listen)
    srv = socket.socket(fam, socket.SOCK_STREAM)
    if fam == socket.AF_INET:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(addr)
    srv.listen(128)
    print("relay_listening", flush=True)
    tfam, taddr = parse_addr(target)
    while True:
        c, _ = srv.accept()
        t = socket.socket(tfam, socket.SOCK_STREAM)
        try:
            t.connect(taddr)
        except OSError:
            c.close()
            t.close()
            continue
        threading.Thread(target=pump, args=(c, t, Recorder(out, table)), daemon=True).start()
        threading.Thread(target=pump, args=(t, c, None), daemon=True).start()


if __name__ == "__main__":
    main()
