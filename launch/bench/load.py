"""The load side of ``launch bench``: what to send (the workload) and how to send it (the driver).

It speaks plain OpenAI-compatible HTTP with aiohttp, so it measures any such server, not only zserve.
A workload is a list of ``RequestSpec`` built once (random prompts of chosen token lengths, a JSONL
dataset, or the shared-prefix workloads of ``workloads``) and replayed at each load point; the driver sends
it at a Poisson rate and/or under a concurrency cap and returns one ``RequestRecord`` per request, timed from
the SSE chunks. Conversations are driven turn by turn: each turn carries the earlier turns and the model's
real answers, so a turn can only be built once the one before it has answered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

# Short, common English words: with a leading space each is one token in the usual BPE vocabularies, so
# N words is close to N tokens when the server cannot count for us.
WORDS = (
    "the of and to in is that it was for on are as with his they at be this have from or one had by word but not "
    "what all were we when your can said there use an each which she do how their if will up other about out "
    "many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part"
).split()


# The rank of the engine that served a request, as zserve's gateway reports it (other servers: absent).
ENGINE_HEADER = "X-Zserve-Engine"


class Unreachable(Exception):
    """The server could not be reached (connection refused, DNS, timeout) before any load was sent."""


@dataclasses.dataclass
class RequestSpec:
    """One request of the workload: a prompt (text or chat messages), its length and its output budget."""

    prompt: str | None
    messages: list[dict] | None
    prompt_len: int | None  # tokens as counted before sending (None: unknown, e.g. a dataset's messages)
    max_tokens: int
    model: str | None = None  # the model (a LoRA adapter) it asks for; None: the target's
    group: int | None = None  # the shared prefix (or conversation) it belongs to; None: it shares none


@dataclasses.dataclass
class Conversation:
    """A multi-turn chat: its user turns in order, each sent with every earlier turn and the model's answers."""

    turns: list[str]
    max_tokens: int
    group: int


@dataclasses.dataclass
class RequestRecord:
    """What one request did; times are seconds, ``start`` relative to the start of its load point."""

    index: int
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    latency: float = 0.0
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage.prompt_tokens_details)
    engine: str | None = None  # the engine that served it (the X-Zserve-Engine header), when the server says
    group: int | None = None
    output_text: str = ""


