"""train.device: validation, the CLI's device choice, and (GPU machines only) CUDA == CPU.

The ``cuda``-marked tests skip with the reason where torch sees no GPU; they hold the GPU path
to the CPU one: the same seed trains to the same losses within a stated tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

from moeplug.cli import check_plugins
from moeplug.config import ConfigError, TrainConfig
from moeplug.data import prepare_corpus
from moeplug.plugin_host import PluginHost
from moeplug.training import distributed as D
from moeplug.training.flops import measure_peak_tflops
from moeplug.training.metrics import read_metrics
from moeplug.training.trainer import seed_everything, train

HAS_CUDA = torch.cuda.is_available()


def needs_cuda(test):
    """Marked ``cuda`` and skipped, with the reason, where torch sees no GPU."""
    skip = pytest.mark.skipif(not HAS_CUDA, reason="torch sees no CUDA GPU on this machine")
    return pytest.mark.cuda(skip(test))


@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:0", 3])
def test_device_field_names_field_value_and_fix(value):
    with pytest.raises(ConfigError) as e:
        TrainConfig(device=value)
    msg = str(e.value)
    assert f"TrainConfig.device = {value!r}" in msg and "Fix:" in msg


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:1"])
def test_device_field_accepts(value):
    assert TrainConfig(device=value).device == value


def test_auto_is_the_gpu_when_torch_sees_one_else_the_cpu(tiny_cfg):
    want = torch.device("cuda", 0) if HAS_CUDA else torch.device("cpu")
    assert D.resolve_device(tiny_cfg("train.device=auto")) == want
    assert D.resolve_device(tiny_cfg("train.device=cpu")) == torch.device("cpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the error of a machine without a GPU")
@pytest.mark.parametrize("value", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_exits_2_before_any_work(run_cli, tiny_config_file, tmp_path, value):
    out = tmp_path / "run"
    proc = run_cli("train", "--config", tiny_config_file(str(out)), "--set",
                   f"train.device={value}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"TrainConfig.device = {value!r}" in proc.stderr
    assert "sees no CUDA device" in proc.stderr and "train.device=cpu" in proc.stderr
    assert not out.exists(), "nothing may be prepared, built or written"


@pytest.mark.parametrize("value", ["cpu", "auto"])
def test_cli_train_runs_on_and_records_its_device(run_cli, tiny_config_file, tmp_path, value):
    out = str(tmp_path / "run")
    proc = run_cli("train", "--config", tiny_config_file(out), "--steps", "2",
                   "--set", "train.warmup_steps=1", "--set", f"train.device={value}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = "cuda:0" if value == "auto" and HAS_CUDA else "cpu"
    [run] = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "run"]
    assert run["device"] == want and run["config"]["train"]["device"] == value
    assert f"tokens/step on {want}," in proc.stdout


def test_gemm_peak_is_measured_on_the_device_asked_for():
    assert measure_peak_tflops(device="cpu", size=128, budget_s=0.05) > 0
    with pytest.raises((RuntimeError, AssertionError)):  # not silently timed on the CPU
        measure_peak_tflops(device="cuda" if not HAS_CUDA else "cuda:99", budget_s=0.01)


# --------------------------------------------------------------------------------------------
# GPU machines: the CUDA path against the CPU path
# --------------------------------------------------------------------------------------------

def _train_on(tiny_cfg, tmp_path, device: str, precision: str, steps: int = 8) -> list[dict]:
    """Per-step train records of an in-process run of the tiny model on ``device``."""
    out = str(tmp_path / f"{device.replace(':', '_')}_{precision}")
    cfg = tiny_cfg(f"train.steps={steps}", "train.warmup_steps=2", "train.log_interval=1",
                   f"train.device={device}", f"plugins.precision={precision}", out_dir=out)
    host = PluginHost.load()
    recipe = check_plugins(host, cfg)
    corpus = prepare_corpus(cfg.data)
    seed_everything(cfg.train.seed)
    model = D.build_rank_model(cfg, host, corpus.vocab_size, None, D.resolve_device(cfg))
    assert D.model_device(model).type == device
    names = {k: getattr(cfg.plugins, k) for k in ("router", "dispatcher", "experts", "precision")}
    train(cfg, model, corpus, recipe, names, log=lambda _msg: None, use_bar=False)
    records = list(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert [r for r in records if r["kind"] == "run"][0]["device"].startswith(device)
    return [r for r in records if r["kind"] in ("train", "val")]


# Tolerances: fp32 differs only by kernel choice and summation order (TF32 is off by default
# for matmuls), so 8 steps stay within 2e-3 nats; bf16 rounds every GEMM input to 8 mantissa
# bits, on CPU and GPU differently, so 5e-2 nats.
@needs_cuda
@pytest.mark.parametrize("precision, atol", [("fp32", 2e-3), ("bf16", 5e-2)])
def test_cuda_training_steps_equal_the_cpu_run(tiny_cfg, tmp_path, precision, atol):
    cpu = _train_on(tiny_cfg, tmp_path, "cpu", precision)
    gpu = _train_on(tiny_cfg, tmp_path, "cuda", precision)
    assert [r["step"] for r in gpu] == [r["step"] for r in cpu]
    for c, g in zip(cpu, gpu):
        key = "loss" if c["kind"] == "train" else "val_loss"
        assert g[key] == pytest.approx(c[key], abs=atol), (c["kind"], c["step"])
        if c["kind"] == "train":  # routing agrees: the same tokens per expert (up to ties)
            assert g["grad_norm"] == pytest.approx(c["grad_norm"], rel=0.05)


@needs_cuda
def test_permute_and_unpermute_on_cuda_equal_the_cpu_kernels():
    from moeplug.ops import permute, unpermute
    g = torch.Generator().manual_seed(0)
    x_TD = torch.randn(37, 16, generator=g)
    ids_TK = torch.randint(0, 5, (37, 2), generator=g)
    probs_TK = torch.rand(37, 2, generator=g)
    results = {}
    for device in ("cpu", "cuda"):
        # detached copies: on the CPU pass .to() returns the tensor itself, so without it the
        # CUDA pass would copy a leaf that requires grad and its .grad would stay None
        x = x_TD.to(device, copy=True).requires_grad_()
        p = probs_TK.to(device, copy=True).requires_grad_()
        x_SD, row_map_TK, counts_E = permute(x, ids_TK.to(device), 5)
        assert counts_E.device.type == "cpu" and row_map_TK.device.type == device
        y_TD = unpermute(x_SD * 2.0, row_map_TK, p)
        y_TD.square().sum().backward()
        results[device] = [t.detach().cpu() for t in (x_SD, row_map_TK, counts_E, y_TD,
                                                       x.grad, p.grad)]
    for c, g_ in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(g_, c, rtol=1e-5, atol=1e-5)


def _dispatch_combine(name: str, device: str) -> list[torch.Tensor]:
    """One process: a dispatcher's dispatch -> a row-wise function weighted by the rows' probs
    -> combine, and its backward, on ``device``; the outputs and grads on the CPU. Some
    choices are dropped (the sink paths run)."""
    from moeplug.interfaces import RouterOutput
    from moeplug.testing import tiny_model_config
    T, K, E, D = 61, 3, 8, 16
    m = tiny_model_config(num_experts=E, top_k=K, hidden_size=D)
    disp = PluginHost.load().create("dispatcher", name, {}, m, None)
    g = torch.Generator().manual_seed(4)
    ids_TK = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    dropped_TK = torch.rand(T, K, generator=g) < 0.2
    probs_TK = torch.rand(T, K, generator=g).masked_fill(dropped_TK, 0.0)
    x = torch.randn(T, D, generator=g).to(device, copy=True).requires_grad_()
    p = probs_TK.to(device, copy=True).requires_grad_()
    routing = RouterOutput(probs_TK=p, ids_TK=ids_TK.to(device), aux_loss=torch.zeros(()),
                           dropped_TK=dropped_TK.to(device))
    d = disp.dispatch(x, routing)
    y_TD = disp.combine(torch.tanh(d.x_SD) * d.probs_S.unsqueeze(1), d.meta)
    y_TD.square().sum().backward()
    return [t.detach().cpu() for t in (y_TD, x.grad, p.grad)]


# direct_write moves CPU tensors only (it refuses CUDA ones); deepep needs deep_ep.
@needs_cuda
@pytest.mark.parametrize("name", ["alltoall", "allgather", "hierarchical"])
def test_dispatchers_on_cuda_equal_the_cpu_at_one_process(name):
    for c, g_ in zip(_dispatch_combine(name, "cpu"), _dispatch_combine(name, "cuda")):
        torch.testing.assert_close(g_, c, rtol=1e-5, atol=1e-5)


@needs_cuda
def test_generate_logits_on_cuda_equal_the_cpu(run_cli, tiny_config_file, tmp_path):
    from moeplug.generate import load_checkpoint_model, next_token_logits
    out = str(tmp_path / "run")
    proc = run_cli("train", "--config", tiny_config_file(out), "--steps", "5",
                   "--set", "train.warmup_steps=1", "--set", "train.device=cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    on = {d: load_checkpoint_model(out, d) for d in ("cpu", "cuda")}
    assert D.model_device(on["cuda"].model).type == "cuda"
    ids = on["cpu"].tokenizer.encode("MACBETH. What")
    cpu, gpu = (next_token_logits(on[d].model, ids, 32, on[d].tokenizer.vocab_size)
                for d in ("cpu", "cuda"))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_cuda_device_follows_local_rank_and_refuses_what_cannot_run(tiny_cfg, monkeypatch):
    count = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(count - 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(count))
    assert D.resolve_device(tiny_cfg("train.device=cuda")) == torch.device("cuda", count - 1)
    with pytest.raises(ConfigError, match=f"{count + 1} processes on this node"):
        D.resolve_device(tiny_cfg("train.device=auto"), num_local=count + 1)
    if count > 1:
        with pytest.raises(ConfigError, match="cuda:LOCAL_RANK"):
            D.resolve_device(tiny_cfg("train.device=cuda:0"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="does not exist"):
        D.resolve_device(tiny_cfg(f"train.device=cuda:{count}"))
    with pytest.raises(ConfigError, match="parallel.pp = 2"):
        D.resolve_device(tiny_cfg("train.device=cuda", "parallel.pp=2"))


@pytest.mark.skipif(HAS_CUDA, reason="checks what the scripts say where torch sees no GPU")
@pytest.mark.parametrize("script", ["profile_cuda_moe_layer.py", "profile_cuda_train_step.py"])
def test_gpu_profile_scripts_say_they_need_a_gpu_instead_of_a_traceback(script):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, os.path.join("benchmarks", script)], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    assert f"{script}: needs a CUDA GPU, and torch sees none" in res.stderr
    assert "Traceback" not in res.stderr
