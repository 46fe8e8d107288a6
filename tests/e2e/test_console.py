"""The web console (``/ui``) in a real browser: Playwright driving Debian's headless Chromium (``.ci/run`` installs
it; Playwright's own browser download is not used) against a server of 2 gateways and 2 engines with API and admin
keys. Every test fails on any console error of the page."""

from __future__ import annotations

import json
import os
import shutil
import signal

import httpx
import jsonschema
import pytest

from tests.helpers import TINY, Server, wait_until

API_KEY, ADMIN_KEY = "sk-console-test", "admin-console-test"


@pytest.fixture(scope="module")
def server():
    s = Server("--count", "2", "--engines", "2", *TINY, "--max-model-len", "2048", "--api-key", API_KEY,
               "--admin-key", ADMIN_KEY, env={"ZSERVE_RESTART_BACKOFF": "0.1"}, log_name="console")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture()
def page(browser, server, request):
    """A fresh tab on /ui, its keys already typed (``request.param``: the keys, default both right); fails the test
    on any console error or uncaught exception, but the ones a test names in ``page.expected_errors``."""
    keys = getattr(request, "param", {"api-key": API_KEY, "admin-key": ADMIN_KEY})
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.add_init_script(f"for (const [k, v] of Object.entries({json.dumps(keys)})) sessionStorage.setItem(k, v);")
    errors: list[str] = []
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.expected_errors = []  # type: ignore[attr-defined]
    tab.goto(server.url + "/ui")
    yield tab
    context.close()
    unexpected = [e for e in errors if not any(x in e for x in tab.expected_errors)]  # type: ignore[attr-defined]
    assert not unexpected, unexpected


def rows(page) -> dict[tuple[str, str], dict]:
    """The processes table: (tier, index) -> its cells by column."""
    out = {}
    for tr in page.locator("#processes tbody tr").all():
        cells = tr.locator("td").all_inner_texts()
        out[(cells[0], cells[1])] = dict(zip(["tier", "index", "model", "pid", "state", "restarts", "uptime", "load"],
                                             cells))
    return out


