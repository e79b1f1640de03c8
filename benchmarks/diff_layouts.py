"""How close every shipped layout comes to its tolerances, and how far the tests' bugs go past
them: ``meshlm diff`` of each layout against ``single`` on one device, as the command runs it
(worker processes started by the launcher), llama_tiny, one step.

    python benchmarks/diff_layouts.py [--layouts ddp,tp_sp] [--seq 32] [--batch 8]

For each layout it prints the worst |a - b| / tol of each kind of tensor (init, block,
constrain, loss, grad, norm, param; agreement is <= 1), and, with ``--compile`` and
``--bf16``, the same with side a compiled (aot_eager) or in bf16.  The numbers behind
NOTE [activation tolerance] in meshlm/train/tolerances.py and docs/diff.md.  The slow,
exhaustive variant of tests/dist/test_diff.py (which runs the layouts once, at seq 16).

Writes benchmarks/results/diff/layouts.json and benchmarks/results/diff/layouts.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshlm.app.diff import diff

LAYOUTS = {
    "single": ["a.mesh=dp2"],
    "ddp": ["a.mesh=dp4"],
    "zero1": ["a.mesh=dp4"],
    "zero2": ["a.mesh=dp4"],
    "fsdp": ["a.mesh=fsdp4"],
    "hsdp": ["a.mesh=dp2_fsdp2"],
    "tp": ["a.mesh=tp4"],
    "tp_sp": ["a.mesh=tp4"],
    "fsdp_tp": ["a.mesh=fsdp2_tp2"],
    "fsdp_tp_sp": ["a.mesh=fsdp2_tp2"],
    "pp": ["a.mesh=pp2", "train.grad_accum=2"],
    "fsdp_pp": ["a.mesh=fsdp2_pp2", "train.grad_accum=2"],
    "fsdp_tp_pp": ["a.mesh=pp2", "a.mesh.tp=2", "train.grad_accum=2"],
    "vlm_fsdp_tp": ["a.mesh=fsdp2_tp2", "model=vlm_tiny", "data.format=images", "data.shapes_samples=64"],
}
KINDS = ("init", "block", "constrain", "loss", "grad", "norm", "param")
VARIANTS = {"eager": [], "compile": ["a.train.compile=aot_eager"], "bf16": ["a.train.param_dtype=bfloat16"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--compile", action="store_true", help="also with side a compiled (aot_eager)")
    p.add_argument("--bf16", action="store_true", help="also with side a in bf16")
    p.add_argument("--out", default="benchmarks/results/diff")
    a = p.parse_args()
    variants = ["eager"] + (["compile"] if a.compile else []) + (["bf16"] if a.bf16 else [])
    rows = []
    for name in a.layouts.split(","):
        extra = LAYOUTS[name]
        seq = 64 if "model=vlm_tiny" in extra else a.seq
        base = ["model=llama_tiny", f"train.seq_len={seq}", f"train.batch_size={a.batch}", "train.progress=false"]
        for v in variants:
            r = diff([*base, f"a.layout={name}", *extra, *VARIANTS[v], "b.layout=single", "b.mesh=cpu1"])
            worst = {k: max((x.ratio for x in r.rows if x.kind == k), default=None) for k in KINDS}
            rows.append({"layout": name, "variant": v, "agree": r.agree, "compared": len(r.rows), **worst})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layouts.json").write_text(json.dumps(rows, indent=1) + "\n")
    head = ["layout", "variant", "agree", *KINDS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["layout"], r["variant"], "yes" if r["agree"] else "NO"]
        cells += ["-" if r[k] is None else f"{r[k]:.2g}" for k in KINDS]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "layouts.md").write_text(
        f"Worst |a - b| / tol per kind of tensor, each layout (side a) against single on one device (side b); "
        f"llama_tiny, batch {a.batch}, seq {a.seq} (vlm_tiny: 64). python benchmarks/diff_layouts.py\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print((out / "layouts.md").read_text())


if __name__ == "__main__":
    main()
