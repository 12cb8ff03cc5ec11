"""Draw which drafter family serves best at which data size (issue 54, item 6) as a PNG.

Reads the points `bench_families.py --shards N --extra 448` measured, kept in a JSON file as a list of
{"family", "rows", "k3", "k7"} (served mean acceptance length), and draws one line per family and k against the
training rows on a log scale. Pillow only (vLLM brings it): no plotting library is a dependency of the project.

    .venv/bin/python benchmarks/plot_family_data_size.py benchmarks/family_data_size.json docs/family_data_size.png
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from PIL import Image, ImageDraw

WIDTH, HEIGHT, MARGIN = 720, 440, 70
COLORS = {"eagle3": (31, 119, 180), "dflash": (214, 39, 40)}
INK, GRID = (30, 30, 30), (225, 225, 225)


def draw(points: list[dict], title: str) -> Image.Image:
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    pen = ImageDraw.Draw(image)
    rows = sorted({p["rows"] for p in points})
    values = [p[f"k{k}"] for p in points for k in (3, 7)]
    lo, hi = math.floor(min(values) * 4) / 4, math.ceil(max(values) * 4) / 4
    x0, x1, y0, y1 = MARGIN, WIDTH - 30, HEIGHT - MARGIN, 50
    span = math.log2(rows[-1] / rows[0]) or 1.0

    def at(n: int, v: float) -> tuple[float, float]:
        return x0 + (x1 - x0) * math.log2(n / rows[0]) / span, y0 - (y0 - y1) * (v - lo) / (hi - lo)

    tick = lo
    while tick <= hi + 1e-9:  # a grid line every 0.25 tokens
        _, y = at(rows[0], tick)
        pen.line([(x0, y), (x1, y)], fill=GRID)
        pen.text((x0 - 40, y - 6), f"{tick:.2f}", fill=INK)
        tick += 0.25
    for n in rows:
        x, _ = at(n, lo)
        pen.line([(x, y0), (x, y0 + 5)], fill=INK)
        pen.text((x - 14, y0 + 10), f"{n:,}", fill=INK)
    pen.line([(x0, y0), (x1, y0)], fill=INK)
    pen.line([(x0, y0), (x0, y1)], fill=INK)
    pen.text((x0 + (x1 - x0) / 2 - 60, y0 + 30), "training rows (log scale)", fill=INK)
    pen.text((8, y1 - 22), "served mean acceptance length", fill=INK)
    pen.text((x0, 8), title, fill=INK)
    for n, (family, color) in enumerate(COLORS.items()):
        mine = sorted((p for p in points if p["family"] == family), key=lambda p: p["rows"])
        for k, width in ((7, 3), (3, 1)):
            line = [at(p["rows"], p[f"k{k}"]) for p in mine]
            pen.line(line, fill=color, width=width)
            for x, y in line:
                pen.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
        pen.text((x1 - 170, y0 - 40 + 16 * n), f"{family}: k=7 thick, k=3 thin", fill=color)
    return image


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    source, out = Path(argv[0]), Path(argv[1])
    points = json.loads(source.read_text())
    draw(points, "EAGLE-3 and DFlash on the demo, by training rows (512 held-out prompts)").save(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
