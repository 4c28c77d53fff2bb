"""A minimal .safetensors reader and writer for the tests (8-byte little-endian header length,
JSON header, raw little-endian data), independent of posenc."""

import json
import struct

import numpy as np

_DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "I32": np.int32,
           "F16": np.float16}
_NAMES = {np.dtype(v).str: k for k, v in _DTYPES.items()}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        data = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _NAMES[a.dtype.str], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b],
                                  dtype=_DTYPES[t["dtype"]]).reshape(t["shape"])
    return out
