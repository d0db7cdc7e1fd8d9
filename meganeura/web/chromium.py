"""Drive a headless Chromium through the DevTools protocol over ``--remote-debugging-pipe``
(standard library only): open a page, evaluate JavaScript (awaiting promises), take a
screenshot. The browser tests and ``bench``-style measurements use it; nothing else does.

The pipe protocol: Chromium reads commands on fd 3 and writes replies and events on fd 4, each
message one JSON object followed by a NUL byte (https://chromedevtools.github.io/devtools-protocol/).

WebGPU in a headless Chromium without a GPU (measured with Debian's Chromium 156): the flags of
:data:`FLAGS` give a SwiftShader adapter (Vulkan on the CPU). Without
``--enable-unsafe-webgpu`` ``navigator.gpu.requestAdapter()`` resolves to null, and so it does
when ``VK_ICD_FILENAMES`` or ``VK_DRIVER_FILES`` point the Vulkan loader elsewhere (our tests set
them for lavapipe), so the child's environment drops them.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time

FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--enable-unsafe-webgpu",
    "--use-webgpu-adapter=swiftshader",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--mute-audio",
)
# Variables that make Chromium's WebGPU adapter null (they point the Vulkan loader at lavapipe).
DROPPED_ENV = ("VK_ICD_FILENAMES", "VK_DRIVER_FILES", "VK_ADD_DRIVER_FILES")
INSTALL_HINT = "Debian/Ubuntu: apt-get install -y --no-install-recommends chromium"


class BrowserError(RuntimeError):
    """Chromium failed to start, a DevTools command failed, or page JavaScript threw."""


def find_chromium() -> str | None:
    """The path of a Chromium binary on PATH (``chromium``, ``chromium-browser``,
    ``google-chrome``), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _high_fd(fd: int) -> int:
    """``fd`` moved to a number >= 10 (close-on-exec), so dup2 onto 3/4 in the child cannot
    clobber it."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return new


class Chromium:
    """A headless Chromium with one page, driven over the DevTools pipe.

    Use as a context manager; ``console`` collects the page's console messages and uncaught
    exceptions (as text) for error reports.

    ``max_gpu_rss``: the GPU process (where SwiftShader compiles and runs the shaders) is
    killed when its resident memory exceeds this many bytes, and the page's WebGPU calls then
    fail with that reason in the report. SwiftShader has been seen growing past 8 GB compiling
    one conv2d kernel (docs/web.md); on a shared machine that must not run on.
    """

    def __init__(
        self,
        binary: str | None = None,
        width: int = 840,
        height: int = 640,
        max_gpu_rss: int = 3 << 30,
    ):
        binary = binary or find_chromium()
        if binary is None:
            raise BrowserError(f"chromium is not installed ({INSTALL_HINT})")
        self._profile = tempfile.mkdtemp(prefix="meganeura-chromium-")
        to_child_r, to_child_w = (_high_fd(f) for f in os.pipe())
        from_child_r, from_child_w = (_high_fd(f) for f in os.pipe())

        def wire():  # in the child, before exec: its fd 3 reads commands, fd 4 writes replies
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        args = [
            binary,
            *FLAGS,
            f"--user-data-dir={self._profile}",
            f"--window-size={width},{height}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env=env,
            close_fds=False,  # every other fd of ours is close-on-exec (PEP 446)
            preexec_fn=wire,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._out = os.fdopen(to_child_w, "wb", buffering=0)
        self._in = os.fdopen(from_child_r, "rb", buffering=0)
        self._next_id = 0
        self._replies: dict[int, queue.Queue] = {}
        self._events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.console: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._max_gpu_rss = max_gpu_rss
        threading.Thread(target=self._watch_memory, daemon=True).start()
        self.session = None
        try:
            target = self.send("Target.createTarget", {"url": "about:blank"}, timeout=30)
        except BrowserError as e:
            self.close()
            raise BrowserError(f"{binary} did not start: {e}\nstderr:\n{self.stderr()}") from None
        target = target["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        self.send("Page.enable")
        self.send("Runtime.enable")
        # The viewport exactly (a headless window's viewport is smaller than --window-size).
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = self._in.read(65536)
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        q = self._replies.get(msg["id"])
                    if q is not None:
                        q.put(msg)
                else:
                    self._event(msg)
        with self._lock:
            for q in self._replies.values():
                q.put({"error": {"message": "the browser closed the DevTools pipe"}})

    def _watch_memory(self) -> None:
        """Kill the GPU process (a descendant of the browser: Chromium's zygote forks it) once
        its resident memory exceeds ``max_gpu_rss`` (Linux /proc)."""
        while self.proc.poll() is None:
            parents, gpu = {}, []
            for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if b"--type=gpu-process" in f.read():
                            gpu.append(int(entry))
                except (OSError, ValueError, IndexError):
                    continue
            for pid in gpu:
                up, hops = parents.get(pid), 0
                while up not in (None, 0, 1, self.proc.pid) and hops < 16:
                    up, hops = parents.get(up), hops + 1
                if up != self.proc.pid:
                    continue  # another browser's
                try:
                    with open(f"/proc/{pid}/status") as f:
                        rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) << 10
                except (OSError, ValueError, StopIteration):
                    continue
                if rss > self._max_gpu_rss:
                    self.console.append(
                        f"killed Chromium's GPU process: {rss >> 20} MiB resident, over the "
                        f"{self._max_gpu_rss >> 20} MiB allowed (SwiftShader compiling a shader?)"
                    )
                    try:
                        os.kill(pid, 9)
                    except OSError:
                        pass
            time.sleep(0.5)

    def _event(self, msg: dict) -> None:
        method, p = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
            self.console.append(f"console.{p['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.console.append(
                f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}"
            )
        self._events.put(msg)

    def send(self, method: str, params: dict | None = None, timeout: float = 60.0) -> dict:
        """Send one DevTools command (to the page's session once attached) and return its
        result.

        Raises:
            BrowserError: the command failed, or no reply came within ``timeout`` seconds.
        """
        with self._lock:
            self._next_id += 1
            mid = self._next_id
            q = self._replies[mid] = queue.Queue()
        msg = {"id": mid, "method": method, "params": params or {}}
        if self.session is not None:
            msg["sessionId"] = self.session
        try:
            if not self._reader.is_alive():  # closed before this command was registered
                raise BrokenPipeError("the DevTools pipe is closed")
            self._out.write(json.dumps(msg).encode() + b"\0")
            reply = q.get(timeout=timeout)
        except OSError as e:  # the browser exited: its pipe is closed
            raise BrowserError(f"{method}: {e} (the browser exited){self._tail()}") from None
        except queue.Empty:
            raise BrowserError(f"{method}: no reply within {timeout} s{self._tail()}") from None
        finally:
            with self._lock:
                self._replies.pop(mid, None)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}{self._tail()}")
        return reply.get("result", {})

    def goto(self, url: str, timeout: float = 30.0) -> None:
        """Navigate to ``url`` and wait for its load event."""
        while not self._events.empty():
            self._events.get_nowait()
        self.send("Page.navigate", {"url": url})
        end = time.monotonic() + timeout
        while True:
            try:
                msg = self._events.get(timeout=max(end - time.monotonic(), 0.01))
            except queue.Empty:
                raise BrowserError(f"{url} did not load within {timeout} s") from None
            if msg.get("method") == "Page.loadEventFired":
                return

    def evaluate(self, expression: str, timeout: float = 120.0):
        """The JSON value of ``expression`` in the page (a promise is awaited).

        Raises:
            BrowserError: the expression threw (with the page's console output).
        """
        r = self.send(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
            timeout=timeout,
        )
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            what = d.get("exception", {}).get("description") or d.get("text")
            raise BrowserError(f"the page's JavaScript threw: {what}{self._tail()}")
        return r["result"].get("value")

    def screenshot(self) -> bytes:
        """A PNG of the page's viewport."""
        return base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])

    def _tail(self) -> str:
        lines = self.console[-20:]
        return ("\npage console:\n  " + "\n  ".join(lines)) if lines else ""

    def stderr(self) -> str:
        """What Chromium wrote to stderr so far (its last 4 kB)."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.send("Browser.close", timeout=5)
                except BrowserError:
                    pass
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            self._out.close()
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
