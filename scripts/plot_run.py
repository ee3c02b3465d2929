#!/usr/bin/env python3
"""Plots loss against outer step for a Lightkeeper run, with membership changes marked, as a
PNG, using only the standard library (zlib for the PNG encoding), so the demo needs no plotting
package. Inputs: the trainers' --log JSON lines (one per committed outer step) and an optional
events file of "STEP LABEL" lines (a kill, a join) to mark as vertical lines.

usage: plot_run.py OUT.png EVENTS_FILE_OR_- LOG.jsonl [LOG.jsonl ...] [--reference REF.jsonl]
"""
import json
import struct
import sys
import zlib

W, H = 900, 500
L, R, T, B = 70, 20, 30, 50  # margins

# A 5x7 bitmap font (digits, lower-case letters, a few signs): axis labels and legends.
FONT = {
    "0": "01110100011001110101110011000101110", "1": "00100011000010000100001000010001110",
    "2": "01110100010000100010001000100011111", "3": "11111000100010000010000011000101110",
    "4": "00010001100101010010111110001000010", "5": "11111100001111000001000011000101110",
    "6": "00110010001000011110100011000101110", "7": "11111000010001000100010000100001000",
    "8": "01110100011000101110100011000101110", "9": "01110100011000101111000010001001100",
    ".": "00000000000000000000000000110001100", "-": "00000000000000011111000000000000000",
    " ": "0" * 35,
}
for _ch, _rows in {
    'a': ['     ', '     ', ' ### ', '    #', ' ####', '#   #', ' ####'],
    'b': ['#    ', '#    ', '#### ', '#   #', '#   #', '#   #', '#### '],
    'c': ['     ', '     ', ' ####', '#    ', '#    ', '#    ', ' ####'],
    'd': ['    #', '    #', ' ####', '#   #', '#   #', '#   #', ' ####'],
    'e': ['     ', '     ', ' ### ', '#   #', '#####', '#    ', ' ####'],
    'f': ['  ## ', ' #   ', '#### ', ' #   ', ' #   ', ' #   ', ' #   '],
    'g': ['     ', ' ####', '#   #', '#   #', ' ####', '    #', ' ### '],
    'h': ['#    ', '#    ', '#### ', '#   #', '#   #', '#   #', '#   #'],
    'i': ['  #  ', '     ', ' ##  ', '  #  ', '  #  ', '  #  ', ' ### '],
    'j': ['   # ', '     ', '  ## ', '   # ', '   # ', '#  # ', ' ##  '],
    'k': ['#    ', '#    ', '#  # ', '# #  ', '##   ', '# #  ', '#  # '],
    'l': [' ##  ', '  #  ', '  #  ', '  #  ', '  #  ', '  #  ', ' ### '],
    'm': ['     ', '     ', '## # ', '# # #', '# # #', '# # #', '#   #'],
    'n': ['     ', '     ', '#### ', '#   #', '#   #', '#   #', '#   #'],
    'o': ['     ', '     ', ' ### ', '#   #', '#   #', '#   #', ' ### '],
    'p': ['     ', '     ', '#### ', '#   #', '#### ', '#    ', '#    '],
    'q': ['     ', ' ####', '#   #', '#   #', ' ####', '    #', '    #'],
    'r': ['     ', '     ', '# ## ', '##   ', '#    ', '#    ', '#    '],
    's': ['     ', '     ', ' ####', '#    ', ' ### ', '    #', '#### '],
    't': [' #   ', ' #   ', '#### ', ' #   ', ' #   ', ' #  #', '  ## '],
    'u': ['     ', '     ', '#   #', '#   #', '#   #', '#  ##', ' ## #'],
    'v': ['     ', '     ', '#   #', '#   #', '#   #', ' # # ', '  #  '],
    'w': ['     ', '     ', '#   #', '#   #', '# # #', '# # #', ' # # '],
    'x': ['     ', '     ', '#   #', ' # # ', '  #  ', ' # # ', '#   #'],
    'y': ['     ', '#   #', '#   #', ' ####', '    #', '#   #', ' ### '],
    'z': ['     ', '     ', '#####', '   # ', '  #  ', ' #   ', '#####'],
    '_': ['     ', '     ', '     ', '     ', '     ', '     ', '#####'],
    '=': ['     ', '     ', '#####', '     ', '#####', '     ', '     '],
    '/': ['    #', '   # ', '   # ', '  #  ', ' #   ', ' #   ', '#    '],
    ':': ['     ', ' ##  ', ' ##  ', '     ', ' ##  ', ' ##  ', '     '],
    '(': ['   # ', '  #  ', ' #   ', ' #   ', ' #   ', '  #  ', '   # '],
    ')': [' #   ', '  #  ', '   # ', '   # ', '   # ', '  #  ', ' #   '],
    '%': ['##   ', '##  #', '   # ', '  #  ', ' #   ', '#  ##', '   ##'],
    '+': ['     ', '  #  ', '  #  ', '#####', '  #  ', '  #  ', '     '],
}.items():
    FONT[_ch] = "".join("1" if c == "#" else "0" for c in "".join(_rows))


