"""Tiers on different hosts: an engine host (`launch engine --bind tcp://…`) and gateway hosts (`launch api-server
--engine tcp://…`) on their own ports, CURVE between them; two gateway hosts behind a real HAProxy running the
shipped config (deploy/haproxy/haproxy.cfg).

- gateway hosts serve through the remote engines and follow them as they die, restart and scale;
- a LoRA adapter loaded through a gateway host is loaded by the engine host's engines before the load answers, a
  refusal there rolls it back, and an unload drops it there;
- the engine host's engines publish their KV cache events over TCP with CURVE: a gateway host lists them, a keyed
  subscriber reads them and replays them, one without the keys gets nothing;
- an unauthenticated client (no CURVE, an unlisted key, raw bytes) reaches nothing and is logged;
- plain TCP needs --insecure;
- through HAProxy, killing one gateway host mid-run fails at most the requests it had in flight.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid

import httpx
import openai
import pytest
import zmq

from protocol import ClientHello, EngineHello, decode, encode
from protocol.kv_events import END_SEQ, BlockStored, decode_batch, seq_bytes, seq_of
from tests.helpers import (
    LAUNCH,
    ROOT,
    Server,
    StreamResult,
    Traffic,
    close_streams,
    engine_host_ports,
    free_port,
    free_ports,
    procs,
    ready_pids,
    run_stream,
    status,
    stream_body,
    streams_go_on,
    wait_until,
)

pytestmark = pytest.mark.slow

HAPROXY = shutil.which("haproxy")
CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
MODEL = ("--model", "tiny-random", "--dtype", "float32")


def launch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("curve") / "keys"
    r = launch("keys", "--dir", str(d))
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def engine_host(keys):
    # (the other engine hosts here take the default KV event ports). An engine host's ports run 65 from --bind's
    # (its registry, 64 engine ranks) and 128 from --kv-events-port (two per rank): ranges launch refuses to overlap.
    port = free_ports(engine_host_ports(kv_events_port=True))
    kv = free_ports(128)  # free_ports never hands out a port twice: the two ranges do not meet
    s = Server(command=[*LAUNCH, "engine", *MODEL, "--count", "2", "--bind", f"tcp://127.0.0.1:{port}",
                        "--kv-events-port", str(kv), "--keys", str(keys), "--heartbeat-timeout", "10",
                        "--enable-lora"], log_name="engine-host")
    s.kv_events_port = kv  # type: ignore[attr-defined]
    yield s
    s.stop()


def gateway_host(engine_host: Server, keys, name: str, *extra: str) -> Server:
    return Server(*MODEL, "--count", "2", "--engine", engine_host.url, "--keys", str(keys), *extra, log_name=name)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def gateways(engine_host, keys, lora_dir):
    s = gateway_host(engine_host, keys, "gateway-host", "--enable-lora", "--lora-dir", str(lora_dir))
    yield s
    s.stop()


def remote_engines(gw: Server) -> dict[int, dict]:
    return {p["index"]: p for p in procs(gw, "engine") if p.get("endpoint")}


def completion(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    return client.completions.create(model="tiny-random", prompt="hello", max_tokens=4).choices[0].text


# -- one engine host, one gateway host -------------------------------------------------------------------
def test_files_of_launch_keys_are_private_and_never_overwritten(keys):
    for path in [keys / "server.key", keys / "server.key_secret", keys / "client.key", keys / "client.key_secret",
                 keys / "authorized" / "client.key"]:
        assert oct(path.stat().st_mode & 0o777) == "0o600", path
    assert oct(keys.stat().st_mode & 0o777) == "0o700"
    again = launch("keys", "--dir", str(keys))
    assert again.returncode != 0 and "never overwritten" in again.stderr


def test_a_gateway_host_serves_through_the_engine_host(engine_host, gateways):
    assert completion(gateways.url)
    engines = remote_engines(gateways)
    theirs = {p["index"]: p["pid"] for p in procs(engine_host, "engine")}
    assert {i: p["pid"] for i, p in engines.items()} == theirs and len(theirs) == 2
    port = engine_host.port
    assert {p["endpoint"] for p in engines.values()} == {f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{port + 2}"}
    health = httpx.get(gateways.url + "/health", timeout=10).json()
    assert health["engines_ready"] == 2 and health["engines_desired"] == 2
    assert status(engine_host)["desired"]["gateway"] == 0


def test_engine_hosts_publish_kv_events_over_curve_that_gateway_hosts_list(engine_host, gateways, keys):
    """Each engine of the engine host publishes its KV cache events on two TCP ports of its own (PUB, replay), with
    the engine host's CURVE keys; a gateway host's /kv_event_sources lists them. A subscriber with an authorized
    client key reads the BlockStored events of a chat request and replays them; one without CURVE, or with a key
    nobody listed, gets nothing."""
    from zserve.curve import CurveKeys, secure_client

    kv = engine_host.kv_events_port
    sources = httpx.get(gateways.url + "/kv_event_sources", timeout=10).json()["sources"]
    assert {s["engine"]: (s["endpoint"], s["replay_endpoint"]) for s in sources} == {
        r: (f"tcp://127.0.0.1:{kv + 2 * r}", f"tcp://127.0.0.1:{kv + 2 * r + 1}") for r in (0, 1)}
    client_keys = CurveKeys.for_client(str(keys))
    ctx = zmq.Context()
    try:
        def subscriber(secure) -> zmq.Socket:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            secure(sub)
            sub.setsockopt(zmq.SUBSCRIBE, sources[0]["topic"].encode())
            for s in sources:
                sub.connect(s["endpoint"])
            return sub

        def stranger_key(sock: zmq.Socket) -> None:
            sock.curve_serverkey = client_keys.server_public
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()

        keyed = subscriber(lambda sock: secure_client(sock, client_keys))
        outsiders = [subscriber(lambda sock: None), subscriber(stranger_key)]
        stored: list[int] = []  # the sequence numbers of batches that stored blocks, since the last chat

        def read() -> None:
            while keyed.poll(0):
                _, seq, payload = keyed.recv_multipart()
                if any(isinstance(e, BlockStored) for e in decode_batch(payload)[1]):
                    stored.append(seq_of(seq))

        def chat_until_stored() -> bool:  # (a subscription takes a moment: a request until its events arrive)
            stored.clear()
            text = f"{uuid.uuid4().hex} " + "a long and new prompt for the prefix cache " * 8
            r = httpx.post(gateways.url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny-random", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 2
            while not stored and time.monotonic() < deadline and keyed.poll(100):
                read()
            return bool(stored)

        wait_until(chat_until_stored, 60, 0.1, "BlockStored events on the keyed subscriber")
        assert chat_until_stored()  # again, with every subscriber long connected
        for outsider in outsiders:
            assert not outsider.poll(500), "a subscriber without an authorized key read KV events"
        # The replay socket of each engine answers a keyed DEALER with what it kept, then END_SEQ.
        replayed = 0
        for s in sources:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            secure_client(dealer, client_keys)
            dealer.connect(s["replay_endpoint"])
            dealer.send_multipart([b"", seq_bytes(0)])
            while True:
                assert dealer.poll(10_000), f"no replay from {s['replay_endpoint']}"
                *_, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    assert payload == b""
                    break
                replayed += sum(isinstance(e, BlockStored) for e in decode_batch(payload)[1])
        assert replayed >= 2  # both chats' blocks, from whichever engines served them
    finally:
        ctx.destroy(linger=0)


def test_gateway_hosts_follow_an_engine_that_dies_and_a_tier_that_scales(engine_host, gateways):
    before = remote_engines(gateways)
    os.kill(before[1]["pid"], signal.SIGKILL)
    # Requests go on meanwhile (the other engine serves them; the dead one's connection dropped at once).
    for _ in range(5):
        assert completion(gateways.url)
    wait_until(lambda: (e := remote_engines(gateways)).get(1, {}).get("state") == "ready"
               and e[1]["pid"] != before[1]["pid"], 60, 0.2, "the gateway host to see engine 1 replaced")
    r = launch("scale", "engine", "3", "--port", str(engine_host.port), "--timeout", "120", timeout=150)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: len([p for p in remote_engines(gateways).values() if p["state"] == "ready"]) == 3, 60, 0.2,
               "the gateway host to see the third engine")
    wait_until(lambda: httpx.get(gateways.url + "/health", timeout=10).json()["engines_ready"] == 3, 30, 0.1,
               "every gateway to reach the third engine")
    for _ in range(6):
        assert completion(gateways.url)
    r = launch("scale", "engine", "2", "--port", str(engine_host.port), "--timeout", "120", timeout=150)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: len(remote_engines(gateways)) == 2, 60, 0.2, "the gateway host to drop the third engine")
    assert completion(gateways.url)


def test_reloading_an_engine_host_with_one_engine_drops_no_request_of_a_gateway_host(keys):
    port = free_ports(engine_host_ports())
    eng = Server(command=[*LAUNCH, "engine", *MODEL, "--bind", f"tcp://127.0.0.1:{port}", "--keys", str(keys)],
                 log_name="reload-engine-host")
    try:
        gw = gateway_host(eng, keys, "reload-gateway-host")
        try:
            before = ready_pids(eng, "engine")
            with Traffic(gw.url, "tiny-random", workers=4) as traffic:
                r = launch("reload", "--port", str(eng.port), timeout=300)
                assert r.returncode == 0, r.stderr
                done = traffic.ok
                wait_until(lambda: traffic.ok >= done + 8, 60, what="requests after the reload")
            assert not traffic.failed, traffic.failed  # held by the gateway host while the engine was replaced
            after = ready_pids(eng, "engine")
            assert len(after) == 1 and after != before
            assert "reloading" in gw.tail(50000)  # the gateway host followed the engine host's pause
        finally:
            gw.stop()
    finally:
        eng.stop()


def test_streams_move_off_an_engine_host_that_is_cut_off(engine_host, keys):
    """An engine host stops answering with its connections open, as behind a cut cable (SIGSTOP on its every
    process: no reset, no FIN): the gateway host drops its engines once its registry has been silent for
    --heartbeat-timeout, and the streams they served move to the other engine host's engines and go on."""
    port = free_ports(engine_host_ports())
    lone = Server(command=[*LAUNCH, "engine", *MODEL, "--bind", f"tcp://127.0.0.1:{port}", "--keys", str(keys)],
                  log_name="cut-engine-host")
    frozen: list[int] = []
    try:
        gw = Server(*MODEL, "--count", "1", "--engine", engine_host.url, "--engine", lone.url, "--keys", str(keys),
                    "--heartbeat-timeout", "3", log_name="cut-gateway-host")
        try:
            wait_until(lambda: len([p for p in procs(gw, "engine") if p["state"] == "ready"]) == 3, 60, 0.2,
                       "the gateway host to see both engine hosts' engines")
            results = [StreamResult() for _ in range(6)]
            threads = [threading.Thread(target=run_stream, args=(gw.url, stream_body(1500), r)) for r in results]
            for t in threads:
                t.start()
            wait_until(lambda: all(r.error or r.chunks > 3 for r in results), 60, what="the streams to flow")
            wait_until(lambda: procs(lone, "engine")[0].get("running"), 30, 0.1, "the cut host to serve streams")
            frozen = [lone.proc.pid, *(p.pid for p in lone.descendants())]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            at = [r.chunks for r in results]
            streams_go_on(results, at, "every stream to go on after the cut")
            close_streams(results, threads)
            assert not [r.error for r in results if r.error]
            moved = [ln for ln in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines()
                     if ln.startswith('zserve_migrations_total{cause="engine_lost"}')]
            assert moved and float(moved[0].split()[-1]) >= 1, moved
        finally:
            gw.stop()
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        lone.stop()


