"""A headless Chromium driven over the Chrome DevTools protocol on a pipe (no network, no extra
package): `--remote-debugging-pipe` reads commands on fd 3 and writes replies and events on fd 4,
one JSON message per NUL-terminated frame. Used by the viewer's tests (tests/test_records_viewer.py)
to load a page, collect every console error and uncaught exception, evaluate expressions in it
and take a screenshot.

The browser is Debian's `chromium-headless-shell` (or `chromium`): `.ci/run` and the README's test
command install it when it is missing."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time

BINARIES = ("chromium-headless-shell", "chromium", "google-chrome")


def find_browser() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless browser process with one page. `errors` collects the page's console errors
    (console.error, and the browser's own error log entries) and uncaught exceptions, as text."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1000, timeout: float = 30.0):
        self.timeout = timeout
        to_child, self._send_fd = os.pipe()  # we write commands, the browser reads fd 3
        self._recv_fd, from_child = os.pipe()  # the browser writes fd 4, we read
        # the child's ends, moved above 3 and 4 so that dup2 onto 3 and 4 cannot clobber them
        hi_in = fcntl.fcntl(to_child, fcntl.F_DUPFD, 10)
        hi_out = fcntl.fcntl(from_child, fcntl.F_DUPFD, 10)
        os.close(to_child)
        os.close(from_child)

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                 "--disable-extensions", "--hide-scrollbars", "--allow-file-access-from-files",
                 f"--window-size={width},{height}", "about:blank"]
        # bash (multi-digit descriptors) puts the pipe ends on fds 3 and 4, then becomes the browser (no Python code runs
        # between fork and exec in this multithreaded process)
        script = f'exec "$0" "$@" 3<&{hi_in} 4>&{hi_out} {hi_in}<&- {hi_out}>&-'
        self.proc = subprocess.Popen(["bash", "-c", script, binary, *flags], pass_fds=(hi_in, hi_out),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(hi_in)
        os.close(hi_out)
        self._buf = b""
        self._next_id = 0
        self._events: list[dict] = []
        self.errors: list[str] = []
        targets = self._call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self._call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})

    # ---- the protocol ----
    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._recv_fd], [], [], left)[0]:
                raise BrowserError(f"no message from the browser within {self.timeout} s")
            chunk = os.read(self._recv_fd, 1 << 16)
            if not chunk:
                raise BrowserError("the browser closed its pipe")
            self._buf += chunk
        frame, self._buf = self._buf.split(b"\0", 1)
        msg = json.loads(frame)
        self._note(msg)
        return msg

    def _note(self, msg: dict) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = params["exceptionDetails"]
            self.errors.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console.error: " + " ".join(str(a.get("value", a.get("description", "")))
                                                            for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(f"log: {params['entry'].get('text')} ({params['entry'].get('url', '')})")
        elif method:
            self._events.append(msg)

    def _call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._send_fd, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def call(self, method: str, params: dict | None = None) -> dict:
        return self._call(method, params, self.session)

    # ---- what the tests use ----
    def open(self, url: str) -> None:
        """Navigate and wait for the load event."""
        self._events.clear()
        self.call("Page.navigate", {"url": url})
        deadline = time.monotonic() + self.timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
            if time.monotonic() > deadline:
                raise BrowserError(f"{url} did not load within {self.timeout} s")
            self._read()

    def eval(self, expression: str):
        """The expression's value (JSON-able), evaluated in the page; an exception raises."""
        out = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in out:
            raise BrowserError(f"{expression[:80]}: {out['exceptionDetails'].get('exception', {}).get('description')}")
        return out["result"].get("value")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])

    def close(self) -> None:
        try:
            self._call("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._send_fd)
        os.close(self._recv_fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
