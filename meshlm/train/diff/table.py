"""The report as text: the sides, the first divergence, then the top N by relative difference."""

from __future__ import annotations

from typing import Optional

from meshlm.train.diff.compare import Report, Row


def _axes(axes: Optional[tuple]) -> str:
    if axes is None:
        return "?"
    if not axes:
        return "()"
    return "(" + ", ".join("-" if a is None else str(a) for a in axes) + ")"


def _num(x: float) -> str:
    return f"{x:.2e}" if x == x and abs(x) != float("inf") else ("inf" if x == x else "nan")


def side_line(name: str, meta: dict) -> str:
    """One line saying what a side ran."""
    if meta.get("implementation") == "transformers":
        return f"  {name}: transformers {meta.get('label', '')} (1 process, float32)".rstrip()
    parts = [
        f"layout {meta.get('layout', '?')}",
        f"mesh {meta.get('mesh', '?')} ({meta.get('world', '?')} process{'es' if meta.get('world', 1) != 1 else ''})",
        str(meta.get("compute_dtype", "?")),
        f"grad_accum {meta.get('grad_accum', '?')}",
    ]
    if meta.get("compile", "none") != "none":
        parts.append(f"compile {meta['compile']}")
    return f"  {name}: " + ", ".join(parts)


def format_report(report: Report, top: int = 10) -> str:
    """The text ``meshlm diff`` prints (docs/diff.md shows how to read it)."""
    lines = [
        f"meshlm diff: {len(report.rows)} tensors compared, {len(report.diverged)} beyond tolerance"
        + (f" ({report.meta_a.get('label')})" if report.meta_a.get("label") else ""),
        side_line("a", report.meta_a),
        side_line("b", report.meta_b) + "   (the reference: tolerances are computed from its values)",
        "",
    ]
    first = report.first
    if first is None:
        lines.append("the sides agree: every tensor is within its tolerance")
    else:
        lines += ["first divergence, in execution order:", *_detail(first), ""]
    if report.only_a or report.only_b:
        lines.append(
            f"not compared: {len(report.only_a)} tensors only on side a, {len(report.only_b)} only on side b"
            + (f" (e.g. {(report.only_a or report.only_b)[0]})" if report.only_a or report.only_b else "")
        )
        lines.append("")
    rows = report.top(top)
    lines.append(f"top {len(rows)} by relative difference:")
    lines += _table(rows)
    return "\n".join(lines)


def _detail(r: Row) -> list[str]:
    at = "" if r.index is None else f" at {list(r.index)}"
    out = [
        f"  {r.kind:<9} {r.where}" + ("" if r.kind in ("init", "grad", "param") else f"  {r.tensor}"),
        f"    logical axes {_axes(r.axes)}, shape {list(r.shape)}",
        f"    placements  a: {r.placements_a}   b: {r.placements_b}",
    ]
    if r.note:
        out.append(f"    {r.note}")
    else:
        out.append(
            f"    max |a-b| {_num(r.max_abs)}{at}   rel {_num(r.rel)}   tol {_num(r.tol)}   |a-b|/tol {_num(r.ratio)}"
        )
    return out


def _table(rows: list[Row]) -> list[str]:
    head = (
        "#",
        "kind",
        "where",
        "tensor",
        "axes",
        "placements a",
        "placements b",
        "max|a-b|",
        "rel",
        "tol",
        "x tol",
        "",
    )
    body = [
        (
            str(r.order),
            r.kind,
            r.where,
            "" if r.kind in ("init", "grad", "param") else r.tensor,
            _axes(r.axes),
            r.placements_a,
            r.placements_b,
            _num(r.max_abs),
            _num(r.rel),
            _num(r.tol),
            _num(r.ratio),
            "ok" if r.ok else "DIVERGED",
        )
        for r in rows
    ]
    w = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    return ["  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(x)).rstrip() for x in (head, *body)]
