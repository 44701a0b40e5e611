#!/usr/bin/env python3
"""Checks kernels/cuda/gguf_gemv.cu's indexing without a GPU: each lane's work of the Q4_K and
Q6_K GEMV (which bytes, which 8-bit inputs, which scales), emulated with numpy as the kernel
does it, against the gguf package's dequantization of the same blocks times the same 8-bit
inputs. A check to run before spending device time on a change to the kernel; the kernel itself
is tested on the GPU by crates/peregrine-tensor/tests/gguf_cuda.rs.

usage: python3 scripts/cuda/emulate_gguf_gemv.py   (needs numpy and gguf)
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

rng = np.random.default_rng(7)


def split_q8(x):
    """q8_split: int8 codes and, per 32 inputs, (d8, d8 * sum of codes)."""
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1) / 127.0
    codes = np.where(d[:, None] == 0, 0, np.round(blocks / np.where(d == 0, 1, d)[:, None]))
    codes = codes.astype(np.int32)
    return codes.reshape(-1), np.stack([d, d * codes.sum(axis=1)], axis=1)


def scale_min(j, q):
    lo = j & 3
    a, b, c = int(q[lo]), int(q[lo + 4]), int(q[lo + 8])
    if j >= 4:
        return (c & 0xF) | ((a >> 6) << 4), (c >> 4) | ((b >> 6) << 4)
    return a & 63, b & 63


def q4k_row(row, codes, ds):
    acc = 0.0
    for b in range(len(row) // 144):
        blk = row[144 * b:144 * (b + 1)]
        d = float(blk[0:2].view(np.float16)[0])
        dmin = float(blk[2:4].view(np.float16)[0])
        for part in range(8):
            pair, half = part >> 1, part & 1
            raw = blk[16 + 16 * part:32 + 16 * part].astype(np.int32)
            sc_l, m_l = scale_min(2 * pair, blk[4:16])
            sc_h, m_h = scale_min(2 * pair + 1, blk[4:16])
            sl, ml, sh, mh = d * sc_l, dmin * m_l, d * sc_h, dmin * m_h
            if half:
                ml = mh = 0.0
            at = 256 * b + 64 * pair + 16 * half
            dot_l = int(((raw & 0xF) * codes[at:at + 16]).sum())
            dot_h = int(((raw >> 4) * codes[at + 32:at + 48]).sum())
            s = ds[8 * b + 2 * pair:8 * b + 2 * pair + 2].reshape(-1)
            acc += sl * s[0] * dot_l - ml * s[1] + sh * s[2] * dot_h - mh * s[3]
    return acc


def q6k_row(row, codes, ds):
    acc = 0.0
    for b in range(len(row) // 210):
        blk = row[210 * b:210 * (b + 1)]
        d = float(blk[208:210].view(np.float16)[0])
        for part in range(8):
            n, l0 = part >> 2, 8 * (part & 3)
            lo = blk[64 * n + l0:64 * n + l0 + 8].astype(np.int32)
            hi = blk[64 * n + 32 + l0:64 * n + 40 + l0].astype(np.int32)
            hb = blk[128 + 32 * n + l0:136 + 32 * n + l0].astype(np.int32)
            base = 192 + 8 * n + (l0 >> 4)
            sc = blk[base:base + 8:2].view(np.int8).astype(np.float64)
            v = [(lo & 0xF) | ((hb & 3) << 4), (hi & 0xF) | (((hb >> 2) & 3) << 4),
                 (lo >> 4) | (((hb >> 4) & 3) << 4), (hi >> 4) | (((hb >> 6) & 3) << 4)]
            for g in range(4):
                at = 256 * b + 128 * n + 32 * g + l0
                dot = int(((v[g] - 32) * codes[at:at + 8]).sum())
                acc += d * sc[g] * ds[8 * b + 4 * n + g][0] * dot
    return acc


def random_blocks(kind, out, k):
    """Random codes and scales, f16 d (and dmin) small and finite."""
    size, at = {T.Q4_K: (144, (0, 2)), T.Q6_K: (210, (208,))}[kind]
    q = rng.integers(0, 256, (out, k // 256, size), dtype=np.uint8)
    for o in at:
        d = rng.uniform(1e-3, 1e-2, (out, k // 256)).astype(np.float16)
        q[:, :, o:o + 2] = d.view(np.uint8).reshape(out, k // 256, 2)
    return q.reshape(out, -1)


def check(kind, row_fn, out, k):
    q = random_blocks(kind, out, k)
    ref_w = quants.dequantize(q, kind).reshape(out, k).astype(np.float64)
    x = rng.standard_normal(k).astype(np.float32)
    codes, ds = split_q8(x)
    x_q = (codes.reshape(-1, 32) * ds[:, :1]).reshape(-1)
    want = ref_w @ x_q
    got = np.array([row_fn(q[r], codes, ds) for r in range(out)])
    worst = np.abs(got - want).max() / np.abs(want).max()
    print(f"{kind.name} {out}x{k}: largest difference {worst:.1e} of the largest output")
    return worst < 1e-9


ok = all([check(T.Q4_K, q4k_row, 16, 512), check(T.Q6_K, q6k_row, 16, 512)])
sys.exit(0 if ok else 1)
