"""`meshlm layout list`: the directories load_layout searches, in its order, and for each
name the file it loads, so a user finds the shipped layouts wherever meshlm is installed."""

from __future__ import annotations

from pathlib import Path

from meshlm.app.cli import main
from meshlm.layout.rules import layout_dirs, load_layout

SHIPPED = Path(__file__).resolve().parents[2] / "layouts"


def test_list_names_every_layout_and_its_file(tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "ddp.yaml").write_text("# ddp: my own ddp. It shadows the shipped one.\nparams: {}\n")
    (mine / "wide.yaml").write_text("params:\n  mlp: tp\n")  # no header comment
    monkeypatch.setenv("MESHLM_LAYOUTS", f"{mine}:{tmp_path / 'absent'}")
    assert main(["layout", "list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # the search order, the user's directories first (a missing one says so)
    assert lines[1:4] == [f"  {mine}", f"  {tmp_path / 'absent'} (missing)", f"  {SHIPPED}"], lines[:5]
    assert layout_dirs()[0] == mine
    # each name once, with the file load_layout loads: the user's ddp shadows the shipped one
    names = [p.stem for p in SHIPPED.glob("*.yaml")] + ["wide"]
    w = max(map(len, names))
    for name in names:
        rows = [ln for ln in lines if ln.split(" ")[0] == name]
        assert rows == [f"{name:<{w}}  {load_layout(name).source}"], (name, rows)
    assert f"{'ddp':<{w}}  {mine / 'ddp.yaml'}\n{'':<{w}}  my own ddp." in out
    assert f"{'fsdp_tp':<{w}}  {SHIPPED / 'fsdp_tp.yaml'}\n{'':<{w}}  2-D parallelism" in out
    assert "layout.name=NAME" in out


def test_layout_dirs_without_the_variable(monkeypatch):
    """Unset (or empty) ``MESHLM_LAYOUTS``: an installed meshlm's ``meshlm/layouts``, then a
    checkout's ``layouts/``, and nothing else."""
    pkg = Path(__file__).resolve().parents[2] / "meshlm"
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("MESHLM_LAYOUTS", raising=False)
        else:
            monkeypatch.setenv("MESHLM_LAYOUTS", value)
        assert layout_dirs() == [pkg / "layouts", SHIPPED]
