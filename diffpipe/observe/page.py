"""A run's progress as one web page (`diffpipe serve RUN_DIR`): what the page shows is read from the run folder on
every request, so it follows a run as it trains. The page asks for `run.json` every two seconds: the steps of
metrics.jsonl (a line still being written is left for the next read), the newest sample picture and the timeline.

    state = run_state(Path("runs/digits"))   # the JSON the page draws
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

__all__ = ["run_state", "PAGE", "SHOWN_SUFFIXES"]

SHOWN_SUFFIXES = (".png", ".gif", ".jpg", ".jpeg", ".webp")  # the run's files the page may show
_STEP_KEYS = ("step", "loss", "eval_loss", "lr", "samples_per_s", "bubble_fraction", "epoch")


def _steps(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, each with the keys the page draws (a stage's times among them)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line the run is writing now: read next time
            continue
        steps.append({k: v for k, v in record.items() if k in _STEP_KEYS or k.startswith("stage")})
    return steps


def _newest(folder: Path) -> str | None:
    """The newest picture in `folder` (by modification time, then name), relative to the run folder."""
    if not folder.is_dir():
        return None
    pictures = [p for p in folder.iterdir() if p.suffix.lower() in SHOWN_SUFFIXES]
    if not pictures:
        return None
    newest = max(pictures, key=lambda p: (p.stat().st_mtime, p.name))
    return f"{folder.name}/{newest.name}"


def run_state(run_dir: Path) -> dict:
    """What the page draws: the run's name, its length, its steps, its newest samples and its timeline."""
    max_steps = None
    try:
        max_steps = tomllib.loads((run_dir / "config.toml").read_text())["train"]["max_steps"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        pass
    samples = _newest(run_dir / "samples") or ("samples.png" if (run_dir / "samples.png").is_file() else None)
    return {"name": run_dir.resolve().name, "max_steps": max_steps, "steps": _steps(run_dir), "samples": samples,
            "timeline": "timeline.png" if (run_dir / "timeline.png").is_file() else None}


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>diffpipe run</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
 h1 { font-size: 20px; margin: 0 0 4px; } .dim { color: #777; }
 .row { display: flex; gap: 24px; flex-wrap: wrap; } .card { border: 1px solid #ddd; border-radius: 6px; padding: 12px; }
 table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: right; border-bottom: 1px solid #eee; }
 img { max-width: 100%; image-rendering: pixelated; }
</style></head>
<body>
<h1>diffpipe run <span id="name"></span></h1>
<div class="dim">step <span id="step">-</span> of <span id="max_steps">?</span> &middot; loss <span id="loss">-</span>
 &middot; <span id="speed">-</span> samples/s &middot; bubble <span id="bubble">-</span>
 &middot; updated <span id="updated">never</span></div>
<div class="row">
 <div class="card"><h2>loss</h2><svg id="chart" width="520" height="240"></svg></div>
 <div class="card"><h2>stage times (last timed step)</h2><table id="stages"></table></div>
</div>
<div class="row">
 <div class="card"><h2>newest samples <span id="samples_name" class="dim"></span></h2><img id="samples" alt="no samples yet"></div>
 <div class="card"><h2>timeline</h2><img id="timeline" alt="no timeline yet"></div>
</div>
<script>
function text(id, value) { document.getElementById(id).textContent = value; }
function chart(steps) {
  const svg = document.getElementById("chart"), w = 520, h = 240, pad = 40;
  const points = steps.filter(s => typeof s.loss === "number" && isFinite(s.loss));
  if (!points.length) { svg.innerHTML = ""; return; }
  const xs = points.map(s => s.step), ys = points.map(s => s.loss);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const px = s => pad + (s - x0) / (x1 - x0) * (w - 2 * pad), py = v => h - pad - (v - y0) / (y1 - y0) * (h - 2 * pad);
  const line = points.map(s => px(s.step).toFixed(1) + "," + py(s.loss).toFixed(1)).join(" ");
  svg.innerHTML = '<polyline fill="none" stroke="#3060c0" stroke-width="1.5" points="' + line + '"/>' +
    '<text x="4" y="' + (pad - 4) + '">' + y1.toPrecision(3) + '</text>' +
    '<text x="4" y="' + (h - pad + 14) + '">' + y0.toPrecision(3) + '</text>' +
    '<text x="' + pad + '" y="' + (h - 8) + '">step ' + x0 + '</text>' +
    '<text x="' + (w - pad - 60) + '" y="' + (h - 8) + '">step ' + x1 + '</text>';
}
function stages(steps) {
  const timed = steps.filter(s => "stage0_compute_s" in s);
  const table = document.getElementById("stages");
  if (!timed.length) { table.innerHTML = "<tr><td>no timed step yet</td></tr>"; return; }
  const last = timed[timed.length - 1];
  let rows = "<tr><th>stage</th><th>compute s</th><th>send s</th><th>bubble s</th><th>peak GiB</th></tr>";
  for (let i = 0; ("stage" + i + "_compute_s") in last; i++) {
    const f = k => { const v = last["stage" + i + "_" + k]; return typeof v === "number" ? v.toFixed(3) : "-"; };
    rows += "<tr><td>" + i + "</td><td>" + f("compute_s") + "</td><td>" + f("comm_s") + "</td><td>" +
            f("bubble_s") + "</td><td>" + f("peak_gib") + "</td></tr>";
  }
  table.innerHTML = rows;
}
function picture(id, path, version) {
  const img = document.getElementById(id);
  if (path) { img.src = "file/" + path + "?v=" + version; img.dataset.path = path; }
}
async function update() {
  try {
    const run = await (await fetch("run.json", {cache: "no-store"})).json();
    const steps = run.steps, last = steps[steps.length - 1];
    text("name", run.name); text("max_steps", run.max_steps ?? "?");
    if (last) {
      text("step", last.step + 1);  // steps done: metrics count from step 0
      text("loss", typeof last.loss === "number" ? last.loss.toFixed(4) : "-");
      text("speed", typeof last.samples_per_s === "number" ? last.samples_per_s.toFixed(1) : "-");
      const timed = steps.filter(s => typeof s.bubble_fraction === "number");
      text("bubble", timed.length ? (100 * timed[timed.length - 1].bubble_fraction).toFixed(0) + " %" : "-");
    }
    chart(steps); stages(steps);
    picture("samples", run.samples, steps.length); text("samples_name", run.samples || "");
    picture("timeline", run.timeline, steps.length);
    text("updated", new Date().toLocaleTimeString());
  } catch (error) { text("updated", "the server did not answer: " + error); }
}
update(); setInterval(update, 2000);
</script>
</body></html>
"""
