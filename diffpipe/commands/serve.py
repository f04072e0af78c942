"""`diffpipe serve`: a run's progress in a browser, without TensorBoard: one local page showing the loss, the newest
samples, each stage's compute, send and bubble time and the timeline, updating every two seconds while the run goes
on. Python's own HTTP server, nothing to install; it serves the page and the run folder's pictures, nothing else.

    diffpipe serve runs/digits                  # then open http://127.0.0.1:8000
    diffpipe serve runs/digits --port 8080 --host 0.0.0.0   # other machines reach it (no password: trusted networks)

On a remote GPU machine, `ssh -L 8000:127.0.0.1:8000 gpu-box` brings the page to your own browser.
"""
from __future__ import annotations

import json
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..errors import CommandError
from ..observe.page import PAGE, SHOWN_SUFFIXES, run_state
from ..written_files import RUN_MARK

__all__ = ["serve_command", "make_server"]

_TYPES = {".png": "image/png", ".gif": "image/gif", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}


class _RunPage(BaseHTTPRequestHandler):
    def __init__(self, *args, run_dir: Path, **kwargs):
        self.run_dir = run_dir
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        path = unquote(urlparse(self.path).path)
        if path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", PAGE.encode())
        elif path == "/run.json":
            self._send(200, "application/json", json.dumps(run_state(self.run_dir)).encode())
        elif path.startswith("/file/"):
            self._picture(path.removeprefix("/file/"))
        else:
            self._send(404, "text/plain", b"not found")

    def _picture(self, relative: str) -> None:
        """A picture of the run folder: nothing outside it, nothing but pictures."""
        target = (self.run_dir / relative).resolve()
        inside = target.is_relative_to(self.run_dir.resolve())
        if not (inside and target.suffix.lower() in SHOWN_SUFFIXES and target.is_file()):
            self._send(404, "text/plain", b"not found")
            return
        self._send(200, _TYPES[target.suffix.lower()], target.read_bytes())

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # one line a request would bury the run's own output
        pass


def make_server(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """The page's server for `run_dir` (port 0: any free port; `server.server_address` says which)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CommandError(f"{run_dir} does not exist; give a run folder (the output.dir `diffpipe train` writes)")
    if not (run_dir / RUN_MARK).is_file() and not (run_dir / "metrics.jsonl").is_file():
        raise CommandError(f"{run_dir} is not a run folder (no {RUN_MARK}, no metrics.jsonl); give the folder "
                           "`diffpipe train` writes (its output.dir)")
    try:
        return ThreadingHTTPServer((host, port), partial(_RunPage, run_dir=run_dir))
    except OSError as exc:
        raise CommandError(f"cannot serve on {host}:{port} ({exc.strerror}); choose another with --port") from None


def serve_command(run_dir: str, host: str, port: int) -> None:
    server = make_server(run_dir, host, port)
    address = f"http://{host}:{server.server_address[1]}"
    print(f"serving {run_dir} at {address} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        server.server_close()
