"""Caption held-out images of the shapes task with a trained vision-language model, and score
each part of the caption (docs/multimodal.md):

    python examples/caption_shapes.py CHECKPOINT --samples 60 --seed 12345

draws ``--samples`` new images (``meshlm.data.shapes``, a seed the training data did not
use), captions them greedily in one batch (``meshlm generate --image``'s path) and prints
how often the colour, the shape, the place and the whole caption are right."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv: "list[str] | None" = None) -> int:
    import json

    from meshlm.app.generate import load_model
    from meshlm.data.shapes import COLOURS, PLACES, SHAPES, write_shapes
    from meshlm.data.text import ByteTokenizer
    from meshlm.infer import generate
    from meshlm.infer.images import image_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--show", type=int, default=8, help="captions to print")
    a = ap.parse_args(argv)
    model = load_model(Path(a.checkpoint))
    with tempfile.TemporaryDirectory() as tmp:
        d = write_shapes(Path(tmp) / "heldout", a.samples, model.cfg.image_size, a.seed, 0.0)
        rows = [json.loads(line) for line in (d / "captions.jsonl").read_text().splitlines()]
        ids, inputs = image_prompts(model, [str(d / r["image"]) for r in rows], [[] for _ in rows])
        new = generate(model, ids, max_new_tokens=48, stop=[ord("\n")], inputs=inputs)
    tok = ByteTokenizer()
    got = [tok.decode([t for t in n if t != ord("\n")]) for n in new]

    def part(text: str, names) -> "str | None":
        return next((n for n in names if n in text), None)

    score = {"colour": 0, "shape": 0, "place": 0, "caption": 0}
    for r, g in zip(rows, got):
        want = r["text"]
        score["colour"] += part(want, COLOURS) == part(g, COLOURS)
        score["shape"] += part(want, SHAPES) == part(g, SHAPES)
        score["place"] += part(want, PLACES.values()) == part(g, PLACES.values())
        score["caption"] += want == g
    for r, g in list(zip(rows, got))[: a.show]:
        print(f"{r['text']:<32} -> {g}")
    n = len(rows)
    print(", ".join(f"{k} {v}/{n} ({100 * v / n:.0f}%)" for k, v in score.items()))
    print(f"chance: colour 1/{len(COLOURS)}, shape 1/{len(SHAPES)}, place 1/{len(PLACES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
