"""Elastic expert parallelism end to end: a tiny random Mixtral (8 experts, top-2, 2 layers) served by an
expert-parallel group behind two gateways, resized through /scale_elastic_ep while requests stream, and
broken on purpose (a new member killed while it loads, a drain timeout, a member killed while serving: its
requests, and the survivor's, go on once the group is formed again).

Every greedy output is checked token for token against one process that holds every expert (fp32).
The tests share one server and run in order; each leaves the group at two members.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from tests.helpers import LAUNCH, Server, Traffic, procs, status, wait_until

from .moe_checkpoint import EXPERTS, reference_greedy, write_moe_checkpoint

pytestmark = pytest.mark.slow

MODEL = "tiny-moe"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300], [5] * 40, list(range(10, 30)), [4242]]
TOKENS = 10


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    pytest.importorskip("safetensors")
    return write_moe_checkpoint(tmp_path_factory.mktemp("moe") / MODEL)


@pytest.fixture(scope="module")
def reference(moe_dir) -> list[list[int]]:
    return reference_greedy(moe_dir, PROMPTS, TOKENS)


@pytest.fixture(scope="module")
def ep(moe_dir):
    s = Server("--model", str(moe_dir), "--expert-parallel", "--engines", "2", "--count", "2", "--dtype", "float32",
               "--max-model-len", "1024", "--scaling-wait", "60", log_name="expert-parallel")
    yield s
    s.stop()


# -- helpers -------------------------------------------------------------------------------------------------
def greedy(url: str) -> list[list[int]]:
    """Every prompt's greedy tokens, the requests sent at once (members batch them differently)."""
    out: list = [None] * len(PROMPTS)

    def one(i: int) -> None:
        with httpx.Client(timeout=120) as client:
            r = client.post(url + "/inference/v1/generate", json={
                "model": MODEL, "token_ids": PROMPTS[i],
                "sampling_params": {"temperature": 0, "max_tokens": TOKENS, "ignore_eos": True}})
        r.raise_for_status()
        out[i] = r.json()["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def group(server: Server) -> dict:
    return status(server)["expert_parallel"][MODEL]


def engines(server: Server) -> list[dict]:
    return [p for p in procs(server, "engine") if p["state"] == "ready"]


def on_gateway(url: str, other_than: int | None) -> tuple[http.client.HTTPConnection, int]:
    """A keep-alive connection that landed on a gateway other than ``other_than`` (the gateways share one
    listening socket, so the kernel picks one per connection)."""
    host, port = url.removeprefix("http://").split(":")

    def attempt():
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        conn.request("GET", "/is_scaling_elastic_ep")
        index = json.loads(conn.getresponse().read())["gateway"]
        if index != other_than:
            return conn, index
        conn.close()
        return None

    return wait_until(attempt, 30, 0.0, "a connection to the other gateway")


def scale(conn: http.client.HTTPConnection, size: int, drain_timeout: float = 60) -> tuple[int, dict]:
    conn.request("POST", "/scale_elastic_ep", json.dumps({"new_data_parallel_size": size,
                                                          "drain_timeout": drain_timeout}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def two_members(server: Server) -> None:
    """Start from a serving group of two, whatever an earlier test left (each test then fails on its own)."""
    wait_until(lambda: group(server)["phase"] is None, 120, what="the group to be serving")
    if group(server)["size"] != 2:
        r = httpx.post(server.url + "/scale_elastic_ep", json={"new_data_parallel_size": 2}, timeout=300)
        assert r.status_code == 200, r.text
    wait_until(lambda: len(procs(server, "engine")) == 2, 60, what="two engine processes")


def engine_cpu(server: Server) -> float:
    return sum(sum(psutil.Process(p["pid"]).cpu_times()[:2]) for p in engines(server))


# -- the tests ---------------------------------------------------------------------------------------------
def test_an_idle_group_spends_no_cpu(ep):
    wait_until(lambda: len(engines(ep)) == 2 and group(ep)["phase"] is None, 60, what="the group to serve")
    before = engine_cpu(ep)
    time.sleep(3)  # the measured interval itself
    spent = engine_cpu(ep) - before
    assert spent < 0.3, f"two idle members spent {spent:.2f}s of CPU in 3s"


def test_two_members_give_the_reference_tokens(ep, reference):
    two_members(ep)
    assert group(ep)["size"] == 2 and group(ep)["experts"] == EXPERTS
    assert greedy(ep.url) == reference


def test_every_member_sleeps_wakes_and_takes_new_weights_together(ep, moe_dir, reference):
    """Engine operations reach every member of the group: a level-2 sleep frees each member's share of the experts,
    the wake reads it again from the checkpoint, a weight update swaps every member's share; the tokens stay the
    reference's (the checkpoint is the same), and the members say so."""
    two_members(ep)
    with httpx.Client(base_url=ep.url, timeout=300) as c:
        slept = c.post("/sleep", json={"level": 2})
        assert slept.status_code == 200 and len(slept.json()["engines"]) == 2, slept.text
        assert [p.get("sleeping") for p in engines(ep)] == [2, 2]
        woke = c.post("/wake_up")
        assert woke.status_code == 200, woke.text
        assert greedy(ep.url) == reference
        updated = c.post("/update_weights", json={"path": str(moe_dir), "version": "same-again"})
        assert updated.status_code == 200, updated.text
        assert [e["weight_version"] for e in c.get("/weight_info").json()["engines"]] == ["same-again"] * 2
    assert greedy(ep.url) == reference


def test_resizes_under_load_through_both_gateways(ep, reference):
    """2 → 3 through one gateway, 3 → 1 through the other, while requests stream: none fails; both gateways
    say a resize runs while it does; a second resize meanwhile is refused with 409; every size gives the
    reference tokens."""
    two_members(ep)
    seen: dict[int, bool] = {}
    with Traffic(ep.url, MODEL) as traffic:
        conn, first = on_gateway(ep.url, None)
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(up=scale(conn, 3)))
        worker.start()

        def both_saw_it() -> bool:
            r = httpx.get(ep.url + "/is_scaling_elastic_ep", headers={"Connection": "close"}).json()
            if r["is_scaling_elastic_ep"]:
                seen[r["gateway"]] = True
            return len(seen) == 2

        wait_until(both_saw_it, 30, 0.0, "both gateways reporting the resize")
        other, second = on_gateway(ep.url, first)
        assert scale(other, 2)[0] == 409  # while the first resize runs
        worker.join(120)
        code, body = result["up"]
        assert code == 200, body
        assert body["new_data_parallel_size"] == 3 and body["pause_s"] < 10
        assert len(engines(ep)) == 3 and group(ep)["size"] == 3
        assert greedy(ep.url) == reference
        done_at_3 = traffic.ok

        code, body = scale(other, 1)
        assert code == 200 and body["gateway"] == second != first, body
        wait_until(lambda: len(procs(ep, "engine")) == 1, 30, what="the leavers to exit")
        assert group(ep)["size"] == 1
        assert greedy(ep.url) == reference
        wait_until(lambda: traffic.ok > done_at_3 + 4, 60, what="traffic at one member")
    assert not traffic.failed, traffic.failed[:5]
    assert traffic.ok > 0
    # The CLI resizes the group too, and `launch status` shows it.
    r = subprocess.run([*LAUNCH, "scale", "engine", "2", "--port", str(ep.port)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    shown = subprocess.run([*LAUNCH, "status", "--port", str(ep.port)], capture_output=True, text=True, timeout=30)
    assert f"expert parallel {MODEL}: 2 members" in shown.stdout, shown.stdout
    assert greedy(ep.url) == reference


def test_a_new_member_that_dies_while_loading_leaves_the_old_group_serving(ep, reference):
    two_members(ep)
    conn, _ = on_gateway(ep.url, None)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=scale(conn, 3)))
    worker.start()

    def the_new_member():
        for p in ep.descendants():
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if " ".join(cmd).strip() == "zserve: engine 2":  # (its title, set first thing: forked from the zygote)
                return p
            if "engine_worker" in cmd and "--launch" in cmd:  # (a fresh interpreter, before it sets its title)
                share = json.loads(cmd[cmd.index("--launch") + 1])["expert_share"]
                if share is not None and share[0] == 2:  # (member, size): member 2
                    return p
        return None

    os.kill(wait_until(the_new_member, 30, 0.01, "the new member's process").pid, signal.SIGKILL)
    worker.join(120)
    code, body = result["r"]
    assert code == 500, body
    assert "failed to start" in body["error"]["message"]
    st = group(ep)
    assert st["size"] == 2 and st["phase"] is None and "failed to start" in st["last_error"]
    wait_until(lambda: len(procs(ep, "engine")) == 2, 30, what="only the two members left")
    assert greedy(ep.url) == reference


def test_a_drain_timeout_shorter_than_a_running_request_changes_nothing(ep, reference):
    two_members(ep)
    client = openai.OpenAI(base_url=ep.url + "/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(model=MODEL, prompt="a long story", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # it runs
    conn, _ = on_gateway(ep.url, None)
    code, body = scale(conn, 1, drain_timeout=0.5)
    assert code == 408, body
    assert group(ep)["size"] == 2 and len(engines(ep)) == 2
    for _ in range(5):
        assert next(chunks).choices[0].text is not None  # the running request goes on
    stream.close()
    assert greedy(ep.url) == reference


def test_a_member_killed_while_serving_loses_no_request_they_go_on_once_the_group_is_back(ep, reference):
    """The killed member's streams and the survivor's (its collectives failed: ERR_GROUP_LOST) go back to their
    gateways, which send them again with the tokens they produced once the group is formed again: every stream
    finishes and writes what an uninterrupted run writes."""
    two_members(ep)
    client = openai.OpenAI(base_url=ep.url + "/v1", api_key="x", max_retries=0, timeout=300)
    texts: dict[int, str] = {}
    ended: list[str] = []
    flowing: list[int] = []

    def long_stream(i: int) -> None:
        try:
            text = ""
            for n, chunk in enumerate(client.completions.create(model=MODEL, prompt=f"story {i}", max_tokens=160,
                                                                temperature=0, stream=True,
                                                                extra_body={"ignore_eos": True})):
                if n == 0:
                    flowing.append(i)
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason
            texts[i] = text
            ended.append(finish)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            ended.append(f"{type(e).__name__}: {e}")

    # Read before the streams start: `launch status` takes seconds on a loaded machine, in which the streams
    # could finish before the kill.
    generation = group(ep)["generation"]
    victim = next(p for p in engines(ep) if p["index"] == 1)
    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(flowing) == 4, 30, what="4 streams flowing")
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(240)
    assert ended == ["length"] * 4, ended
    st = group(ep)
    assert st["size"] == 2 and st["generation"] > generation and "died" in st["last_error"]
    # Uninterrupted, now that the group is back
    with ThreadPoolExecutor(4) as pool:
        again = dict(zip(texts, pool.map(lambda i: client.completions.create(
            model=MODEL, prompt=f"story {i}", max_tokens=160, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text, texts)))
    assert again == texts
    moved = httpx.get(ep.url + "/metrics", timeout=30).text
    assert 'zserve_migrations_total{cause="group_lost"}' in moved or 'cause="engine_lost"' in moved
    assert greedy(ep.url) == reference


def test_a_member_waiting_at_a_rendezvous_carries_out_the_newer_command_that_ends_the_wait(moe_dir, tmp_path):
    """The supervisor may form a group with a member that is dying (its sockets closed, so a survivor reported
    the loss, before the supervisor could reap it): the survivor waits at that rendezvous until the next
    command, for the group without the dead member, arrives. The survivor gives the wait up and carries that
    command out; it once dropped it (read while waiting, then cleared with the one it gave up), so the group
    stayed broken until the next rendezvous timed out a minute later and new requests got 503s meanwhile."""
    from launch.supervisor import ServeConfig, Supervisor
    from protocol.control import GroupCommand, GroupReport
    from zserve.catalog import resolve
    from zserve.config import EngineConfig, ModelSpec

    spec = ModelSpec(str(moe_dir), engines=2, engine=EngineConfig(dtype="float32", max_model_len=1024,
                                                                   expert_parallel=True))
    sup = Supervisor(ServeConfig(models=[(resolve(str(moe_dir)), spec)]))
    reports: list[tuple[str, int, str]] = []

    class Recorder:  # takes the place of the supervisor's ElasticGroup: this test commands the member itself
        def on_report(self, child, msg: GroupReport) -> None:
            reports.append((msg.event, msg.generation, msg.reason or ""))

    sup.group_of = lambda child: Recorder()  # type: ignore[method-assign,assignment,return-value]
    sup._make_run_dir()
    member = sup.arbiter._spawn("engine", 0)  # member 0 of 2, as the supervisor starts it
    try:
        def poll_until(cond, what: str):
            return wait_until(lambda: sup.arbiter.poll(0.05) or cond(), 60, 0.0, what)

        poll_until(lambda: member.ready, "the member to load")
        endpoints = (sup.arbiter.engine_endpoint(0), sup.arbiter.engine_endpoint(1))
        waiting = os.path.join(sup.run_dir, "ep-0-1.store")
        assert member.send(GroupCommand(1, 2, 0, waiting, endpoints))  # member 1 never comes
        poll_until(lambda: os.path.exists(waiting), "the member to wait at the rendezvous")
        assert member.send(GroupCommand(2, 1, 0, os.path.join(sup.run_dir, "ep-0-2.store"), endpoints[:1]))
        poll_until(lambda: ("formed", 2, "") in reports, "the member to form the newer group")
        assert reports == [("failed", 1, reports[0][2]), ("formed", 2, "")] and "newer group" in reports[0][2]
    finally:
        member.signal(signal.SIGKILL)
        member.proc.wait()
        member.close_pipes()
        sup.stop()
