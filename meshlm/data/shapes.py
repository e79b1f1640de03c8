"""The shapes task: a small image-caption data set drawn with Pillow, no download.

Each image is one shape (circle, square, triangle) in one colour (red, green, blue, yellow)
in the left third, the middle or the right third of a light background, at a random size
and height; its caption names all three: ``"a red circle on the left"``, ``"a blue square in
the middle"``.  A fraction of the samples has no image, only a sentence about the shapes or
colours (``"a triangle has three corners"``), so a model sees text-only rows too.

Everything follows from the seed: the same arguments write the same files.  ``write_shapes``
writes ``images/NNNNN.png`` and ``captions.jsonl`` (the format :mod:`meshlm.data.images`
reads) into a directory; ``python -m meshlm.data.shapes DIR`` does it from the shell, and
``meshlm train data.format=images`` with ``data.path=null`` does it under the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from meshlm.data.pillow import pillow

if TYPE_CHECKING:
    from PIL import Image

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (215, 35, 35), "green": (35, 160, 60), "blue": (40, 70, 215), "yellow": (225, 195, 20)}
PLACES = {"left": "on the left", "middle": "in the middle", "right": "on the right"}
CORNERS = {"circle": "no corners", "square": "four corners", "triangle": "three corners"}
SUPERSAMPLE = 4  # drawn at 4x the size and scaled down: smooth edges at 16-32 pixels


def render(shape: str, colour: str, place: str, image_size: int, rng: random.Random) -> Image.Image:
    """One ``image_size`` x ``image_size`` RGB image of ``shape`` in ``colour`` at ``place``;
    its size, height, jitter and background shade drawn from ``rng``."""
    pil = pillow()
    s = image_size * SUPERSAMPLE
    shade = rng.randint(225, 255)
    img = pil.Image.new("RGB", (s, s), (shade, shade, shade))
    r = s * rng.uniform(0.09, 0.15)  # half the shape's width: it stays inside its third
    cx = s * (list(PLACES).index(place) + 0.5) / 3 + rng.uniform(-0.03, 0.03) * s
    cy = rng.uniform(r + 1, s - r - 1)
    box = (cx - r, cy - r, cx + r, cy + r)
    draw = pil.ImageDraw.Draw(img)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
    return img.resize((image_size, image_size), pil.Image.Resampling.LANCZOS)


def caption(shape: str, colour: str, place: str) -> str:
    return f"a {colour} {shape} {PLACES[place]}"


def text_only(rng: random.Random) -> str:
    """A sentence about the shapes or colours, for a sample without an image."""
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    return rng.choice([f"a {shape} has {CORNERS[shape]}", f"{colour} is a colour", f"a {shape} can be {colour}"])


def make_shapes(n: int, image_size: int, seed: int = 0, text_only_fraction: float = 0.1):
    """``n`` samples ``(image or None, caption)``: round(n * text_only_fraction) of them
    without an image, spread through the list by ``seed``."""
    rng = random.Random(f"meshlm-shapes:{seed}")  # str seeds hash by sha512: stable across runs
    n_text = round(n * text_only_fraction)
    no_image = set(rng.sample(range(n), n_text))
    out = []
    for i in range(n):
        if i in no_image:
            out.append((None, text_only(rng)))
            continue
        shape, colour, place = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(PLACES))
        out.append((render(shape, colour, place, image_size, rng), caption(shape, colour, place)))
    return out


def write_shapes(
    path: "str | os.PathLike", n: int, image_size: int, seed: int = 0, text_only_fraction: float = 0.1
) -> Path:
    """Write the shapes task to the directory ``path`` (``images/NNNNN.png``, ``captions.jsonl``)
    unless it is there already; returns ``path``.  Written to a temporary directory and renamed,
    so several processes may call it at once: one rename wins, and the others' copies (the
    same files) are removed."""
    dest = Path(path)
    if (dest / "captions.jsonl").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "images").mkdir(parents=True)
    lines = []
    for i, (img, text) in enumerate(make_shapes(n, image_size, seed, text_only_fraction)):
        rec = {"image": None, "text": text}
        if img is not None:
            rec["image"] = f"images/{i:05d}.png"
            img.save(tmp / rec["image"])
        lines.append(json.dumps(rec) + "\n")
    (tmp / "captions.jsonl").write_text("".join(lines))
    try:
        os.rename(tmp, dest)
    except OSError:  # another process's copy is there (or dest is a non-empty directory)
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / "captions.jsonl").is_file():
            raise
    return dest


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshlm.data.shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="directory to write (images/ and captions.jsonl); left alone if it holds them")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-only", type=float, default=0.1, help="fraction of samples without an image")
    a = ap.parse_args(argv)
    d = write_shapes(a.dir, a.samples, a.image_size, a.seed, a.text_only)
    print(f"shapes task: {a.samples} samples of {a.image_size}x{a.image_size} in {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
