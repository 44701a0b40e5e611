#!/usr/bin/env python3
"""A bounded, loopback-only load and abuse test for `peregrine serve` (standard library only).

Usage: scripts/loadtest.py --url http://127.0.0.1:PORT [--pid SERVER_PID] [--server-log FILE]
           [--clients 64] [--duration 600] [--slowloris 200] [--header-timeout 10] ...
       (--help lists every option and its default)

Each of --clients loops sends requests back to back until --duration is over, each one picked at
random: a streamed chat read to `data: [DONE]` (35), a whole chat (15), an early disconnect (15),
a slow reader, 64 bytes per 50 ms (10), a body over --max-body-bytes, by Content-Length or
chunked: 413 (10), a malformed body: 400 with an OpenAI error object (10), GET /health,
/v1/models or /metrics (5). 503 and 429 (queue full) are fine. Meanwhile --slowloris connections
send their headers a byte every 1-2 s, never ending them: the server must close each within
--header-timeout + 5 s. --pid samples the server's VmRSS every 2 s; --server-log is scanned for
`panicked` afterwards. HTTP/1.1 is spoken by hand over asyncio streams.

Prints one JSON summary on stdout (also to --json-out), progress on stderr every 10 s. Exits 0
iff no request hung (past --request-deadline), failed to connect or read, or got an unexpected
answer, no slow-loris connection was overdue, the log holds no panic, and the RSS after
--warmup-frac of the run stayed within baseline * (1 + rss-slack-frac) + rss-slack-mb.
It ends within duration + request-deadline + ~10 s.
"""
import argparse
import asyncio
import ipaddress
import json
import random
import socket
import statistics
import struct
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

CHAT = "/v1/chat/completions"
BUSY = (503, 429)
FINISH = ("stop", "length")
KINDS = {"stream": 35, "whole": 15, "disconnect": 15, "slow_reader": 10, "oversized": 10,
         "malformed": 10, "get": 5}
FINE = ("ok", "busy", "oversized_reset")  # outcomes that are no failure
NET_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)
SUBJECTS = ["the moon", "a small dog", "rain", "the ocean", "fresh bread", "a red bicycle",
            "winter", "music", "a quiet library", "mountains", "trains", "the number seven"]
TEMPLATES = ["Tell me a short story about {}.", "Describe {} in one sentence.",
             "Why do people like {}?", "Write a haiku about {}.", "What is {}?",
             "Give three facts about {}."]


@dataclass
class Stats:
    requests: int = 0
    tokens_streamed: int = 0
    outcomes: Counter = field(default_factory=Counter)
    kinds: dict = field(default_factory=lambda: defaultdict(Counter))
    status_counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=lambda: {"error": [], "unexpected": []})
    loris: Counter = field(default_factory=Counter)  # opened, closed_by_server, overdue, ...
    loris_close_s: list = field(default_factory=list)
    rss: list = field(default_factory=list)  # [seconds since the start, MB]
    server_gone: bool = False

    def record(self, kind, outcome, status=None, detail=None):
        self.kinds[kind][outcome] += 1
        self.outcomes[outcome] += 1
        if status is not None:
            self.status_counts[str(status)] += 1
        if outcome in self.examples and len(self.examples[outcome]) < 10:
            self.examples[outcome].append({"kind": kind, "status": status,
                                           "detail": str(detail)[:300]})

    @property
    def ok(self):
        return sum(self.outcomes[o] for o in FINE)


@dataclass
class Ctx:
    args: argparse.Namespace
    addr: tuple  # (host, port) to connect to
    host_header: str
    stats: Stats = field(default_factory=Stats)
    start: float = 0.0

    def now(self):
        return asyncio.get_running_loop().time() - self.start


def loopback_target(url):
    """((address, port), Host header) for an http URL on loopback; exits on anything else."""
    u = urlsplit(url)
    if u.scheme != "http" or u.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"loadtest: refusing {url!r}: only http://127.0.0.1, localhost or [::1]")
    infos = socket.getaddrinfo(u.hostname, u.port or 80, type=socket.SOCK_STREAM)
    if not infos or not all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos):
        sys.exit(f"loadtest: {u.hostname} does not resolve to loopback only")
    best = min(infos, key=lambda i: i[0] != socket.AF_INET)  # IPv4 first
    return (best[4][0], u.port or 80), u.netloc