def blank():
    return [[(255, 255, 255) for _ in range(W)] for _ in range(H)]


def put(img, x, y, c):
    if 0 <= x < W and 0 <= y < H:
        img[y][x] = c


def line(img, x0, y0, x1, y1, c, width=1):
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    err = dx + dy
    while True:
        for ox in range(-(width // 2), width // 2 + 1):
            for oy in range(-(width // 2), width // 2 + 1):
                put(img, x0 + ox, y0 + oy, c)
        if x0 == x1 and y0 == y1:
            return
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x0 += sx
        if e2 <= dx:
            err += dx
            y0 += sy


def text(img, x, y, s, c=(60, 60, 60)):
    for i, ch in enumerate(s.lower()):
        g = FONT.get(ch, FONT[" "])
        for k, bit in enumerate(g):
            if bit == "1":
                put(img, x + i * 6 + k % 5, y + k // 5, c)


def png(img, path):
    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in img)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def read_losses(paths):
    by_step = {}
    for p in paths:
        with open(p) as f:
            for ln in f:
                try:
                    d = json.loads(ln)
                except ValueError:
                    continue
                if "step" in d and "loss" in d:
                    by_step.setdefault(d["step"], []).append(d["loss"])
    return sorted((s, sum(v) / len(v)) for s, v in by_step.items())


def main(argv):
    if len(argv) < 4:
        sys.exit(__doc__)
    out, events_path, rest = argv[1], argv[2], argv[3:]
    ref_paths = []
    if "--reference" in rest:
        i = rest.index("--reference")
        ref_paths, rest = rest[i + 1:], rest[:i]
    run, ref = read_losses(rest), read_losses(ref_paths)
    events = []
    if events_path != "-":
        with open(events_path) as f:
            for ln in f:
                parts = ln.split(None, 1)
                if parts:
                    events.append((float(parts[0]), parts[1].strip() if len(parts) > 1 else ""))
    pts = run + ref
    if not pts:
        sys.exit("no loss lines in the logs")
    smax = max(s for s, _ in pts) or 1
    lmin, lmax = min(v for _, v in pts), max(v for _, v in pts)
    if lmax == lmin:
        lmax = lmin + 1
    X = lambda s: int(L + (W - L - R) * s / smax)
    Y = lambda v: int(H - B - (H - T - B) * (v - lmin) / (lmax - lmin))
    img = blank()
    line(img, L, H - B, W - R, H - B, (0, 0, 0))
    line(img, L, T, L, H - B, (0, 0, 0))
    for k in range(5):
        v = lmin + (lmax - lmin) * k / 4
        text(img, 5, Y(v) - 3, f"{v:.2f}")
        s = smax * k / 4
        text(img, X(s) - 6, H - B + 8, f"{s:.0f}")
    text(img, W // 2 - 40, H - 18, "outer step")
    text(img, 5, 10, "loss")
    for s, label in events:
        for y in range(T, H - B, 6):
            line(img, X(s), y, X(s), y + 3, (200, 60, 60))
        text(img, X(s) + 3, T + 2, label[:18], (200, 60, 60))
    for series, color in ((ref, (150, 150, 150)), (run, (30, 90, 200))):
        for (s0, v0), (s1, v1) in zip(series, series[1:]):
            line(img, X(s0), Y(v0), X(s1), Y(v1), color, 2)
    # Legend at the lower left: a falling loss curve leaves that corner empty, and the top is
    # where the event labels go.
    text(img, L + 10, H - B - 28, "run", (30, 90, 200))
    if ref:
        text(img, L + 10, H - B - 16, "failure-free reference", (150, 150, 150))
    png(img, out)


if __name__ == "__main__":
    main(sys.argv)
