"""``model.train()`` / ``model.eval()`` where the trainer switches, on every path.

A forward pre-hook on every module records (module.training, grad enabled) at each call:
every forward of a training step must find every module in train mode, every forward of an
evaluation (no grad) every module in eval mode; whatever mode the model was left in before
(``train_step`` after an evaluation or with the model in eval mode, ``evaluate`` after a
step), through ``train()`` (evaluation between steps), and on pipeline ranks (the chunks of
PP2; the forward-only schedule). The router's input jitter is the train-mode-only randomness
that shows what a wrong mode would do: evaluation repeats bitwise, a train-mode forward does
not. ``evaluate`` restores the caller's mode also when a batch fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeplug.testing.distributed import run_distributed

V = 64
JITTER = {"input_jitter_eps": 0.2}


def _cfg(parallel: dict | None = None, **train):
    from moeplug.config import config_from_dict
    return config_from_dict({
        "model": {"hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8}},
        "plugins": {"router_options": JITTER},
        "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 8, "warmup_steps": 1,
                  "grad_accum_steps": 2, **train},
        "parallel": parallel or {}})


class ModeLog:
    """(training, grad enabled) of every module at every forward, by phase."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[bool, bool]] = []
        self.handles = [m.register_forward_pre_hook(self._hook) for m in model.modules()
                        if m is not model]

    def _hook(self, module, args) -> None:
        self.calls.append((module.training, torch.is_grad_enabled()))

    def take(self) -> list[tuple[bool, bool]]:
        calls, self.calls = self.calls, []
        return calls


def _check_train(calls) -> None:
    assert calls, "the step ran no forward"
    # grad-enabled forwards (recompute's too) are the step's: all in train mode
    assert all(training for training, grad in calls if grad), "a training forward in eval mode"
    assert any(grad for _, grad in calls)


def _check_eval(calls) -> None:
    assert calls and not any(grad for _, grad in calls), "evaluation ran with grad"
    assert not any(training for training, _ in calls), "an evaluation forward in train mode"


def _pieces(cfg, groups=None):
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import build_rank_optimizer, seed_everything
    host = PluginHost.load()
    seed_everything(cfg.train.seed)
    model = build_rank_model(cfg, host, V, groups)
    return model, build_rank_optimizer(model, cfg, groups), host.create("precision", "fp32", {})


def _ids():
    return np.random.default_rng(0).integers(0, V, 4096).astype(np.int64)


def _val():
    from moeplug.data import get_batch
    gen = torch.Generator().manual_seed(1)
    return [get_batch(_ids(), 2, 8, gen) for _ in range(2)]


def _switching(model, opt, precision, cfg, groups=None) -> dict:
    """train_step from eval mode, evaluate from train mode, train_step after evaluate."""
    from moeplug.training.trainer import evaluate, step_batches, train_step
    log, ids = ModeLog(model), _ids()
    model.eval()  # as a caller might leave it (generation, an earlier evaluation)
    train_step(model, opt, step_batches(ids, cfg.train, 0, groups), cfg.train, precision, groups)
    _check_train(log.take())
    assert model.training
    first = evaluate(model, _val(), precision, groups)
    _check_eval(log.take())
    assert model.training, "evaluate must give the model back in train mode"
    again = evaluate(model, _val(), precision, groups)
    log.take()
    train_step(model, opt, step_batches(ids, cfg.train, 1, groups), cfg.train, precision, groups)
    _check_train(log.take())
    model.eval()
    evaluate(model, _val(), precision, groups)
    assert not model.training, "evaluate must give the caller's mode back"
    log.take()
    return {"first": first, "again": again}


def test_one_process_switches_modes_and_evaluation_has_no_jitter():
    cfg = _cfg()
    model, opt, precision = _pieces(cfg)
    out = _switching(model, opt, precision, cfg)
    assert out["first"] == out["again"]  # eval mode: no jitter, no counting; bitwise repeatable
    # The jitter the wrong mode would bring: train-mode forwards (no grad) differ.
    tokens, targets = _val()[0]
    model.train()
    with torch.no_grad():
        a, b = (float(model(tokens, targets).lm_loss) for _ in "ab")
    assert a != b


def test_evaluate_restores_the_mode_when_a_batch_fails():
    from moeplug.training.trainer import evaluate
    cfg = _cfg()
    model, _, precision = _pieces(cfg)
    model.train()
    bad = [(torch.full((2, 8), V + 5), torch.zeros(2, 8, dtype=torch.int64))]  # ids >= vocab
    with pytest.raises(IndexError):
        evaluate(model, bad, precision)
    assert model.training and all(m.training for m in model.modules())


def test_train_loop_trains_in_train_mode_and_evaluates_in_eval_mode(tmp_path, monkeypatch):
    import moeplug.training.trainer as T
    from moeplug.data import get_batch
    cfg = _cfg(eval_interval=1, eval_batches=1, log_interval=1, out_dir=str(tmp_path / "run"),
               time_breakdown=False)
    model, _, precision = _pieces(cfg)
    log = ModeLog(model)
    steps, between = [], []  # the forwards of each step; of what ran between steps (evaluation)
    real_step = T.train_step

    def step(*args, **kwargs):
        between.append(log.take())
        out = real_step(*args, **kwargs)
        steps.append(log.take())
        return out
    monkeypatch.setattr(T, "train_step", step)
    train_ids, val_ids = _ids(), _ids()
    gen = T.batch_generator(cfg.train.seed, 0, 1)
    T.train(cfg, model, None, precision, {}, log=lambda _m: None, use_bar=False,
            batches=(mb for t in range(cfg.train.steps)
                     for mb in T.step_batches(train_ids, cfg.train, t)),
            val_batches=[get_batch(val_ids, cfg.train.micro_batch_size, cfg.train.seq_len, gen)])
    between.append(log.take())
    evals = [calls for calls in between if calls]
    assert len(steps) == 3 and len(evals) >= 3  # one evaluation after every step
    for calls in steps:
        _check_train(calls)
    for calls in evals:
        _check_eval(calls)


def _pipeline_modes(rank: int, world: int) -> dict:
    from moeplug.parallel import ParallelGroups
    cfg = _cfg({"pp": 2})
    groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
    model, opt, precision = _pieces(cfg, groups)
    out = _switching(model, opt, precision, cfg, groups)
    out["chunks"] = len(model)
    return out


def test_pipeline_chunks_switch_modes_on_every_rank():
    for rank, out in enumerate(run_distributed(_pipeline_modes, 2, timeout=180)):
        assert out["chunks"] == 1 and out["first"] == out["again"], (rank, out)