# ---------------------------------------------------------------- HTTP/1.1 by hand

async def connect(ctx, slow=False):
    """A connection; a slow one has a tiny receive buffer, so the server feels the backpressure."""
    reader, writer = await asyncio.open_connection(*ctx.addr, limit=1024 if slow else 65536)
    if slow:
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return reader, writer


def head(ctx, method, path, length=None, close=True, extra=()):
    lines = [f"{method} {path} HTTP/1.1", f"Host: {ctx.host_header}"]
    lines += ["Content-Type: application/json"] if method == "POST" else []
    lines += [f"Content-Length: {length}"] if length is not None else []
    lines += [*extra, *(["Connection: close"] if close else [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def open_request(ctx, body, slow=False):
    """A POST of body to the chat route, sent whole."""
    reader, writer = await connect(ctx, slow)
    writer.write(head(ctx, "POST", CHAT, len(body)) + body)
    await writer.drain()
    return reader, writer


def abort(writer, rst=False):
    """Closes at once; with rst, as a reset (SO_LINGER 0)."""
    try:
        if rst:
            linger = struct.pack("ii", 1, 0)
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    except OSError:
        pass  # already closed
    writer.transport.abort()


async def read_head(reader):
    """(status, headers with lower-case names); skips 1xx answers."""
    while True:
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ValueError(f"bad status line {lines[0]!r}")
        fields = (line.partition(":") for line in lines[1:])
        headers = {name.strip().lower(): value.strip() for name, _, value in fields if name}
        if not 100 <= int(rest[:3]) < 200:
            return int(rest[:3]), headers


class Body:
    """One response body (chunked, Content-Length or up to EOF), whole or as SSE events."""

    def __init__(self, reader, headers):
        self.r, self.buf, self.done = reader, b"", False
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.left = -1 if self.chunked else int(headers.get("content-length", -1))

    async def piece(self):
        """The next bytes of the body; b"" at its end."""
        if self.done or self.left == 0:
            self.done = True
            return b""
        if self.chunked:
            size = int((await self.r.readuntil(b"\r\n")).split(b";")[0], 16)
            while size == 0 and await self.r.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            self.done = size == 0
            return (await self.r.readexactly(size + 2))[:-2] if size else b""
        data = await self.r.read(65536 if self.left < 0 else min(self.left, 65536))
        if not data and self.left > 0:
            raise asyncio.IncompleteReadError(b"", self.left)
        self.left -= len(data) if self.left > 0 else 0
        self.done = not data
        return data

    async def all(self, tolerant=False):
        """The whole body; tolerant: what came of it before the server hung up."""
        out = bytearray()
        try:
            while piece := await self.piece():
                out += piece
        except NET_ERRORS:
            if not tolerant:
                raise
        return bytes(out)

    async def event(self):
        """The next SSE event's text, or None when the body ends."""
        while b"\n\n" not in self.buf:
            if not (piece := await self.piece()):
                return None
            self.buf += piece
        event, self.buf = self.buf.split(b"\n\n", 1)
        return event.decode("utf-8", "replace")


def json_obj(raw):
    """raw as a JSON object, or {}."""
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def is_openai_error(raw):
    err = json_obj(raw).get("error")
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= err.keys()


async def busy(reader, headers, status):
    await Body(reader, headers).all(tolerant=True)  # closing after a 503 is fine
    return "busy", status, None


# ---------------------------------------------------------------- request kinds

def chat_body(ctx, rng, stream, encode=True):
    prompt = rng.choice(TEMPLATES).format(rng.choice(SUBJECTS))
    body = {"messages": [{"role": "user", "content": prompt}],
            "max_tokens": rng.randint(1, ctx.args.max_tokens), "stream": stream, "temperature": 0.8}
    body.update({"model": ctx.args.model} if ctx.args.model else {})
    return json.dumps(body).encode() if encode else body


async def check_stream(ctx, body, status):
    finish = None
    while (event := await body.event()) is not None:
        for data in (line[5:].strip() for line in event.split("\n") if line.startswith("data:")):
            if data == "[DONE]":  # (lines other than data: are comments, `: keep-alive`)
                if finish in FINISH:
                    return "ok", status, None
                return "unexpected", status, f"[DONE] after finish_reason {finish!r}"
            chunk = json_obj(data)
            if not chunk or "error" in chunk:
                return "unexpected", status, f"stream event {data[:200]!r}"
            for choice in chunk.get("choices") or []:
                ctx.stats.tokens_streamed += bool((choice.get("delta") or {}).get("content"))
                finish = choice.get("finish_reason") or finish
    return "error", status, "the stream ended without data: [DONE]"


async def throttle(src, dst, nbytes=64, pause=0.05):
    try:
        while data := await src.read(nbytes):
            dst.feed_data(data)
            await asyncio.sleep(pause)
        dst.feed_eof()
    except OSError as e:
        dst.set_exception(e)


async def act_chat(ctx, rng, stream=True, slow=False):
    reader, writer = await open_request(ctx, chat_body(ctx, rng, stream), slow)
    pump = None
    try:
        if slow:  # read through a pump that takes 64 bytes per 50 ms
            reader, src = asyncio.StreamReader(), reader
            pump = asyncio.ensure_future(throttle(src, reader))
        status, headers = await read_head(reader)
        if status in BUSY:
            return await busy(reader, headers, status)
        if stream and status == 200:
            return await check_stream(ctx, Body(reader, headers), status)
        raw = await Body(reader, headers).all(tolerant=status != 200)
        choice = (json_obj(raw).get("choices") or [None])[0]
        if status == 200 and isinstance(choice, dict) and choice.get("finish_reason") in FINISH:
            return "ok", status, None
        return "unexpected", status, raw[:200]
    finally:
        if pump:
            pump.cancel()
        writer.close()


async def act_disconnect(ctx, rng):
    """Vanishes midway through the body, before the status line, or after 0-5 events."""
    body, mode = chat_body(ctx, rng, True), rng.random()
    reader, writer = await connect(ctx)
    try:
        cut = len(body) // 2 if mode < 0.15 else None  # vanish halfway through the body
        writer.write(head(ctx, "POST", CHAT, len(body)) + body[:cut])
        await writer.drain()
        if mode < 0.35:  # or before the status line
            await asyncio.sleep(rng.uniform(0, 0.5))
            return "ok", None, None
        status, headers = await read_head(reader)
        stream = Body(reader, headers)
        for _ in range(rng.randint(0, 5) if status == 200 else 0):
            if await stream.event() is None:
                break
        return "ok", status, None
    except NET_ERRORS:
        return "ok", None, None
    finally:
        abort(writer, rst=rng.random() < 0.5)


async def send_filler(writer, total, chunked):
    """Sends a body of total bytes; stops quietly when the server hangs up."""
    prefix, sent = b'{"messages":[{"role":"user","content":"', 0
    try:
        while sent < total:
            n = min(65536, total - sent)
            data = (prefix + b"a" * n)[:n] if sent == 0 else b"a" * n
            writer.write(b"%x\r\n%s\r\n" % (n, data) if chunked else data)
            sent += n
            await writer.drain()
        writer.write(b"0\r\n\r\n" if chunked else b"")
        await writer.drain()
    except OSError:
        pass


async def act_oversized(ctx, rng):
    limit, chunked = ctx.args.max_body_bytes, rng.random() < 0.4
    reader, writer = await connect(ctx)
    framing = ["Transfer-Encoding: chunked"] if chunked else []
    writer.write(head(ctx, "POST", CHAT, None if chunked else limit + 1, extra=framing))
    sender = asyncio.ensure_future(send_filler(writer, limit + 1, chunked))
    try:
        try:
            status, headers = await read_head(reader)
        except NET_ERRORS:
            return "oversized_reset", None, None
        if status != 413:
            return "unexpected", status, f"{framing or 'Content-Length'} body over the limit"
        await Body(reader, headers).all(tolerant=True)  # a reset after the 413 is fine
        return "ok", status, None
    finally:
        sender.cancel()
        abort(writer)


def malformed_body(ctx, rng):
    good = chat_body(ctx, rng, False, encode=False)
    text = json.dumps(good).encode()
    variants = {
        "garbage": lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 512))),
        "truncated": lambda: text[: rng.randint(1, len(text) - 1)],
        "deep_nesting": lambda: b"[" * min(100_000, ctx.args.max_body_bytes // 2),
        "array_body": lambda: [good],
        "messages_5": lambda: {**good, "messages": 5},
        "messages_empty": lambda: {**good, "messages": []},
        "bad_role": lambda: {**good, "messages": [{"role": "wizard", "content": "hi"}]},
        "max_tokens_x": lambda: {**good, "max_tokens": "x"},
        "max_tokens_0": lambda: {**good, "max_tokens": 0},
        "temperature_str": lambda: {**good, "temperature": "hot"},
        "stream_str": lambda: {**good, "stream": "yes"},
        "stop_int": lambda: {**good, "stop": 7},
    }
    if ctx.args.max_body_bytes > 8192:  # a huge stop string, within the body limit
        n = min(1 << 20, ctx.args.max_body_bytes - 4096)
        variants["stop_1mb"] = lambda: {**good, "stop": "a" * n}
    name = rng.choice(sorted(variants))
    body = variants[name]()
    return name, body if isinstance(body, bytes) else json.dumps(body).encode()


async def act_malformed(ctx, rng):
    name, body = malformed_body(ctx, rng)
    reader, writer = await open_request(ctx, body)
    try:
        status, headers = await read_head(reader)
        raw = await Body(reader, headers).all(tolerant=True)
        if status == 400 and is_openai_error(raw):
            return "ok", status, None
        return "unexpected", status, f"malformed {name}: {raw[:200]!r}"
    finally:
        writer.close()


async def act_get(ctx, rng):
    paths = rng.sample(["/health", "/v1/models", "/metrics"], rng.choice([1, 1, 2]))
    reader, writer = await connect(ctx)
    try:
        for i, path in enumerate(paths):  # two: both on one keep-alive connection
            writer.write(head(ctx, "GET", path, close=i == len(paths) - 1))
            status, headers = await read_head(reader)
            raw = await Body(reader, headers).all()
            if status != 200:
                return "unexpected", status, f"GET {path}: {raw[:200]!r}"
        return "ok", status, None
    finally:
        writer.close()


ACTIONS = {"stream": act_chat, "whole": lambda ctx, rng: act_chat(ctx, rng, stream=False),
           "slow_reader": lambda ctx, rng: act_chat(ctx, rng, slow=True),
           "disconnect": act_disconnect, "oversized": act_oversized, "malformed": act_malformed,
           "get": act_get}


async def client_loop(ctx, rng):
    s, names = ctx.stats, list(KINDS)
    while ctx.now() < ctx.args.duration and s.requests < ctx.args.max_requests:
        kind = rng.choices(names, weights=[KINDS[k] for k in names])[0]
        s.requests += 1
        try:
            outcome, status, detail = await asyncio.wait_for(
                ACTIONS[kind](ctx, rng), ctx.args.request_deadline)
        except asyncio.TimeoutError:
            outcome, status, detail = "hung", None, None
        except Exception as e:  # resets, EOF before the status line, protocol errors
            outcome, status, detail = "error", None, repr(e)
            await asyncio.sleep(0.1)  # no busy loop when the server is gone
        s.record(kind, outcome, status, detail)


# ---------------------------------------------------------------- slow-loris, RSS, progress

async def read_to_eof(reader):
    try:
        while await reader.read(4096):
            pass
    except OSError:
        pass


async def loris_once(ctx, rng):
    """One connection that never ends its headers: until the server closes it, or overdue."""
    s, limit = ctx.stats, ctx.args.header_timeout + 5
    try:
        reader, writer = await connect(ctx)
    except OSError:
        s.loris["connect_failed"] += 1
        return await asyncio.sleep(1)
    opened, closed, eof = ctx.now(), False, asyncio.ensure_future(read_to_eof(reader))
    s.loris["opened"] += 1
    s.loris["open_now"] += 1
    trickle = b"".join(b"X-Loris-%d: %d\r\n" % (i, i) for i in range(1000))
    try:
        writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n")
        for byte in trickle:
            if (age := ctx.now() - opened) >= limit:
                break
            await asyncio.wait({eof}, timeout=min(rng.uniform(1, 2), limit - age))
            if closed := eof.done():
                break
            writer.write(bytes([byte]))
            await writer.drain()
    except OSError:
        closed = True
    finally:
        eof.cancel()
        abort(writer)
        s.loris["open_now"] -= 1
    s.loris["closed_by_server" if closed else "overdue"] += 1
    if closed:
        s.loris_close_s.append(ctx.now() - opened)


async def loris_slot(ctx, rng, delay):
    await asyncio.sleep(delay)
    while ctx.now() < ctx.args.duration:
        await loris_once(ctx, rng)


def sample_rss(ctx):
    try:
        with open(f"/proc/{ctx.args.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        ctx.stats.rss.append([round(ctx.now(), 1), round(kb / 1024, 1)])
    except (OSError, StopIteration):
        ctx.stats.server_gone = True


async def rss_sampler(ctx):
    while not ctx.stats.server_gone:
        sample_rss(ctx)
        await asyncio.sleep(2)


async def progress(ctx):
    s = ctx.stats
    while True:
        await asyncio.sleep(10)
        rss = f"{s.rss[-1][1]:.0f}MB" if s.rss else "-"
        print(f"[loadtest] {ctx.now():.0f}s requests={s.requests} ok={s.ok} hung="
              f"{s.outcomes['hung']} errors={s.outcomes['error']} unexpected="
              f"{s.outcomes['unexpected']} rss={rss} slowloris_open={s.loris['open_now']}",
              file=sys.stderr, flush=True)


# ---------------------------------------------------------------- run and summary

def rss_summary(ctx, failures):
    a, s = ctx.args, ctx.stats
    warm = [mb for t, mb in s.rss if t >= a.warmup_frac * a.duration]
    warm = warm or [mb for _, mb in s.rss[-1:]]  # a run too short for warm-up
    baseline = warm[0] if warm else None
    bound = baseline * (1 + a.rss_slack_frac) + a.rss_slack_mb if warm else None
    if s.server_gone or not warm:
        failures.append("server_gone")
    elif max(warm) > bound:
        failures.append(f"rss {max(warm):.0f} MB > {bound:.0f} MB")
    return {"baseline": baseline, "max_after_warmup": max(warm, default=None), "bound": bound,
            "final": s.rss[-1][1] if s.rss else None, "server_gone": s.server_gone,
            "samples": s.rss}


def count_panics(path, failures):
    try:
        with open(path, errors="replace") as f:
            panics = sum("panicked" in line for line in f)
    except OSError as e:
        failures.append(f"server log: {e}")
        return None
    if panics:
        failures.append(f"panics={panics}")
    return panics


def summarize(ctx, elapsed):
    a, s, o, close_s = ctx.args, ctx.stats, ctx.stats.outcomes, ctx.stats.loris_close_s
    failures = [f"{n}={v}" for n, v in [("hung", o["hung"]), ("errors", o["error"]),
                ("unexpected", o["unexpected"]), ("slowloris_overdue", s.loris["overdue"])] if v]
    loris = {k: s.loris[k] for k in ("opened", "closed_by_server", "overdue", "connect_failed")}
    loris["max_close_s"] = round(max(close_s), 2) if close_s else None
    loris["p50_close_s"] = round(statistics.median(close_s), 2) if close_s else None
    return {
        "duration_s": round(elapsed, 1), "clients": a.clients, "requests": s.requests,
        "kinds": {k: dict(v) for k, v in s.kinds.items()}, "outcomes": dict(o),
        "ok": s.ok, "hung": o["hung"], "errors": o["error"], "unexpected": o["unexpected"],
        "oversized_reset": o["oversized_reset"], "unexpected_examples": s.examples["unexpected"],
        "error_examples": s.examples["error"], "status_counts": dict(s.status_counts),
        "tokens_streamed": s.tokens_streamed, "slowloris": loris,
        "rss_mb": rss_summary(ctx, failures) if a.pid else None,
        "panics": count_panics(a.server_log, failures) if a.server_log else None,
        "failures": failures, "pass": not failures,
    }


def served_model(url):
    """The first id /v1/models lists: requests must name a model."""
    import urllib.request
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


async def run(args):
    if not args.model:
        args.model = served_model(args.url)
    ctx = Ctx(args, *loopback_target(args.url))
    ctx.start = asyncio.get_running_loop().time()
    rng = random.Random(args.seed)
    clients = [asyncio.ensure_future(client_loop(ctx, random.Random(rng.random())))
               for _ in range(args.clients)]
    stagger = min(3.0, args.duration / 4) / max(1, args.slowloris)
    aux = [asyncio.ensure_future(loris_slot(ctx, random.Random(rng.random()), i * stagger))
           for i in range(args.slowloris)]
    aux += [asyncio.ensure_future(progress(ctx))]
    aux += [asyncio.ensure_future(rss_sampler(ctx))] if args.pid else []
    # Clients start no request after the duration; one still running has until its deadline.
    await asyncio.wait(clients, timeout=args.duration + args.request_deadline + 5)
    for task in clients + aux:
        task.cancel()
    await asyncio.gather(*clients, *aux, return_exceptions=True)
    if args.pid and not ctx.stats.server_gone:
        sample_rss(ctx)
    return summarize(ctx, ctx.now())


def bounded(kind, low, high):
    def parse(text):
        if not low <= (value := kind(text)) <= high:
            raise argparse.ArgumentTypeError(f"{text} is not in [{low}, {high}]")
        return value
    return parse


class HelpFormat(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=HelpFormat)
    p.add_argument("--url", required=True, default=argparse.SUPPRESS,
                   help="http://127.0.0.1:PORT (loopback only)")
    p.add_argument("--model", metavar="NAME",
                   help="the `model` field to send (default: the first id of /v1/models)")
    for flag, kind, default, text in [
        ("--clients", bounded(int, 1, 1024), 64, "client loops sending requests back to back"),
        ("--duration", bounded(float, 0.1, 86400), 600.0, "seconds"),
        ("--slowloris", bounded(int, 0, 2000), 200, "slow-loris connections kept open"),
        ("--header-timeout", bounded(float, 0.1, 3600), 10.0, "the server's, in seconds"),
        ("--request-deadline", bounded(float, 0.1, 3600), 120.0, "seconds; later is HUNG"),
        ("--max-body-bytes", bounded(int, 1, 1 << 30), 16 << 20, "the server's body limit"),
        ("--max-requests", bounded(int, 1, 10**8), 10**6, "at most this many requests"),
        ("--seed", int, 0, "for the random choices"),
        ("--max-tokens", bounded(int, 1, 1 << 20), 48, "largest max_tokens sent"),
        ("--warmup-frac", bounded(float, 0, 1), 0.2, "the RSS this far into the run: baseline"),
        ("--rss-slack-mb", float, 64.0, "RSS growth allowed over the baseline, MB"),
        ("--rss-slack-frac", float, 0.10, "... and as a fraction of it"),
    ]:
        p.add_argument(flag, type=kind, default=default, metavar="N", help=text)
    p.add_argument("--pid", type=int, help="the server process: sample its VmRSS")
    p.add_argument("--server-log", metavar="FILE", help="`panicked` in this file fails the run")
    p.add_argument("--json-out", metavar="FILE", help="also write the summary here")
    args = p.parse_args()
    summary = asyncio.run(run(args))
    text = json.dumps(summary)
    print(text, flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    sys.exit(0 if summary["pass"] else 1)


if __name__ == "__main__":
    main()
