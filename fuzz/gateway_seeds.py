#!/usr/bin/env python3
"""fuzz/gateway_seeds.py: the gateway_routes seed corpus, derived from the agent-to-lighthouse
traffic recorded in fuzz/corpus/lighthouse_routes/ (fuzz/record_corpus.sh).

Both targets decode an input the same way (fuzz/route_fuzz.h), and gateway_routes keeps
lighthouse_routes' paths 0..17 and tokens 0..5 at the same places, so a recorded call means the
same request here; the two lighthouse-only tokens (6: "secret-j" without "Bearer", 7: "bearer
root-token") carry no bearer token, so they become 0 (none). Each recorded call with the job's
token is also written with another job's token (k), with the gateway's own credential as if an
agent sent it, and as job k's own call (job j renamed k in the body, query or KV path, with k's
token); a few heartbeats carry a forged Lk-Gateway (the "gateway=" query parameter) and one an
oversized body. Run from the repository root; rewrites fuzz/corpus/gateway_routes/.
"""
import hashlib
import os
import shutil

SRC = "fuzz/corpus/lighthouse_routes"
DST = "fuzz/corpus/gateway_routes"
TOKEN_J, TOKEN_K, TOKEN_GATEWAY = 1, 6, 7
REMAP = {6: 0, 7: 0}
# Paths naming job j in gateway_routes' table, and their job-k counterparts.
PATH_TO_K = {5: 19, 16: 17}
HEARTBEAT, PATH_BITS = 0, 63


def with_token(data, token):
    return bytes([(data[0] & ~0x38) | (token << 3)]) + data[1:]


def renamed_to_k(data):
    b0, b1, rest = data[0], data[1], data[2:]
    path = b1 & PATH_BITS
    b1 = (b1 & ~PATH_BITS) | PATH_TO_K.get(path, path)
    suffix, _, after = rest.partition(b"\n")
    query, nl, body = after.partition(b"\n")
    query = query.replace(b"job=j", b"job=k")
    # The protobuf bodies name the job first (field 1, one byte), the JSON ones as "job":"j".
    if body.startswith(b"\n\x01j"):
        body = b"\n\x01k" + body[3:]
    body = body.replace(b'"job":"j"', b'"job":"k"')
    return bytes([b0, b1]) + suffix + b"\n" + query + nl + body


def main():
    seeds = []
    for name in sorted(os.listdir(SRC)):
        data = open(os.path.join(SRC, name), "rb").read()
        if len(data) < 2:
            continue
        token = (data[0] >> 3) & 7
        data = with_token(data, REMAP.get(token, token))
        seeds.append(data)
        if (data[0] >> 3) & 7 == TOKEN_J:
            seeds.append(with_token(data, TOKEN_K))
            seeds.append(with_token(data, TOKEN_GATEWAY))
            seeds.append(with_token(renamed_to_k(data), TOKEN_K))
            if data[1] & PATH_BITS == HEARTBEAT and data[2:4] == b"\n\n":
                # A forged Lk-Gateway on a heartbeat, as an agent might send it.
                seeds.append(data[:2] + b"\ngateway=gw-cred%20site-b\n" + data[4:])
    # The outer exchange's own routes (paths 24 /v1/exchange, 25 /v1/site): a round of one
    # member (answered at once), one of two sites (failed at the fixture's deadline), another
    # job's token, a body of no whole float, and the site's name.
    exchange = b"job=j&slot=0&quorum=1&seq=0&chunk=0&chunks=1&rank=0&timeout_ms=1000&"
    one_float = b"\x00\x00\x80?"
    post, get, untyped = 1, 0, 2 << 6
    seeds.append(bytes([post | (TOKEN_J << 3) | untyped, 24]) + b"\n" + exchange +
                 b"world=1&sites=site-a\n" + one_float)
    seeds.append(bytes([post | (TOKEN_J << 3) | untyped, 24]) + b"\n" + exchange +
                 b"world=2&sites=site-a,site-b\n" + one_float * 3)
    seeds.append(bytes([post | (TOKEN_K << 3) | untyped, 24]) + b"\n" + exchange +
                 b"world=1&sites=site-a\n" + one_float)
    seeds.append(bytes([post | (TOKEN_J << 3) | untyped, 24]) + b"\n" + exchange +
                 b"world=1&sites=site-b\nabc")
    seeds.append(bytes([get | (TOKEN_J << 3), 25]) + b"\njob=j\n")
    seeds.append(bytes([post | (TOKEN_J << 3) | untyped, 26]) + b"\n" + exchange +
                 b"world=2&sites=site-a,site-b&from=site-b&via=wan\n" + one_float)
    seeds.append(bytes([get, 11]) + b"\nvia=wan\n")
    seeds.append(bytes([post | (TOKEN_K << 3) | untyped, 26]) + b"\n" + exchange +
                 b"world=2&sites=site-a,site-b&from=site-b&via=wan\n" + one_float)
    # A JSON heartbeat over the gateway's body limit (the target's 2048 bytes).
    seeds.append(bytes([(TOKEN_J << 3) | 1, 0]) + b"\n\n{\"job\":\"j\"" + b" " * 2100 + b"}")
    shutil.rmtree(DST, ignore_errors=True)
    os.makedirs(DST)
    for s in seeds:
        with open(os.path.join(DST, hashlib.sha1(s).hexdigest()[:16]), "wb") as f:
            f.write(s)
    print(f"gateway_seeds: {len(set(seeds))} seeds in {DST}")


if __name__ == "__main__":
    main()