def test_the_page_and_its_files_need_no_key_and_nothing_else_is_served_there(server):
    for path, kind in [("/ui", "text/html"), ("/ui/console.js", "text/javascript"), ("/ui/console.css", "text/css")]:
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), (path, r.status_code)
    assert httpx.get(server.url + "/ui/__init__.py").status_code == 401  # any other path there takes a key
    assert httpx.get(server.url + "/ui/__init__.py", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 404
    assert httpx.get(server.url + "/server_info").status_code == 401  # the data stays behind the keys


@pytest.mark.parametrize("body, status, says", [
    ({"tier": "engine", "count": 0, "model": "tiny-random"}, 400, "count"),
    ({"tier": "gateway", "count": 2, "model": "tiny-random"}, 400, "model chooses an engine tier"),
    ({"tier": "workers", "count": 2}, 400, "tier"),
    ({"tier": "engine", "count": "3"}, 400, "count"),
    ({"tier": "engine", "count": 2, "model": "nope"}, 404, "nope"),
])
def test_a_bad_scale_is_refused_in_openais_shape(server, body, status, says):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(server.url + "/scale", json=body, headers=admin, timeout=30)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/scale", json={"tier": "gateway", "count": 2}, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"


def test_the_cluster_view_lists_every_process_and_follows_a_killed_engine(page, server):
    wait_until(lambda: {("gateway", "0"), ("gateway", "1"), ("engine", "0"), ("engine", "1")} <= set(rows(page))
               and all(r["state"] == "ready" for r in rows(page).values()), 30, 0.2, "every process, ready, listed")
    engine = rows(page)[("engine", "1")]
    assert engine["model"] == "tiny-random" and "running" in engine["load"] and engine["restarts"] == "0"
    assert page.locator("#summary").inner_text().count("2 / 2") == 2  # gateways and engines: ready of desired

    os.kill(int(engine["pid"]), signal.SIGKILL)
    wait_until(lambda: (r := rows(page).get(("engine", "1"))) is not None and r["restarts"] == "1"
               and r["state"] == "ready" and r["pid"] != engine["pid"], 60, 0.2, "engine 1 back, restarted once")


def test_admin_actions_ask_first_then_scale_pause_and_resume_with_their_progress(page, server):
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss() if "to 4" in d.message else d.accept()))
    wait_until(lambda: page.locator("#actions").is_visible() and page.locator("#scale-tier option").count() == 2,
               30, 0.1, "the actions, with the admin key")

    def scale(count: int) -> None:
        page.select_option("#scale-tier", "engine:tiny-random")
        page.fill("#scale-count", str(count))
        page.click("#scale")

    scale(4)  # dismissed: nothing happens
    assert dialogs == ["Scale the engines of tiny-random to 4?"] and "scaling" not in page.inner_text("#action-status")
    scale(3)
    wait_until(lambda: "3 ready, done" in page.inner_text("#action-status"), 60, 0.2, "the scale-up's progress to end")
    assert rows(page)[("engine", "2")]["state"] == "ready"
    scale(2)
    wait_until(lambda: "2 ready, done" in page.inner_text("#action-status"), 60, 0.2, "the scale-down to end")
    wait_until(lambda: ("engine", "2") not in rows(page), 30, 0.2, "engine 2 gone from the table")

    page.click("#pause")  # every model
    wait_until(lambda: "paused: every model" in page.inner_text("#action-status"), 30, 0.1, "the pause")
    assert httpx.get(server.url + "/is_paused", headers={"Authorization": f"Bearer {API_KEY}"}).json()["is_paused"]
    wait_until(lambda: "paused" in page.inner_text("#summary") and "none" not in page.inner_text("#holds"), 10, 0.1,
               "the pause in the summary and the holds")
    page.click("#resume")
    wait_until(lambda: "resumed: every model" in page.inner_text("#action-status"), 30, 0.1, "the resume")
    assert not httpx.get(server.url + "/is_paused", headers={"Authorization": f"Bearer {API_KEY}"}).json()["is_paused"]
    assert dialogs[-2:] == ["Pause admission of every model?", "Resume admission of every model?"]


