"""Learning-rate decay styles (``train.lr_decay_style``, Megatron's ``--lr-decay-style``) and
AdamW's epsilon (``train.adam_eps``, ``--adam-eps``).

* every style, and every WSD anneal shape, against megatron-core's own OptimizerParamScheduler
  over a whole run and past its horizon (moeplug's warmup is Megatron's shifted by one step: it
  never spends a step at lr 0; after warmup the step numbers coincide);
* the formulas by hand, independent of megatron-core; the default (cosine) unchanged;
* config errors: one line naming the field, the value and the fix;
* ``adam_eps`` reaches the update: each AdamW the factory builds steps as torch.optim.AdamW
  with that eps.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moeplug.config import ConfigError, TrainConfig
from moeplug.training.optim import adamw, lr_at

LR, MIN_LR = 3e-3, 3e-4


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"steps": 100, "warmup_steps": 10, "lr": LR, "min_lr": MIN_LR, **kw})


def _megatron(style: str, warmup: int, horizon: int, wsd_steps: int | None = None,
              wsd_style: str | None = None):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the test extra "
                        "pins it)")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(
        SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=LR, min_lr=MIN_LR,
        lr_warmup_steps=warmup, lr_decay_steps=horizon, lr_decay_style=style, start_wd=0.1,
        end_wd=0.1, wd_incr_steps=horizon, wd_incr_style="constant",
        wsd_decay_steps=wsd_steps, lr_wsd_decay_style=wsd_style)


def _megatron_lr(sched, step: int, warmup: int) -> float:
    # Megatron's lr at num_steps n is the one of the n-th update... after n steps done; its
    # warmup starts at init_lr (0) on num_steps 0. moeplug's step s < warmup uses lr (s+1)/W,
    # i.e. Megatron's num_steps s + 1; from warmup on, num_steps = s.
    sched.num_steps = step + 1 if step < warmup else step
    return sched.get_lr({})


CASES = [("constant", {}), ("linear", {}), ("cosine", {}), ("inverse-square-root", {}),
         *[("WSD", {"lr_wsd_decay_style": s, "lr_wsd_decay_steps": 20})
           for s in ("linear", "cosine", "exponential", "minus_sqrt")],
         ("WSD", {"lr_wsd_decay_style": "cosine", "lr_wsd_decay_fraction": 0.25}),
         ("linear", {"lr_decay_steps": 60}), ("cosine", {"lr_decay_steps": 60}),
         ("WSD", {"lr_decay_steps": 60, "lr_wsd_decay_style": "linear"})]


@pytest.mark.parametrize("style,extra", CASES)
def test_every_decay_style_equals_megatron_cores_scheduler(style, extra):
    cfg = _cfg(lr_decay_style=style, **extra)
    horizon = cfg.lr_decay_horizon
    sched = _megatron(style, cfg.warmup_steps, horizon,
                      cfg.lr_wsd_anneal_steps if style == "WSD" else None,
                      cfg.lr_wsd_decay_style if style == "WSD" else None)
    ours = [lr_at(s, cfg) for s in range(cfg.steps + 10)]  # past the run and the horizon
    theirs = [_megatron_lr(sched, s, cfg.warmup_steps) for s in range(cfg.steps + 10)]
    for s, (a, b) in enumerate(zip(ours, theirs)):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15), (style, extra, s, a, b)
    assert len(set(ours)) > (1 if style != "constant" else 0)


def test_the_formulas_by_hand():
    W, N = 10, 100
    lin = _cfg(lr_decay_style="linear")
    assert lr_at(0, lin) == pytest.approx(LR / W)      # never 0: the first update counts
    assert lr_at(W - 1, lin) == pytest.approx(LR)
    assert lr_at(W + 45, lin) == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5)  # half way
    assert lr_at(N, lin) == pytest.approx(MIN_LR) and lr_at(N + 7, lin) == MIN_LR
    cos = _cfg()  # the default
    assert cos.lr_decay_style == "cosine"
    assert lr_at(W + 45, cos) == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5)
    assert lr_at(W + 30, cos) == pytest.approx(
        MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * 30 / 90)))
    isr = _cfg(lr_decay_style="inverse-square-root")
    assert lr_at(40, isr) == pytest.approx(LR * math.sqrt(10 / 40))  # lr / 2 at 4x warmup
    assert lr_at(N, isr) == pytest.approx(LR * math.sqrt(10 / 100))
    assert lr_at(N - 1, _cfg(lr_decay_style="inverse-square-root", lr=1.0, min_lr=0.5)) == 0.5
    const = _cfg(lr_decay_style="constant")
    assert [lr_at(s, const) for s in (W, 50, N, N + 5)] == [LR] * 4
    # WSD: stable at lr until the last 20 steps of the horizon, then the anneal's shape.
    for shape, at_half in [("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5 ** 0.5 - 1),
                           ("minus_sqrt", 1 - 0.5 ** 0.5)]:
        wsd = _cfg(lr_decay_style="WSD", lr_wsd_decay_style=shape, lr_wsd_decay_steps=20)
        assert lr_at(80, wsd) == LR and lr_at(W, wsd) == LR
        assert lr_at(90, wsd) == pytest.approx(MIN_LR + (LR - MIN_LR) * at_half), shape
        assert lr_at(N, wsd) == pytest.approx(MIN_LR), shape
    # the fraction: 10% (the default) of a horizon of 100 steps = 10 anneal steps
    wsd = _cfg(lr_decay_style="WSD", lr_wsd_decay_style="linear")
    assert wsd.lr_wsd_anneal_steps == 10
    assert lr_at(90, wsd) == LR and lr_at(95, wsd) == pytest.approx((LR + MIN_LR) / 2)
    # lr_decay_steps: the decay ends there and min_lr holds after it
    short = _cfg(lr_decay_style="linear", lr_decay_steps=50)
    assert lr_at(30, short) == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5)
    assert lr_at(50, short) == pytest.approx(MIN_LR) and lr_at(70, short) == MIN_LR


@pytest.mark.parametrize("kw,parts", [
    ({"lr_decay_style": "cosinus"}, ["TrainConfig.lr_decay_style = 'cosinus': is not a decay "
                                     "style", "Fix: use one of constant, linear, cosine, "
                                     "inverse-square-root, WSD"]),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_style": "step"},
     ["TrainConfig.lr_wsd_decay_style = 'step'", "Fix: use one of linear, cosine, exponential, "
                                                 "minus_sqrt"]),
    ({"lr_wsd_decay_steps": 20}, ["TrainConfig.lr_wsd_decay_steps = 20: is read only by "
                                  "lr_decay_style WSD (lr_decay_style is 'cosine')",
                                  "Fix: set lr_decay_style: WSD, or drop lr_wsd_decay_steps"]),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_fraction": 1.5},
     ["TrainConfig.lr_wsd_decay_fraction = 1.5: must be in (0, 1]"]),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_fraction": 0.2, "lr_wsd_decay_steps": 5},
     ["TrainConfig.lr_wsd_decay_fraction = 0.2: is not used when lr_wsd_decay_steps (5) is set",
      "Fix: set only one of the two"]),
    ({"lr_decay_steps": 10}, ["TrainConfig.lr_decay_steps = 10: must exceed warmup_steps (10)",
                              "Fix: set lr_decay_steps > 10, or 0 (train.steps)"]),
    ({"adam_eps": 0.0}, ["TrainConfig.adam_eps = 0.0: must be > 0"]),
])
def test_schedule_errors_name_the_field_the_value_and_the_fix(kw, parts):
    with pytest.raises(ConfigError) as err:
        _cfg(**kw)
    for part in parts:
        assert part in str(err.value), (part, str(err.value))


@pytest.mark.parametrize("kind", ["fp32", "bf16_moments"])
def test_adam_eps_reaches_the_update(kind):
    # A large eps changes the step visibly: p -= lr * m_hat / (sqrt(v_hat) + eps).
    def step(eps: float | None) -> tuple[torch.Tensor, float]:
        extra = {} if eps is None else {"adam_eps": eps}
        cfg = _cfg(weight_decay=0.0, optimizer_dtype="bf16" if kind == "bf16_moments" else "fp32",
                   **extra)
        w = torch.nn.Parameter(torch.linspace(-1, 1, 64))
        opt = adamw([{"params": [w], "weight_decay": 0.0}], cfg)
        assert opt.param_groups[0]["eps"] == cfg.adam_eps
        w.grad = torch.linspace(-1e-2, 1e-2, 64)
        opt.step()
        return w.detach(), opt.param_groups[0]["lr"]

    got, lr = step(1e-2)
    ref = torch.nn.Parameter(torch.linspace(-1, 1, 64))
    torch_opt = torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.95), eps=1e-2, weight_decay=0.0)
    ref.grad = torch.linspace(-1e-2, 1e-2, 64)
    torch_opt.step()
    # The first step's moments m = 0.1 g, v = 0.05 g^2: bf16 storage rounds them, not the
    # fp32 update computed before they are stored; the same values either way.
    assert (got - ref.detach()).abs().max() <= 1e-7, kind
    default, _ = step(None)  # 1e-8: the update is ~lr for every element, 2-3x the eps one's
    assert TrainConfig().adam_eps == 1e-8
    assert (default - got).abs().max() > lr / 4
