"""One source of config defaults (NOTE [config defaults] in meshlm/app/config.py): every key's
default is its dataclass field's; ``conf/`` holds only choices (the quickstart's groups, and
what each group option sets that differs), and the docs' default columns agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshlm.app.config import RunConfig, compose

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
DEFAULTS = RunConfig().to_dict()
#: what a group option is, rather than a value it sets: the layout it names, the model it builds
IDENTITY = {("layout", "name"), ("model", "_target_"), ("model", "name"), ("optim", "_target_")}
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def _yaml(path: Path) -> dict:
    """The file as Hydra reads it (OmegaConf's YAML: ``1e-05`` is a number)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path)) or {}  # type: ignore[return-value]


def _option(group: str, name: str) -> dict:
    """What option ``name`` of ``group`` sets, its own defaults list (other options) resolved."""
    body = _yaml(CONF / group / f"{name}.yaml")
    out: dict = {}
    for entry in body.pop("defaults", ["_self_"]):
        out.update(body if entry == "_self_" else _option(group, entry))
    return out


def _chosen() -> dict[str, str]:
    """The group options conf/config.yaml's defaults list picks."""
    return {k: v for e in _yaml(CONF / "config.yaml")["defaults"] if isinstance(e, dict) for k, v in e.items()}


def test_conf_writes_no_default():
    """A value in conf/ equal to its dataclass default is a default written twice."""
    written = [(f"conf/{g}/{f.name}", g, body) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))
               for body in [_yaml(f)]]  # fmt: skip
    top = _yaml(CONF / "config.yaml")
    written += [("conf/config.yaml", s, body or {}) for s, body in top.items() if s not in ("defaults", "hydra")]
    twice = [
        f"{where}: {section}.{key}={value!r}"
        for where, section, body in written
        for key, value in body.items()
        if (section, key) not in IDENTITY and key in DEFAULTS.get(section, {}) and value == DEFAULTS[section][key]
    ]
    assert len(written) > 40
    assert not twice, f"conf/ restates the dataclasses' defaults (drop these lines): {twice}"


def test_config_yaml_holds_choices_only():
    """conf/config.yaml lists the defaults entry first, then the quickstart's groups; a section
    of its own would be a second default (equal to the dataclass's, or disagreeing with it)."""
    top = _yaml(CONF / "config.yaml")
    assert set(top) <= {"defaults", "hydra"}, f"conf/config.yaml sets {sorted(set(top) - {'defaults', 'hydra'})}"
    assert top["defaults"][0] == "meshlm_defaults"
    assert set(_chosen()) - {"override hydra/job_logging", "override hydra/hydra_logging"} == set(GROUPS)


def test_composed_default_is_the_dataclasses_and_the_chosen_options():
    """``meshlm train`` with no overrides: each section is its dataclass's defaults, with the
    chosen group option's values over them, and nothing else."""
    got = compose([])
    assert set(got) == set(DEFAULTS)
    for section, default in DEFAULTS.items():
        want = {**default, **(_option(section, _chosen()[section]) if section in GROUPS else {})}
        assert got[section] == want, section


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_is_the_defaults_and_what_it_sets(group):
    for f in sorted((CONF / group).glob("*.yaml")):
        got = compose([f"{group}={f.stem}"])[group]
        assert got == {**DEFAULTS[group], **_option(group, f.stem)}, f


def _value(text: str):
    text = text.strip().strip("`")
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"null": None, "true": True, "false": False}.get(text, text)


def _documented() -> list[tuple[str, str, str]]:
    """(where, key, default) for each row of a key | default | meaning table in the docs."""
    out = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for no, line in enumerate(doc.read_text().splitlines(), 1):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 3 or not cells[0].startswith("`"):
                continue
            keys, section = [], ""
            for k in re.findall(r"`([\w.]+)`", cells[0]):
                section = k.split(".")[0] if not k.startswith(".") else section
                keys.append(section + k if k.startswith(".") else k)
            values = [v.strip() for v in cells[1].split(",")]
            if len(keys) == len(values):
                out += [(f"{doc.name}:{no}", k, v) for k, v in zip(keys, values)]
    return out


def test_documented_defaults_are_the_dataclasses():
    rows = [(w, k, v) for w, k, v in _documented() if k.partition(".")[2] in DEFAULTS.get(k.partition(".")[0], {})]
    assert len(rows) > 30
    wrong = [
        f"{where}: {key} documented as {doc}, the default is {DEFAULTS[key.split('.')[0]][key.split('.')[1]]!r}"
        for where, key, doc in rows
        if not doc.startswith("(") and _value(doc) != DEFAULTS[key.split(".")[0]][key.split(".")[1]]
    ]
    assert not wrong, wrong
