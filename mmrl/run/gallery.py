"""Validation galleries: one browsable HTML page per validation, plus an index of them all.

People judge a VLM run faster by looking at what it answered about which image than by
reading a metric, so each validation writes `gallery/step_NNNNNNNN.html`: image, prompt,
response, extracted answer, ground truth and reward for each sample.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmrl.rewards import extract_answer

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5rem;background:#fafafa;color:#222}
h1{font-size:1.3rem} .meta{color:#666;margin-bottom:1rem}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:10px;border-top:5px solid #bbb}
.card.good{border-top-color:#2e9d49} .card.bad{border-top-color:#d33}
.card img{max-width:100%;image-rendering:pixelated;border:1px solid #eee;display:block;margin-bottom:6px}
.k{color:#777;font-size:.8rem;text-transform:uppercase;letter-spacing:.03em}
pre{white-space:pre-wrap;word-break:break-word;margin:.1rem 0 .5rem;font-size:.85rem;background:#f4f4f4;padding:4px}
table{border-collapse:collapse} td,th{padding:4px 10px;border-bottom:1px solid #ddd;text-align:left}
.missing{color:#d33;font-size:.85rem}
"""
# Marks every image as loaded or not once the page has loaded, and says so on the page: a gallery whose
# pictures silently fail (moved folder, unreadable file) would otherwise just look empty. The browser
# test reads the same marks.
_CHECK_IMAGES = """
addEventListener('load', () => {
  let broken = 0;
  for (const img of document.images) {
    const ok = img.complete && img.naturalWidth > 0;
    img.dataset.loaded = ok ? 'yes' : 'no';
    if (!ok) { broken++; img.insertAdjacentHTML('afterend',
      '<div class="missing">image failed to load: ' + img.getAttribute('src') + '</div>'); }
  }
  document.body.dataset.brokenImages = broken;
});
"""


@dataclass
class GalleryItem:
    """One validation sample as shown in the gallery."""

    images: list[Image.Image]
    prompt: str
    response: str
    ground_truth: Any
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    turns: list[dict[str, Any]] = field(default_factory=list)  # a multi-turn answer's: role, text, images


def frame_strip(frames: np.ndarray) -> Image.Image:
    """A video's frames side by side in one image, so a gallery card shows the clip the model saw."""
    return Image.fromarray(np.concatenate(list(frames), axis=1))


def write_gallery(run_dir: Path, step: int, items: list[GalleryItem], metrics: dict[str, float]) -> Path:
    """Write the page for one validation step and refresh the run's index; returns the page."""
    folder = run_dir / "gallery"
    images = folder / f"step_{step:08d}"
    images.mkdir(parents=True, exist_ok=True)
    cards = []
    for i, item in enumerate(items):
        shown = iter(range(10_000))

        def tag(image: Image.Image, i: int = i, shown: Any = shown) -> str:
            name = f"{i:04d}_{next(shown)}.png"
            image.save(images / name)
            return f'<img src="{images.name}/{name}" alt="sample {i} image {name}">'

        tags = [tag(image) for image in item.images]
        answer = extract_answer(item.response)
        response = f'<div class="k">response</div><pre>{html.escape(item.response)}</pre>'
        if item.turns:  # every turn in order: the model's text and tool calls, the tools' text and images
            response = "".join(
                f'<div class="k">{"model" if t["role"] == "assistant" else t["role"]} (turn {n})</div>'
                f"<pre>{html.escape(t['text'])}</pre>{''.join(tag(image) for image in t['images'])}"
                for n, t in enumerate(item.turns, start=1)
            )
        parts = ", ".join(f"{html.escape(k)} {v:.2f}" for k, v in item.components.items())
        verdict = "good" if item.reward > 0.5 else "bad"
        cards.append(
            f'<div class="card {verdict}">{"".join(tags)}'
            f'<div class="k">prompt</div><pre>{html.escape(item.prompt)}</pre>'
            f"{response}"
            f'<div class="k">answer / ground truth</div>'
            f"<pre>{html.escape(str(answer))} / {html.escape(str(item.ground_truth))}</pre>"
            f'<div class="k">reward</div><pre>{item.reward:.3f}{" (" + parts + ")" if parts else ""}</pre></div>'
        )
    summary = " · ".join(
        f"{html.escape(k)} {v:.3f}" for k, v in metrics.items() if isinstance(v, (int, float))
    )
    page = folder / f"step_{step:08d}.html"
    page.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>step {step}</title>"
        f"<style>{_STYLE}</style><script>{_CHECK_IMAGES}</script></head><body><h1>Validation at step {step}</h1>"
        f'<div class="meta"><a href="index.html">all steps</a> · {len(items)} samples · {summary}</div>'
        f'<div class="grid">{"".join(cards)}</div></body></html>',
        encoding="utf-8",
    )
    _write_index(folder, step, metrics)
    return page


def _write_index(folder: Path, step: int, metrics: dict[str, float]) -> None:
    """index.html lists every validation page with its accuracy; steps.json keeps the history."""
    history_file = folder / "steps.json"
    history = json.loads(history_file.read_text()) if history_file.exists() else {}
    history[str(step)] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    history_file.write_text(json.dumps(history, indent=1))
    rows = "".join(
        f'<tr><td><a href="step_{int(s):08d}.html">step {int(s)}</a></td>'
        f"<td>{values.get('val/accuracy', float('nan')):.3f}</td><td>{values.get('val/mean', float('nan')):.3f}</td></tr>"
        for s, values in sorted(history.items(), key=lambda kv: int(kv[0]))
    )
    (folder / "index.html").write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>validation gallery</title>"
        f"<style>{_STYLE}</style></head><body><h1>Validation gallery</h1>"
        f"<table><tr><th>step</th><th>accuracy</th><th>mean reward</th></tr>{rows}</table></body></html>",
        encoding="utf-8",
    )
