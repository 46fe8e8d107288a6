"""The screenshots of the web console in docs/images/ (README, docs/console.md), taken again with:

    .venv/bin/python tests/console_screenshots.py

A server of 2 gateways and 2 engines of tiny-random with SmolLM2-135M beside it (``launch api-server``), Debian's
headless Chromium through Playwright: the cluster view and the playground after one streamed answer, in the light
and the dark scheme, and the playground at a phone's width. Also prints what the page weighs on a first load (bytes
the browser received for the page and its files, headers included)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

from tests.helpers import Server, wait_until  # noqa: E402

OUT = ROOT / "docs" / "images"


def main() -> None:
    from playwright.sync_api import sync_playwright

    OUT.mkdir(parents=True, exist_ok=True)
    server = Server("--count", "2", "--engines", "2", "--model", "SmolLM2-135M-Instruct", "--model", "tiny-random",
                    "--max-model-len", "2048", log_name="screenshots")
    stop = threading.Event()

    def load(model: str, tokens: int) -> None:  # traffic for the charts: streamed and sampled, as clients send
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                client.post(server.url + "/v1/chat/completions", json={
                    "model": model, "max_tokens": tokens, "temperature": 1.0,
                    "messages": [{"role": "user", "content": "Tell me about the rivers of France."}]})

    threads = [threading.Thread(target=load, args=(m, n), daemon=True)
               for m, n in [("SmolLM2-135M-Instruct", 48)] * 3 + [("tiny-random", 32)] * 2]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), headless=True,
                                        args=["--no-sandbox", "--disable-gpu"])
            for scheme in ("light", "dark"):
                page = browser.new_page(viewport={"width": 1280, "height": 760}, color_scheme=scheme)
                received = []
                page.on("response", lambda r, got=received: got.append(len(r.body()) + sum(
                    len(k) + len(v) + 4 for k, v in r.headers.items())))
                page.goto(server.url + "/ui")
                wait_until(lambda pg=page: pg.locator("#processes tbody tr").count() >= 6, 60, 0.2, "the processes")
                if scheme == "light":
                    print(f"first load: {sum(received)} bytes in {len(received)} responses")
                    for t in threads:
                        t.start()
                    time.sleep(40)  # the charts fill
                else:
                    time.sleep(3)
                page.screenshot(path=str(OUT / f"console-cluster-{scheme}.png"), full_page=True)
                page.click("#tab-playground")
                wait_until(lambda pg=page: pg.locator("#model option").count() > 0, 10, 0.1, "the models")
                page.select_option("#model", "SmolLM2-135M-Instruct")
                page.fill("#system", "You are a concise assistant.")
                page.fill("#max-tokens", "60")
                page.fill("#message", "Name three rivers of France.")
                page.press("#message", "Enter")
                wait_until(lambda pg=page: "tokens/s" in pg.locator("#stats").inner_text(), 120, 0.2, "the answer")
                page.screenshot(path=str(OUT / f"console-playground-{scheme}.png"), full_page=True)
                page.close()
            phone = browser.new_page(viewport={"width": 390, "height": 844}, device_scale_factor=2)
            phone.goto(server.url + "/ui")
            phone.click("#tab-playground")
            wait_until(lambda: phone.locator("#model option").count() > 0, 10, 0.1, "the models")
            phone.screenshot(path=str(OUT / "console-phone.png"))
            browser.close()
    finally:
        stop.set()
        server.stop()


if __name__ == "__main__":
    main()