def test_the_load_charts_and_the_models_table_show_what_the_server_serves(page, server):
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        def served() -> bool:
            r = client.post(server.url + "/v1/chat/completions", json={
                "model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
            assert r.status_code == 200, r.text
            legend = page.locator("#chart-tokens .now").inner_text() if page.locator("#chart-tokens .now").count() \
                else ""
            return page.locator("#chart-tokens polyline").count() == 1 and legend.strip().startswith("tok/s") \
                and float(legend.split()[-1]) > 0

        wait_until(served, 30, 0.2, "generated tokens/s in the chart")
    row = page.locator('#models tbody tr[data-model="tiny-random"] td').all_inner_texts()
    assert row[0] == "tiny-random" and row[1] == "2", row
    for chart in ("requests", "ttft", "itl", "queue", "errors"):
        assert page.locator(f"#chart-{chart} svg line").count() == 3, chart  # its grid drawn, the axis labelled
    # Any gateway answers the same numbers; one that no console asked before starts sampling at this request.
    def sampled() -> dict | None:
        got = httpx.get(server.url + "/ui/api/series", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        return got if got["samples"] else None

    series = wait_until(sampled, 10, 0.5, "samples from the gateway this connection reached")
    assert series["interval"] == 1.0 and series["samples"][-1]["models"]["tiny-random"]["engines"] == 2


def chat(page, message: str, **settings: str) -> None:
    page.click("#tab-playground")
    wait_until(lambda: page.locator("#model option").count() > 0, 10, 0.1, "the models listed")
    for field, value in settings.items():
        page.fill(f"#{field}", value)
    page.fill("#message", message)
    page.press("#message", "Enter")


def test_a_chat_streams_into_the_page_with_its_speed(page):
    chat(page, "Hello there", **{"max-tokens": "24", "temperature": "1"})
    wait_until(lambda: "tokens/s" in page.locator("#stats").inner_text(), 30, 0.1, "the stream to end")
    answer = page.locator(".msg.assistant .body").last.inner_text()
    stats = page.locator("#stats").inner_text()
    assert answer and stats.split(" tokens")[0].isdigit() and int(stats.split(" tokens")[0]) >= 1, (answer, stats)
    assert page.locator(".msg.user .body").last.inner_text() == "Hello there"
    # The conversation goes on: the second turn carries the first.
    chat(page, "And then?", **{"max-tokens": "4"})
    wait_until(lambda: page.locator(".msg.assistant").count() == 2 and not page.is_disabled("#send"), 30, 0.1,
               "the second answer")


def test_the_json_schema_box_returns_json_that_the_schema_accepts(page):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    chat(page, "Is Paris in France?", **{"max-tokens": "64", "temperature": "0", "schema": json.dumps(schema)})
    wait_until(lambda: "tokens/s" in page.locator("#stats").inner_text() or page.locator("#chat-error").is_visible(),
               30, 0.1, "the answer")
    assert not page.locator("#chat-error").is_visible(), page.locator("#chat-error").inner_text()
    jsonschema.validate(json.loads(page.locator(".msg.assistant .body").last.inner_text()), schema)


@pytest.mark.parametrize("page", [{"api-key": "sk-wrong", "admin-key": "admin-wrong"}], indirect=True)
def test_a_wrong_key_shows_the_servers_401_message(page):
    page.expected_errors.append("status of 401")  # the browser's own line for each refused fetch
    wait_until(lambda: page.locator("#cluster-error").is_visible(), 10, 0.1, "the cluster view's error")
    assert "401" in page.locator("#cluster-error").inner_text() and "key" in page.locator("#cluster-error").inner_text()
    assert not page.locator("#actions").is_visible()
    page.click("#tab-playground")
    wait_until(lambda: page.locator("#chat-error").is_visible(), 10, 0.1, "the playground's error")
    assert "401: the API key is not valid" in page.locator("#chat-error").inner_text()


def test_the_embeddings_and_rerank_try_outs_answer_in_the_page(page):
    page.click("#tab-playground")
    page.check('input[name="mode"][value="embed"]')
    assert page.locator("#embed-form").is_visible() and not page.locator("#chat-form").is_visible()
    wait_until(lambda: page.locator("#embed-model option").count() > 0, 10, 0.1, "the models that embed")
    page.click("#embed")
    wait_until(lambda: page.locator("#similarity tr").count() == 4, 30, 0.1, "the similarity table")
    cells = page.locator("#similarity tr").nth(2).locator("td").all_inner_texts()
    assert len(cells) == 3 and cells[1] == "1.000", cells  # a text is itself
    assert "3 vectors of" in page.inner_text("#embed-stats")
    page.check('input[name="mode"][value="rerank"]')
    page.click("#rerank")
    wait_until(lambda: page.locator("#ranking li").count() == 3, 30, 0.1, "the ranking")
    scores = [float(t.rsplit("— ", 1)[1].split()[0]) for t in page.locator("#ranking li").all_inner_texts()]
    assert scores == sorted(scores, reverse=True)


def test_a_rolling_restart_from_the_page_replaces_every_process_and_says_so(page, server):
    """Last in this file: every process is new afterwards."""
    # The gateway a fetch was on can be the one replaced: the browser logs the dropped connection (the page retries).
    page.expected_errors.append("net::ERR_")
    r = httpx.post(server.url + "/reload", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    page.on("dialog", lambda d: d.accept())
    wait_until(lambda: page.locator("#actions").is_visible() and len(rows(page)) == 4, 30, 0.1, "the actions")
    before = {k: r["pid"] for k, r in rows(page).items()}
    page.click("#reload")
    wait_until(lambda: "processes replaced, done" in page.inner_text("#action-status"), 180, 0.2,
               "the rolling restart to end")
    assert "4 processes replaced" in page.inner_text("#action-status")
    after = {k: r["pid"] for k, r in rows(page).items()}
    assert set(after) == set(before) and not set(after.values()) & set(before.values()), (before, after)
