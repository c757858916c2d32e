"""A real browser for the tests: Debian's headless Chromium, driven over the Chrome DevTools
Protocol on a pipe (``--remote-debugging-pipe``: commands in on fd 3, answers out on fd 4,
each a JSON text ending in a NUL byte), so a test can open a page, read what the page says
about itself, and take a screenshot, with no WebSocket client and no port.

The flags are those of the CORS browser test (tests/integration/test_cors_and_legacy.py),
which run on CI.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-quic", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars")

_LAUNCH = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
           "os.execv(sys.argv[3], sys.argv[3:])")


def chromium_or_skip() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium to run the page in: install Debian's chromium package "
                "(`make test` does, when run as root)")


class Browser:
    """One headless Chromium; ``open`` a page, then ``evaluate`` in it and ``screenshot`` it.
    Use it as a context manager: it is closed (and killed if it must be) at the end."""

    def __init__(self, work_dir: Path, width: int = 1280, height: int = 1800) -> None:
        chromium = chromium_or_skip()
        self.width, self.height = width, height
        self.log = work_dir / "chromium.log"
        to_browser, self._commands = os.pipe()
        self._answers, from_browser = os.pipe()
        # A small launcher puts the two pipe ends on fds 3 and 4, where Chromium looks for
        # them, and becomes Chromium (dash's redirections take only fds 0-9).
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, str(to_browser), str(from_browser), chromium,
                 *FLAGS,
                 f"--user-data-dir={work_dir / 'profile'}", "--remote-debugging-pipe",
                 "about:blank"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(to_browser, from_browser))
        os.close(to_browser)
        os.close(from_browser)
        self._next_id = 0
        self._buffer = b""
        self._session: str | None = None

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def call(self, method: str, params: dict[str, Any] | None = None, *,
             session: bool = True, timeout_s: float = 30) -> dict[str, Any]:
        """Send one command (to the open page's session unless ``session`` is False) and
        return its result; events that come in between are dropped."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method,
                                   "params": params or {}}
        if session and self._session is not None:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self._read(deadline)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise AssertionError(f"{method}: {answer['error']}")
                return answer.get("result", {})  # type: ignore[no-any-return]

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._answers], [], [], max(0.0, left))
            if not ready:
                raise AssertionError(f"Chromium did not answer in time: {self.log_tail()}")
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                raise AssertionError(f"Chromium went away: {self.log_tail()}")
            self._buffer += chunk
        text, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(text)  # type: ignore[no-any-return]

    def open(self, url: str) -> None:
        """Open ``url`` in a new page of the window's size (sent over the pipe: a secret in
        its fragment is in no process list)."""
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = self.call("Target.attachToTarget",
                             {"targetId": target["targetId"], "flatten": True}, session=False)
        self._session = attached["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", {
            "width": self.width, "height": self.height, "deviceScaleFactor": 1,
            "mobile": False})
        self.call("Page.enable")
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the open page (JSON-able values)."""
        result = self.call("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True})
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout_s: float = 60) -> Any:
        """Poll ``expression`` in the page until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except AssertionError as error:  # the page is still loading: no context yet
                value = error
            if value and not isinstance(value, AssertionError):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: last {value!r}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.call("Browser.close", session=False, timeout_s=10)
            except (AssertionError, OSError):
                pass
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)
        for fd in (self._commands, self._answers):
            try:
                os.close(fd)
            except OSError:
                pass