@dataclasses.dataclass
class Target:
    """Where and how requests go: the server, the model, the endpoint family and the sampling fields sent."""

    base_url: str
    model: str
    endpoint_type: str = "completions"  # or "chat"
    api_key: str | None = None
    stream: bool = True
    temperature: float = 1.0
    ignore_eos: bool = False
    timeout: float = 600.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def url(self) -> str:
        return self.base_url + ("/v1/chat/completions" if self.endpoint_type == "chat" else "/v1/completions")


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from what an operator may type (a trailing slash or ``/v1``)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def first_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str | None:
    """The first model GET /v1/models lists (None if the route fails); Unreachable if nothing answers."""
    try:
        async with session.get(base_url + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                return None
            data = (await r.json(content_type=None)).get("data") or []
    except (TimeoutError, aiohttp.ClientConnectionError) as e:
        raise Unreachable(f"cannot reach {base_url} ({e or type(e).__name__}); is a server running there?") from None
    except (aiohttp.ClientError, ValueError, AttributeError):
        return None
    return data[0]["id"] if data and isinstance(data[0], dict) and "id" in data[0] else None


# -- the workload ----------------------------------------------------------------------------------------

def sample_lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    """``n`` lengths uniform in [mean * (1 - r), mean * (1 + r)] (all ``mean`` when r = 0), at least 1."""
    lo, hi = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def load_dataset(path: Path, n: int, default_max_tokens: int) -> list[RequestSpec]:
    """The first ``n`` lines of a JSONL file (repeated if it has fewer): each an object with "prompt" (a
    string) or "messages" (chat messages) and optionally "max_tokens"."""
    rows = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(obj, dict) or not (isinstance(obj.get("prompt"), str)
                                                 or isinstance(obj.get("messages"), list)):
                raise ValueError(f"{path}:{lineno}: expected an object with a \"prompt\" string or \"messages\" list")
            rows.append(RequestSpec(prompt=obj.get("prompt") if "messages" not in obj else None,
                                    messages=obj.get("messages"), prompt_len=None,
                                    max_tokens=int(obj.get("max_tokens") or default_max_tokens)))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [dataclasses.replace(rows[i % len(rows)]) for i in range(n)]


class PromptMaker:
    """Random prompts of an exact token length, made with the server's own /tokenize and /detokenize when
    it has them (vLLM's shapes), else approximated by words."""

    def __init__(self, session: aiohttp.ClientSession, target: Target, rng: random.Random):
        self.session, self.target, self.rng = session, target, rng
        self.exact: bool | None = None  # None: not probed yet

    async def _post(self, route: str, body: dict) -> dict | None:
        try:
            async with self.session.post(self.target.base_url + route, json={"model": self.target.model, **body},
                                         headers=self.target.headers, timeout=aiohttp.ClientTimeout(total=60)) as r:
                return await r.json(content_type=None) if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None

    async def _count(self, text: str) -> list[int] | None:
        got = await self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return got.get("tokens") if isinstance(got, dict) and isinstance(got.get("tokens"), list) else None

    async def _exact(self, words: str, length: int) -> tuple[str, int] | None:
        """Cut the tokens of ``words`` to ``length``, detokenize, and re-count (a cut can merge with its
        neighbour): a few rounds of trimming or growing make the count exact or nearly so."""
        ids = await self._count(words)
        if ids is None:
            return None
        pool, want, text, got = ids, length, words, len(ids)
        for _ in range(4):
            out = await self._post("/detokenize", {"tokens": pool[:want]})
            if not isinstance(out, dict) or not isinstance(out.get("prompt"), str):
                return None
            text = out["prompt"]
            counted = await self._count(text)
            if counted is None:
                return None
            got = len(counted)
            if got == length or want + (length - got) > len(pool) or want + (length - got) < 1:
                break
            want += length - got
        return text, got

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    async def texts(self, lengths: list[int], head: str = "", head_len: int = 0) -> list[tuple[str, int]]:
        """Random texts of ``lengths`` tokens and each one's count. With ``head`` (a text of ``head_len`` tokens),
        every text starts with it and random words fill the rest: their first ``head_len`` tokens are the
        head's, since the byte-level tokenizers split at the space before a word."""
        lead = head + " " if head else ""
        drafts = [lead + self.words(n - head_len + 8) for n in lengths]
        first = None
        if self.exact is None and drafts:
            first = await self._exact(drafts[0], lengths[0])
            self.exact = first is not None
        if not self.exact:  # approximated by words; the server's usage reports the real count
            return [(lead + " ".join(d[len(lead):].split()[:n - head_len]), n) for d, n in zip(drafts, lengths)]
        limit = asyncio.Semaphore(16)

        async def one(i: int) -> tuple[str, int]:
            if i == 0 and first is not None:
                return first
            async with limit:
                got = await self._exact(drafts[i], lengths[i])
            if got is None:
                return lead + " ".join(drafts[i][len(lead):].split()[:lengths[i] - head_len]), lengths[i]
            return got

        return list(await asyncio.gather(*(one(i) for i in range(len(drafts)))))

    async def make(self, lengths: list[int], max_tokens: list[int]) -> list[RequestSpec]:
        return [RequestSpec(prompt=text, messages=None, prompt_len=n, max_tokens=m)
                for (text, n), m in zip(await self.texts(lengths), max_tokens)]


# -- the driver ------------------------------------------------------------------------------------------

def request_body(target: Target, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"model": spec.model or target.model, "temperature": target.temperature,
                            "stream": target.stream}
    if target.endpoint_type == "chat":
        body["messages"] = spec.messages or [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.max_tokens
    else:
        body["prompt"] = spec.prompt if spec.prompt is not None else "\n".join(
            str(m.get("content", "")) for m in spec.messages or ())
        body["max_tokens"] = spec.max_tokens
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    if target.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra: every request generates exactly max_tokens
    return body


def _server_error(status: int, raw: bytes) -> str:
    try:
        err = orjson.loads(raw)
        err = err.get("error", err) if isinstance(err, dict) else err
        message = err.get("message", err) if isinstance(err, dict) else err
    except orjson.JSONDecodeError:
        message = raw.decode(errors="replace").strip()[:200]
    return f"HTTP {status}: {message}"


async def send(session: aiohttp.ClientSession, target: Target, spec: RequestSpec, index: int,
               t0: float) -> RequestRecord:
    """Send one request and time it: TTFT at the first chunk with output, ITL between such chunks."""
    rec = RequestRecord(index=index, max_tokens=spec.max_tokens, input_tokens=spec.prompt_len or 0, group=spec.group)
    start = time.perf_counter()
    rec.start = start - t0
    chunks = 0
    pieces: list[str] = []
    try:
        async with session.post(target.url, json=request_body(target, spec), headers=target.headers) as r:
            rec.engine = r.headers.get(ENGINE_HEADER)
            if r.status != 200:
                rec.error = _server_error(r.status, await r.read())
            elif not target.stream:
                msg = await r.json(content_type=None)
                _take_usage(rec, msg)
                _take_text(pieces, msg)
                rec.ok = True
            else:
                last = start
                async for raw in r.content:  # one SSE line at a time
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        rec.ok = rec.error is None
                        break
                    now = time.perf_counter()
                    msg = orjson.loads(data)
                    if "error" in msg:
                        rec.error = _server_error(r.status, data)
                        continue
                    if _carries_output(msg):
                        chunks += 1
                        if rec.ttft is None:
                            rec.ttft = now - start
                        else:
                            rec.itl.append(now - last)
                        last = now
                        _take_text(pieces, msg)
                    _take_usage(rec, msg)
                else:
                    rec.error = rec.error or "stream ended without [DONE]"
                if not rec.output_tokens:
                    rec.output_tokens = chunks  # a server that reports no usage: one token per chunk
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as e:
        rec.error = error_text(e)
    rec.latency = time.perf_counter() - start
    rec.output_text = "".join(pieces)
    return rec


def _take_usage(rec: RequestRecord, msg: dict) -> None:
    usage = msg.get("usage") if isinstance(msg, dict) else None
    if isinstance(usage, dict):
        rec.input_tokens = usage.get("prompt_tokens") or rec.input_tokens
        rec.output_tokens = usage.get("completion_tokens") or rec.output_tokens
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_tokens = details["cached_tokens"]


def _carries_output(msg: dict) -> bool:
    """Whether a chunk carries generated output: any completion chunk with choices, a chat chunk whose delta holds
    more than the role (the role-only first chunk a chat stream may send before the model ran is no first token)."""
    choices = msg.get("choices")
    if not choices:
        return False
    delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
    return not isinstance(delta, dict) or any(v for k, v in delta.items() if k != "role")


def _take_text(pieces: list[str], msg: dict) -> None:
    """The first choice's text of a chunk or a whole response: a completion's ``text``, a chat ``delta`` or
    ``message`` content (what a conversation's next turn carries as the model's answer)."""
    choice = msg["choices"][0] if msg.get("choices") else None
    if not isinstance(choice, dict):
        return
    part = choice.get("delta") or choice.get("message")
    text = part.get("content") if isinstance(part, dict) else choice.get("text")
    if isinstance(text, str):
        pieces.append(text)


async def drive(session: aiohttp.ClientSession, target: Target, specs: list[RequestSpec], request_rate: float,
                max_concurrency: int | None, rng: random.Random,
                on_done: Callable[[RequestRecord], None]) -> tuple[list[RequestRecord], float]:
    """Send ``specs`` with Poisson arrivals at ``request_rate`` per second (inf: all at once), at most
    ``max_concurrency`` in flight; the records in workload order and the wall time from first send to last answer."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int, spec: RequestSpec) -> RequestRecord:
        if limit is None:
            rec = await send(session, target, spec, i, t0)
        else:
            async with limit:
                rec = await send(session, target, spec, i, t0)
        on_done(rec)
        return rec

    tasks = []
    for i, spec in enumerate(specs):
        tasks.append(asyncio.create_task(one(i, spec)))
        if not math.isinf(request_rate) and i + 1 < len(specs):
            await asyncio.sleep(rng.expovariate(request_rate))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - t0


async def drive_conversations(session: aiohttp.ClientSession, target: Target, conversations: list[Conversation],
                              request_rate: float, max_concurrency: int | None, rng: random.Random,
                              on_done: Callable[[RequestRecord], None]) -> tuple[list[RequestRecord], float]:
    """Hold ``conversations`` on the chat route: each starts at Poisson ``request_rate`` (inf: all at once) and
    sends its turns one after another, each with the whole history so far, the model's real answers included;
    at most ``max_concurrency`` requests are in flight over all of them. A failed turn ends its conversation
    (the turns it did not send count as failed). Records in conversation order, turn by turn, and the wall time."""
    chat = dataclasses.replace(target, endpoint_type="chat")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()
    first = [0]
    for conv in conversations:
        first.append(first[-1] + len(conv.turns))
    records: list[RequestRecord | None] = [None] * first[-1]

    async def converse(n: int, conv: Conversation) -> None:
        history: list[dict[str, str]] = []
        for k, text in enumerate(conv.turns):
            history.append({"role": "user", "content": text})
            spec = RequestSpec(prompt=None, messages=list(history), prompt_len=None, max_tokens=conv.max_tokens,
                               group=conv.group)
            if limit is None:
                rec = await send(session, chat, spec, first[n] + k, t0)
            else:
                async with limit:
                    rec = await send(session, chat, spec, first[n] + k, t0)
            records[rec.index] = rec
            on_done(rec)
            if not rec.ok:
                for later in range(first[n] + k + 1, first[n + 1]):
                    records[later] = RequestRecord(index=later, max_tokens=conv.max_tokens, group=conv.group,
                                                   error="an earlier turn of its conversation failed")
                    on_done(records[later])
                return
            history.append({"role": "assistant", "content": rec.output_text})

    tasks = []
    for n, conv in enumerate(conversations):
        tasks.append(asyncio.create_task(converse(n, conv)))
        if not math.isinf(request_rate) and n + 1 < len(conversations):
            await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    return [r for r in records if r is not None], time.perf_counter() - t0


class Progress:
    """Requests done so far: tqdm on stderr when it is installed, else one updating line."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.failed = 0
        self.t0 = self.shown = time.monotonic()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += not rec.ok
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if self.failed:
                self.bar.set_postfix(failed=self.failed, refresh=False)
            return
        now = time.monotonic()
        if now - self.shown >= 0.1 or self.done == self.total:
            self.shown = now
            sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} done, {self.failed} failed, "
                             f"{now - self.t0:.1f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.done:
            sys.stderr.write("\n")
            sys.stderr.flush()
