"""Screenshot of the admin console's Overview under load, for the README (docs/dashboard.png).

Starts `loraserve serve` on the embedded demo (random-weight model, `demo` tenant, two adapters)
in a temporary data directory, sends streaming requests to the demo adapters and the base model
for `--seconds`, signs in to /admin with Debian's Chromium through Playwright and saves the page.

    .venv/bin/python scripts/screenshot_console.py --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
ADMIN_KEY = "lsa-screenshot-admin-key"
PROMPTS = ["Write a haiku about the sea.", "Summarize the plot of Hamlet.", "List three prime numbers."]
logger = logging.getLogger("screenshot_console")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    loraserve = str(Path(sys.executable).with_name("loraserve"))
    env = {**os.environ, "LORASERVE_ADMIN_KEY": ADMIN_KEY, "LORASERVE_LOG_LEVEL": "warning"}
    cmd = [loraserve, "serve", "--data-dir", str(data_dir), "--port", str(port), "--num-kv-blocks", "96"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"loraserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not ready after 300 s")


def load(base_url: str, key: str, models: list[str], stop: threading.Event, seed: int) -> None:
    """One client: streaming chat requests back to back, Zipf-ish over the models."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        while not stop.is_set():
            body = {
                "model": rng.choices(models, weights=[1 / (i + 1) for i in range(len(models))])[0],
                "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": rng.randint(16, 64),
                "stream": True,
            }
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    pass


def shoot(base_url: str, out: Path, seconds: float) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 980}, device_scale_factor=1)
        page.goto(f"{base_url}/admin")
        page.fill("#admin_key", ADMIN_KEY)
        page.click("button[type=submit]")
        page.wait_for_selector("#alarms")
        time.sleep(seconds)
        page.screenshot(path=str(out), full_page=True)
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--seconds", type=float, default=90.0, help="load before the screenshot")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(Path(tmp) / "data", port)
        stop = threading.Event()
        try:
            key = (Path(tmp) / "data" / "demo-tenant.key").read_text().strip()
            models = ["demo-qv-r8", "demo-all-r4", "loraserve-demo"]
            clients = [
                threading.Thread(target=load, args=(base_url, key, models, stop, i), daemon=True)
                for i in range(args.clients)
            ]
            for c in clients:
                c.start()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            shoot(base_url, args.out, args.seconds)
            logger.info("saved %s", args.out)
        finally:
            stop.set()
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
