"""The learning-rate schedules (NOTE [lr schedules] in meshlm/train/schedule.py) against torch's
own ``lr_scheduler`` classes chained behind a ``LinearLR`` warmup: step ``s`` of meshlm is
epoch ``s`` of theirs."""

from __future__ import annotations

import pytest
import torch
from torch.optim import lr_scheduler as S

from meshlm.app.config import load_config
from meshlm.train.schedule import decay_start, lr_at

STEPS, WARMUP, LR, MIN = 40, 6, 0.5, 0.05


def _torch_rates(kind: str, t) -> list[float]:
    """torch's schedule, epochs 1..steps; the warmup starts a hair above 0 (LinearLR needs it)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=LR)
    warm = S.LinearLR(opt, start_factor=1e-9, end_factor=1.0, total_iters=WARMUP)
    rest = STEPS - WARMUP
    if kind == "cosine":
        after, marks = [S.CosineAnnealingLR(opt, T_max=rest, eta_min=MIN)], [WARMUP]
    elif kind == "linear":
        after, marks = [S.LinearLR(opt, start_factor=1.0, end_factor=MIN / LR, total_iters=rest)], [WARMUP]
    elif kind == "constant":
        after, marks = [S.ConstantLR(opt, factor=1.0, total_iters=0)], [WARMUP]
    else:  # wsd: stable, then linear decay
        start = decay_start(t)
        after = [
            S.ConstantLR(opt, factor=1.0, total_iters=0),
            S.LinearLR(opt, start_factor=1.0, end_factor=MIN / LR, total_iters=STEPS - start),
        ]
        marks = [WARMUP, start]
    sched = S.SequentialLR(opt, [warm, *after], milestones=marks)
    out = []
    for _ in range(STEPS):
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_schedule_is_torchs(kind):
    t = load_config(
        [f"train.steps={STEPS}", f"train.warmup_steps={WARMUP}", f"train.lr={LR}", f"train.min_lr={MIN}",
         f"train.schedule={kind}", "train.decay_frac=0.25"]
    ).train  # fmt: skip
    mine = [lr_at(s, t) for s in range(1, STEPS + 1)]
    assert mine == pytest.approx(_torch_rates(kind, t), rel=1e-6, abs=1e-9)
    assert mine[WARMUP - 1] == pytest.approx(LR)
    if kind != "constant":
        assert mine[-1] == pytest.approx(MIN)


def test_wsd_holds_then_decays_over_the_last_fraction():
    t = load_config(["train.steps=100", "train.warmup_steps=10", "train.schedule=wsd", "train.decay_frac=0.2"]).train
    assert decay_start(t) == 80
    assert {lr_at(s, t) for s in range(10, 81)} == {t.lr}
    assert lr_at(81, t) < t.lr and lr_at(100, t) == pytest.approx(t.min_lr)
