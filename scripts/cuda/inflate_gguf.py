#!/usr/bin/env python3
"""A deep GGUF file from a shallow one: layer i of the output is layer i % L of the input (L its
layers), every other tensor and key copied, `<arch>.block_count` set to the new depth.

usage: inflate_gguf.py IN OUT --layers N

Why: a full-depth random checkpoint of a large MoE (Qwen3-30B-A3B: ~61 GB in bf16) and a GGUF
copy of it do not fit a GPU machine's 64 GB disk, but a 2-layer one quantized there (make_shaped.py
--layers 2, `peregrine quantize`, llama-quantize) and inflated to 48 layers does, with every
layer's bytes where a real file has them. Weights repeat every L layers, so the speed is a real
model's of that shape; the outputs mean nothing. llama-quantize's Q4_K_M gives some layers more
bits than others by their index; an inflated file repeats the shallow file's choice instead.
Needs only the Python standard library.
"""
import argparse
import re
import struct
import sys

# GGUF value types: struct format of the fixed-size ones.
FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
         11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
LAYER = re.compile(r"^blk\.(\d+)\.(.*)$")


class Reader:
    def __init__(self, f):
        self.f = f

    def take(self, fmt):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.f.read(size))[0]

    def string(self):
        return self.f.read(self.take("<Q"))

    def value(self, kind):
        """A value as raw bytes, so it is written back exactly as read."""
        if kind in FIXED:
            return self.f.read(struct.calcsize(FIXED[kind]))
        if kind == STRING:
            s = self.string()
            return struct.pack("<Q", len(s)) + s
        if kind == ARRAY:
            inner, count = self.take("<I"), self.take("<Q")
            parts = [self.value(inner) for _ in range(count)]
            return struct.pack("<IQ", inner, count) + b"".join(parts)
        sys.exit(f"unknown GGUF value type {kind}")


def read_header(f):
    r = Reader(f)
    if f.read(4) != b"GGUF":
        sys.exit("not a GGUF file")
    version = r.take("<I")
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    kvs = []
    for _ in range(n_kv):
        key = r.string()
        kind = r.take("<I")
        kvs.append((key, kind, r.value(kind)))
    tensors = []
    for _ in range(n_tensors):
        name = r.string().decode()
        dims = [r.take("<Q") for _ in range(r.take("<I"))]
        kind, offset = r.take("<I"), r.take("<Q")
        tensors.append([name, dims, kind, offset])
    return version, kvs, tensors, f.tell()


def pad(n, align):
    return (align - n % align) % align


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--layers", type=int, required=True)
    a = ap.parse_args()
    with open(a.input, "rb") as f:
        version, kvs, tensors, header_end = read_header(f)
        keys = {k.decode(): (kind, v) for k, kind, v in kvs}
        align = struct.unpack("<I", keys["general.alignment"][1])[0] \
            if "general.alignment" in keys else 32
        arch = keys["general.architecture"][1][8:].decode()
        data_start = header_end + pad(header_end, align)
        end = f.seek(0, 2)
        # Each tensor's bytes run to the next one's offset (the padding between them included).
        by_offset = sorted(tensors, key=lambda t: t[3])
        sizes = {}
        for t, nxt in zip(by_offset, by_offset[1:] + [None]):
            sizes[t[0]] = (nxt[3] if nxt else end - data_start) - t[3]
        shallow = 1 + max(int(m.group(1)) for t in tensors if (m := LAYER.match(t[0])))
        plan = [(t[0], t) for t in tensors if not LAYER.match(t[0])]
        for i in range(a.layers):
            for t in tensors:
                m = LAYER.match(t[0])
                if m and int(m.group(1)) == i % shallow:
                    plan.append((f"blk.{i}.{m.group(2)}", t))
        with open(a.output, "wb") as out:
            out.write(b"GGUF" + struct.pack("<IQQ", version, len(plan), len(kvs)))
            for key, kind, value in kvs:
                if key.decode() == f"{arch}.block_count":
                    value = struct.pack(FIXED[kind], a.layers)
                out.write(struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + value)
            offset = 0
            for name, (source, dims, kind, _) in plan:
                raw = name.encode()
                out.write(struct.pack("<Q", len(raw)) + raw + struct.pack("<I", len(dims)))
                out.write(struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, offset))
                offset += sizes[source] + pad(sizes[source], align)
            out.write(b"\0" * pad(out.tell(), align))
            for n, (name, t) in enumerate(plan):
                f.seek(data_start + t[3])
                left = sizes[t[0]]
                while left:
                    chunk = f.read(min(left, 1 << 26))
                    out.write(chunk)
                    left -= len(chunk)
                out.write(b"\0" * pad(sizes[t[0]], align))
                if n % 50 == 0:
                    print(f"\r{n + 1}/{len(plan)} tensors", end="", file=sys.stderr, flush=True)
            print(f"\rwrote {a.output}: {a.layers} layers from {shallow}, {out.tell() / 1e9:.2f} GB",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
