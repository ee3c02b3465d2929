#!/usr/bin/env python3
"""An independent safetensors reader (json + numpy only) for the checkpoint tests.

Reads each shard file given, checks the layout the safetensors spec demands (8-byte little-endian
header length, a JSON object, data_offsets that cover the data with no holes), and prints one JSON
object: {"FILE": {"metadata": {...}, "tensors": {NAME: {"dtype", "shape", "values"}}}}.
"""
import json
import struct
import sys

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    at = 0
    for begin, end, name in spans:
        if begin != at:
            raise SystemExit(f"{path}: hole or overlap before {name}")
        at = end
    if at != len(data):
        raise SystemExit(f"{path}: data is {len(data)} bytes, header covers {at}")
    tensors = {}
    for name, v in header.items():
        begin, end = v["data_offsets"]
        raw = data[begin:end]
        if v["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(DTYPES[v["dtype"]]).newbyteorder("<"))
        arr = arr.reshape(v["shape"])
        tensors[name] = {"dtype": v["dtype"], "shape": list(arr.shape),
                         "values": [x.item() for x in arr.reshape(-1)]}
    return {"metadata": meta, "tensors": tensors, "data_start": 8 + n}


def main():
    print(json.dumps({p: read(p) for p in sys.argv[1:]}))


if __name__ == "__main__":
    main()
