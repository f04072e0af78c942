"""`diffpipe serve RUN_DIR` (issue 56): the page loads in a real browser (Debian's Chromium, headless), shows the run's
loss, stage times and newest samples, and updates when the run appends a step; the server gives the run folder's
pictures and nothing else. The browser tests need /usr/bin/chromium: `.ci/run` installs it and sets
DIFFPIPE_BROWSER_TESTS=1, under which a missing browser fails the test instead of skipping it."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from diffpipe.commands import serve
from diffpipe.errors import CommandError

from .helpers import run_command


def _record(step: int) -> dict:
    return {"step": step, "loss": 1.0 / (step + 1), "lr": 1e-3, "samples_per_s": 100.0 + step,
            "bubble_fraction": 0.25, "stage0_compute_s": 0.5, "stage0_comm_s": 0.01, "stage0_bubble_s": 0.1,
            "stage1_compute_s": 0.4, "stage1_comm_s": 0.02, "stage1_bubble_s": 0.2}


def _append(run: Path, step: int) -> None:
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(_record(step)) + "\n")
    Image.new("RGB", (32, 32), (40, 40, 200)).save(run / "samples" / f"step-{step:08d}.png")


@pytest.fixture
def run(tmp_path) -> Path:
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    (run / ".diffpipe-run").write_text("")
    (run / "config.toml").write_text("[train]\nmax_steps = 10\n")
    (run / "config-secret.txt").write_text("not a picture")
    for step in range(3):
        _append(run, step)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a line the run is writing now
    return run


@pytest.fixture
def served(run):
    server = serve.make_server(run, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_the_server_gives_the_runs_state_and_pictures_and_nothing_else(served):
    status, body = _get(served + "/run.json")
    state = json.loads(body)
    assert status == 200 and [s["step"] for s in state["steps"]] == [0, 1, 2]  # the half-written line waits
    assert state["max_steps"] == 10 and state["samples"] == "samples/step-00000002.png"
    status, picture = _get(served + "/file/" + state["samples"])
    assert status == 200 and picture.startswith(b"\x89PNG")
    for outside in ("/file/config-secret.txt", "/file/../../etc/passwd", "/file/%2e%2e/run/config.toml", "/nothing"):
        assert _get(served + outside)[0] == 404, outside


def test_a_folder_that_is_not_a_run_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(CommandError, match="is not a run folder"):
        serve.make_server(tmp_path)
    assert run_command(["serve", str(tmp_path / "missing")]).returncode == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "missing does not exist" in said[0]


def _browser() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("DIFFPIPE_BROWSER_TESTS") == "1":
            pytest.fail("DIFFPIPE_BROWSER_TESTS=1 but no chromium: apt-get install chromium")
        pytest.skip("no chromium here (.ci/run installs it)")
    return found


def _page(browser: str, url: str, wait_ms: int) -> str:
    """The page's DOM after `wait_ms` of the page's own time (its two-second polls run inside it)."""
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--virtual-time-budget={wait_ms}", "--dump-dom", url],
                          capture_output=True, text=True, timeout=120, check=True).stdout


def _shown(dom: str, element: str) -> str:
    return re.search(rf'id="{element}"[^>]*>([^<]*)<', dom).group(1)


def test_the_page_shows_the_run_and_follows_it_as_steps_are_appended(run, served, monkeypatch):
    browser = _browser()
    asked = []

    def appending(run_dir):  # the run appends a step (and a sample) just after the page's first look
        state = serve_state(run_dir)
        asked.append([s["step"] for s in state["steps"]])
        if len(asked) == 1:
            (run / "metrics.jsonl").write_text("".join(json.dumps(_record(s)) + "\n" for s in range(4)))
            _append(run, 4)
        return state

    serve_state = serve.run_state
    monkeypatch.setattr(serve, "run_state", appending)
    dom = _page(browser, served + "/", 7000)
    assert len(asked) >= 2 and asked[0] == [0, 1, 2], asked  # it asked again by itself
    assert _shown(dom, "step") == "5" and _shown(dom, "max_steps") == "10"  # steps done: 0 to 4
    assert _shown(dom, "loss") == f"{1 / 5:.4f}"
    assert 'src="file/samples/step-00000004.png' in dom  # the newest samples
    assert "<polyline" in dom and dom.count("<td>0.400</td>") == 1  # the loss curve; stage 1's compute time


def test_a_screenshot_of_the_page_renders(run, served, tmp_path):
    browser = _browser()
    picture = tmp_path / "page.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--virtual-time-budget=3000", "--window-size=1100,800", f"--screenshot={picture}", served + "/"],
                   capture_output=True, timeout=120, check=True)
    with Image.open(picture) as shot:
        assert shot.size == (1100, 800) and len(set(shot.convert("L").getdata())) > 10  # drawn, not blank
