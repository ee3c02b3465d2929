"""Bytes on the wire for bench/request_storm.py: protobuf written by hand (no generated code is
needed), requests built byte by byte, and a client connection that reads whole HTTP/1.1 answers
and says when one is not well-formed. Python 3 standard library only."""

import json
import os
import re
import socket

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