# -- who may connect --------------------------------------------------------------------------------------
def _hello(sock: zmq.Socket, endpoint: str, wait_ms: int) -> object | None:
    """The engine's answer to a hello over ``sock``, or None. A socket the engine refuses may not even send: once its
    handshake has failed it has no peer, and a DEALER's send then blocks (it once blocked until pytest's timeout)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, wait_ms)
    sock.connect(endpoint)
    try:
        sock.send_multipart(encode(ClientHello("intruder")))
    except zmq.Again:
        return None
    if sock.poll(wait_ms):
        return decode(sock.recv_multipart())
    return None


def test_a_lora_adapter_loaded_through_a_gateway_host_is_loaded_by_the_engine_hosts_engines(engine_host, gateways,
                                                                                            lora_dir):
    pytest.importorskip("peft")
    from tests.lora_adapters import tiny_random_hf, write_adapter

    write_adapter(tiny_random_hf(), lora_dir / "remote", 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    write_adapter(tiny_random_hf(), lora_dir / "rank32", 4, r=32, lora_alpha=8, target_modules=["q_proj"])

    def load(name: str) -> httpx.Response:
        return httpx.post(gateways.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name},
                          timeout=330)

    def loras(server: Server) -> list[set[str]]:
        return [set(p.get("loras") or ()) for p in procs(server, "engine") if p["state"] == "ready"]

    r = load("remote")
    assert r.status_code == 200, r.text
    assert loras(engine_host) == [{"remote"}] * 2 and loras(gateways) == [{"remote"}] * 2
    client = openai.OpenAI(base_url=gateways.url + "/v1", api_key="x", max_retries=0, timeout=60)
    for _ in range(6):
        assert client.completions.create(model="remote", prompt="hello", max_tokens=4).model == "remote"
    r = load("rank32")  # the engine host's engines refuse it: rolled back
    assert r.status_code == 400 and "above this engine's max_lora_rank=16" in r.text and "engine host" in r.text, r.text
    r = httpx.post(gateways.url + "/v1/unload_lora_adapter", json={"lora_name": "remote"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="remote", prompt="hello", max_tokens=4)
    wait_until(lambda: loras(engine_host) == [set()] * 2, 30, 0.2, "the engine host's engines to drop it")


def test_engine_operations_through_a_gateway_host_reach_the_engine_hosts_engines(engine_host, gateways, tmp_path):
    from .tiny_checkpoint import write_tiny_checkpoint

    with httpx.Client(base_url=gateways.url, timeout=300) as c:
        reset = c.post("/reset_prefix_cache")
        assert reset.status_code == 200, reset.text
        assert [(e["host"], e["ok"]) for e in reset.json()["engines"]] == [(engine_host.url, True)] * 2
        assert c.post("/sleep", json={"level": 1}).status_code == 200
        assert c.get("/is_sleeping").json()["is_sleeping"] is True
        assert [p.get("sleeping") for p in procs(engine_host, "engine")] == [1, 1]
        held: list[str] = []
        reader = threading.Thread(target=lambda: held.append(completion(gateways.url)))
        reader.start()
        reader.join(1.0)  # (a bound on how long the check waits, not a sleep: it ends at once if it is not held)
        assert held == []  # the engine host's hold reached this host's gateways
        assert c.post("/wake_up").status_code == 200
        reader.join(60)
        assert len(held) == 1 and c.get("/is_sleeping").json()["is_sleeping"] is False
        ckpt = write_tiny_checkpoint(tmp_path / "tiny-v2")  # (one filesystem: the engine host reads the same path)
        r = c.post("/update_weights", json={"path": str(ckpt), "version": "v2"})
        assert r.status_code == 200, r.text
        assert c.get("/weight_info").json()["models"] == {"tiny-random": "v2"}
        assert {e["weight_version"] for e in c.get("/weight_info").json()["engines"]} == {"v2"}
        bad = c.post("/update_weights", json={"path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "does not exist" in bad.text and engine_host.url in bad.text, bad.text


def test_unauthenticated_clients_reach_nothing_and_are_logged(engine_host, gateways, keys):
    import zmq.auth

    engine = f"tcp://127.0.0.1:{engine_host.port + 1}"
    pids = ready_pids(engine_host, "engine")
    ctx = zmq.Context()
    try:
        server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
        # The accepted key gets an answer: the checks below can fail.
        ok = ctx.socket(zmq.DEALER)
        ok.curve_serverkey = server_public
        ok.curve_publickey, ok.curve_secretkey = zmq.auth.load_certificate(str(keys / "client.key_secret"))
        assert isinstance(_hello(ok, engine, 10_000), EngineHello)
        # No CURVE at all, then a key of its own that nobody listed: no answer.
        plain = ctx.socket(zmq.DEALER)
        assert _hello(plain, engine, 1500) is None
        stranger = ctx.socket(zmq.DEALER)
        stranger.curve_serverkey = server_public
        public, secret = zmq.curve_keypair()
        stranger.curve_publickey, stranger.curve_secretkey = public, secret
        assert _hello(stranger, engine, 1500) is None
        wait_until(lambda: public.decode() in engine_host.tail(20000), 10, 0.1, "the refused key in the log")
        # Hostile bytes on the engine's and the registry's ports.
        for port in (engine_host.port, engine_host.port + 1):
            for junk in (b"\xff" * 10 + b"\x7f" + b"\x03\x00NULL" + b"\x00" * 60, os.urandom(4096),
                         b"GET / HTTP/1.1\r\n\r\n"):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(junk)
    finally:
        ctx.destroy(linger=0)
    assert ready_pids(engine_host, "engine") == pids  # nothing crashed
    assert all((p.get("running") or 0) == 0 for p in procs(engine_host, "engine"))
    assert "Traceback" not in engine_host.tail(50000)
    assert completion(gateways.url)


def test_a_gateway_host_with_an_unlisted_key_gets_no_engine(engine_host, keys, tmp_path):
    other = tmp_path / "other"
    assert launch("keys", "--dir", str(other), "--client-only", "--name", "gw-other").returncode == 0
    shutil.copy(keys / "server.key", other / "server.key")
    r = launch("api-server", *MODEL, "--port", "0", "--engine", engine_host.url, "--keys", str(other),
               "--ready-timeout", "4", timeout=60)
    assert r.returncode == 1 and "no answer from the engine host" in r.stderr, r.stderr[-2000:]
    assert "refused a CURVE client" in engine_host.tail(50000)


def test_plain_tcp_between_hosts_needs_insecure(engine_host):
    for args in (["api-server", *MODEL, "--engine", engine_host.url],
                 ["engine", *MODEL, "--bind", "tcp://127.0.0.1:1"]):
        r = launch(*args)
        assert r.returncode == 2 and "--insecure" in r.stderr, r.stderr
    port = free_ports(engine_host_ports())
    eng = Server(command=[*LAUNCH, "engine", *MODEL, "--bind", f"tcp://127.0.0.1:{port}", "--insecure"],
                 log_name="insecure-engine-host")
    try:
        gw = Server(*MODEL, "--count", "1", "--engine", eng.url, "--insecure", log_name="insecure-gateway-host")
        try:
            assert completion(gw.url)
            assert "--insecure: engine traffic over TCP" in gw.tail(20000)
        finally:
            gw.stop()
        assert "--insecure: engine traffic over TCP" in eng.tail(20000)
    finally:
        eng.stop()


# -- two gateway hosts behind HAProxy -----------------------------------------------------------------------
@pytest.fixture
def haproxy(engine_host, gateways, keys, tmp_path):
    if HAPROXY is None:
        pytest.skip("haproxy is not installed (.ci/run installs it from Debian's packages)")
    second = gateway_host(engine_host, keys, "gateway-host-b")
    port = free_port()
    env = {**os.environ, "ZSERVE_LB_BIND": f"127.0.0.1:{port}", "ZSERVE_LB_ADMIN_SOCKET": str(tmp_path / "admin.sock"),
           "ZSERVE_HOST_1": second.url.removeprefix("http://"), "ZSERVE_HOST_2": gateways.url.removeprefix("http://")}
    check = subprocess.run([HAPROXY, "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    log = open(tmp_path / "haproxy.log", "wb")
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(CONFIG)], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(url), 30, 0.1, "HAProxy to see both hosts healthy")
        yield url, second, tmp_path / "haproxy.log"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        second.stop()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def gateway_pid(url: str) -> int:
    """Which gateway process answered (a new connection each time, so HAProxy balances them)."""
    return httpx.get(url + "/status", headers={"Connection": "close"}, timeout=10).json()["pid"]


def test_requests_through_haproxy_survive_the_loss_of_a_gateway_host(gateways, haproxy):
    url, second, log = haproxy
    hosts = {"a": set(ready_pids(second, "gateway")), "b": set(ready_pids(gateways, "gateway"))}
    with Traffic(url, "tiny-random", workers=4, keepalive=False) as traffic:
        wait_until(lambda: traffic.ok >= 20, 60, what="requests through HAProxy")
        seen = {gateway_pid(url) for _ in range(40)}
        assert seen & hosts["a"] and seen & hosts["b"]  # both gateway hosts serve
        before_kill = traffic.ok
        os.kill(second.proc.pid, signal.SIGKILL)  # host 1's supervisor: its gateways die with it
        wait_until(lambda: traffic.ok >= before_kill + 40, 120, what="requests after the host died")
    assert len(traffic.failed) <= 4, traffic.failed  # at most what was in flight on the dead host (4 workers)
    assert {gateway_pid(url) for _ in range(10)} <= hosts["b"]
    wait_until(lambda: "host1 is DOWN" in log.read_text(errors="replace"), 30, what="HAProxy to mark host1 down")
