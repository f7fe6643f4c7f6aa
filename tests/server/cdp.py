"""A headless Chromium driven over the Chrome DevTools Protocol (websockets), for the KV page's
browser test: start, open a URL, evaluate JavaScript, take a screenshot, stop. Debian's
``chromium`` package is enough (no chromedriver, no selenium)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class Browser:
    """One headless browser with one page (``async with Browser(path) as b``)."""

    def __init__(self, binary: str, width: int = 1280, height: int = 1400) -> None:
        self.binary = binary
        self.size = (width, height)
        # Chromium's helper processes may still be writing into the profile as it is removed;
        # a leftover file in a temporary directory is no test failure.
        self._profile = tempfile.TemporaryDirectory(prefix="kvserve-chromium-",
                                                    ignore_cleanup_errors=True)
        self._proc: subprocess.Popen | None = None
        self._ws: Any = None
        self._ids = 0

    async def __aenter__(self) -> Browser:
        import websockets

        profile = Path(self._profile.name)
        self._proc = subprocess.Popen(
            [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", f"--window-size={self.size[0]},{self.size[1]}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # its own process group: the helpers end with it
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not start its DevTools endpoint")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with httpx.AsyncClient() as client:
            pages = (await client.get(f"http://127.0.0.1:{port}/json/list", timeout=10)).json()
        page = next(p for p in pages if p.get("type") == "page")
        self._ws = await websockets.connect(page["webSocketDebuggerUrl"], max_size=2**27)
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)  # helpers that outlived the browser
        self._profile.cleanup()

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._ids += 1
        my_id = self._ids
        await self._ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await asyncio.wait_for(self._ws.recv(), 60))
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def eval(self, expression: str) -> Any:
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                            awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page error: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Evaluate until truthy; returns that value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = await self.eval(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied: {expression}")
            await asyncio.sleep(0.2)

    async def screenshot(self, path: Path) -> Path:
        r = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(r["data"]))
        return path
