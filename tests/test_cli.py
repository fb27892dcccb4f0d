"""The `moeplug` command in real subprocesses, on the real plugins, data pipeline and model."""

from __future__ import annotations

import os
import sys

import pytest

from moeplug.training.metrics import read_metrics


def _records(out_dir: str, kind: str) -> list[dict]:
    return [r for r in read_metrics(os.path.join(out_dir, "metrics.jsonl")) if r["kind"] == kind]


def test_train_30_steps_loss_falls_and_everything_is_logged(run_cli, tiny_config_file, tmp_path):
    out = str(tmp_path / "run")
    proc = run_cli("train", "--config", tiny_config_file(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    train = _records(out, "train")
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    first, last = train[0], train[-1]
    assert last["lm_loss"] < first["lm_loss"] - 0.5, (first["lm_loss"], last["lm_loss"])
    for r in train:
        assert r["loss"] == pytest.approx(r["lm_loss"] + r["aux_loss"], rel=1e-5)
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and 0 < r["mfu"]
        assert r["grad_norm"] > 0 and r["lr"] > 0
        assert r["plugins"] == {"router": "topk", "dispatcher": "alltoall", "experts": "grouped",
                                "precision": "fp32"}
        # one MoE layer (2 layers, first dense); every token picks top_k=2 of 4 experts
        [layer] = r["expert_load"]
        assert layer["mean"] == pytest.approx(8 * 32 * 2 / 4)
        assert layer["max"] >= layer["mean"]
    val = _records(out, "val")
    assert [r["step"] for r in val] == [0, 10, 20, 30]  # step 0: the model before training
    assert val[-1]["val_loss"] < val[1]["val_loss"] < val[0]["val_loss"]
    assert {r["val_tokens"] for r in val} == {2 * 8 * 32}  # train.eval_batches = 2

    # stderr is a pipe here: plain log lines, no progress bar escape codes
    assert "step     30 | loss" in proc.stdout and "\r" not in proc.stderr
    assert "validation loss" in proc.stdout and "unigram entropy" in proc.stdout
    assert open(os.path.join(out, "latest")).read().strip() == "step_000030"


def test_overrides_take_effect(run_cli, tiny_config_file, tmp_path):
    out = str(tmp_path / "run")
    proc = run_cli("train", "--config", tiny_config_file(str(tmp_path / "ignored")), "--out", out,
                   "--steps", "3", "--experts", "sequential", "--router", "topk",
                   "--set", "model.moe.num_experts=2", "--set", "train.warmup_steps=1",
                   "--set", "train.log_interval=1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not os.path.exists(tmp_path / "ignored"), "--out must win over the file's out_dir"
    run = _records(out, "run")[0]
    assert run["config"]["model"]["moe"]["num_experts"] == 2
    assert run["config"]["train"]["steps"] == 3
    train = _records(out, "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert train[0]["plugins"]["experts"] == "sequential"
    # 2 experts, top_k 2: every token goes to both, so each gets exactly B*S tokens
    assert train[0]["expert_load"][0] == {"layer": 0, "max": 256.0, "mean": 256.0,
                                          "max_over_mean": 1.0}


def test_version_reports_package_and_runtime(run_cli):
    import moeplug
    from moeplug.runtime import runtime_info
    proc = run_cli("--version", timeout=120)
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert lines[0] == f"moeplug {moeplug.__version__}"
    info = runtime_info()
    assert info["available"], "the test environment must have the built extension"
    assert f"runtime core {info['version']}" in lines[1]
    assert ("CUDA build" if info.get("cuda") else "CPU build") in lines[1]


def test_version_without_extension_says_how_to_rebuild(run_cli, cli_env_without_core):
    # A real interpreter in which the compiled module cannot be imported (as after a failed build).
    proc = run_cli("--version", env=cli_env_without_core, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "NOT AVAILABLE" in proc.stdout and "simulated missing build" in proc.stdout
    assert "rebuild it with: pip install -e ." in proc.stdout


def test_plugins_lists_every_registered_component(run_cli):
    from moeplug.plugin_host import PluginHost
    proc = run_cli("plugins", timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    infos = PluginHost.load().infos()
    assert {i.kind for i in infos} == {"router", "dispatcher", "experts", "precision", "dataset"}
    for info in infos:
        assert f"{info.kind}:" in text
        line = next(l for l in text.splitlines() if l.strip().startswith(info.name + " "))
        assert f"[{info.dist}]" in line
        assert ("available" in line) if info.available else (f"unavailable: {info.reason}" in line)


def test_python_dash_m_and_console_script_agree(cli_env):
    import shutil
    import subprocess
    exe = shutil.which("moeplug", path=os.path.dirname(sys.executable))
    assert exe, "the `moeplug` console script is not installed next to the interpreter"
    a = subprocess.run([exe, "--version"], capture_output=True, text=True, env=cli_env, timeout=120)
    b = subprocess.run([sys.executable, "-m", "moeplug", "--version"], capture_output=True,
                       text=True, env=cli_env, timeout=120)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout


# The suite's CLI runs fork from a server that has imported torch and moeplug
# (moeplug.testing.cli): the same command in a fresh interpreter must print the same and exit
# alike, and a run must train to the same losses.
@pytest.mark.parametrize("args", [["--version"], ["plugins"], ["--help"], [],
                                  ["train", "--set", "model.moe.top_k=9"],
                                  ["train", "--steps", "2", "--set", "train.log_interval=1"]],
                         ids=["version", "plugins", "help", "nothing", "config_error", "train"])
def test_the_forked_cli_equals_a_fresh_interpreter(run_cli, tiny_config_file, tmp_path, args):
    if args[:1] == ["train"]:
        config = tiny_config_file()
        args = [*args, "--config", config]
    runs = {}
    for how in ("fork", "exec"):
        extra = ["--out", str(tmp_path / how)] if "--steps" in args else []
        runs[how] = run_cli(*args, *extra, fresh=how == "exec", timeout=300)
        assert runs[how].started == how
    fork, fresh = runs["fork"], runs["exec"]
    assert fork.returncode == fresh.returncode, (fork.stderr[-2000:], fresh.stderr[-2000:])
    if "--steps" in args:
        assert fork.returncode == 0, fork.stderr[-3000:]
        losses = {how: [(r["step"], r["lm_loss"], r["grad_norm"])
                        for r in _records(str(tmp_path / how), "train")] for how in runs}
        assert losses["fork"] == losses["exec"] and len(losses["fork"]) == 2, losses
    else:
        assert (fork.stdout, fork.stderr) == (fresh.stdout, fresh.stderr)
    if args[:1] == ["train"] and "--steps" not in args:
        assert fork.returncode == 2 and "top_k" in fork.stderr, fork.stderr


def test_the_forked_cli_runs_the_environment_and_directory_it_is_given(run_cli, cli_env,
                                                                      tiny_config_file, tmp_path):
    # MOEPLUG_BLOCK_PLUGINS (read when the plugins load) and a relative --out (the working
    # directory): neither is the forkserver's.
    from moeplug.plugin_host import BLOCK_ENV
    env = dict(cli_env, **{BLOCK_ENV: "dispatcher:allgather"})
    proc = run_cli("plugins", env=env, timeout=120)
    assert proc.started == "fork" and proc.returncode == 0, proc.stderr
    assert f"unavailable: blocked by ${BLOCK_ENV} ('dispatcher:allgather')" in proc.stdout, \
        proc.stdout
    (tmp_path / "here").mkdir()
    proc = run_cli("train", "--config", tiny_config_file(), "--steps", "1", "--out", "rel",
                   cwd=str(tmp_path / "here"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "here" / "rel" / "metrics.jsonl").exists()


def test_plugins_lists_the_entry_points_it_did_not_load(run_cli, cli_env):
    # a blocked entry point's components vanished from the listing without a word
    from moeplug.plugin_host import BLOCK_ENV
    proc = run_cli("plugins", env=dict(cli_env, **{BLOCK_ENV: "builtin_routers"}), timeout=120)
    assert proc.returncode == 0, proc.stderr
    tail = proc.stdout.split("entry points not loaded:\n")[1]
    assert "builtin_routers" in tail and f"blocked by ${BLOCK_ENV}" in tail, proc.stdout


def test_no_command_prints_help_and_exits_2(run_cli):
    proc = run_cli(timeout=120)
    assert proc.returncode == 2 and "train" in proc.stdout and "plugins" in proc.stdout


def test_help_is_plain_text_and_names_every_command(run_cli):
    proc = run_cli("--help", timeout=120)
    assert proc.returncode == 0
    description = proc.stdout.split("positional arguments")[0]
    assert "``" not in proc.stdout, proc.stdout
    for command in ("train", "plugins", "convert", "plot-load"):
        assert command in description, description


def test_version_into_a_closed_pipe_exits_quietly(cli_env):
    # `moeplug --version | head -1`: the reader is gone before moeplug writes.
    import subprocess
    proc = subprocess.Popen([sys.executable, "-m", "moeplug", "--version"], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, stderr  # 128 + SIGPIPE, as `cat` would report
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr, stderr


@pytest.fixture
def preset_config_file(tiny_corpus, cache_dir, tmp_path):
    """A YAML with data and a small batch but no train.out_dir, for `--preset NAME` runs."""
    import yaml
    path = tmp_path / "data.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"corpus": tiny_corpus, "tokenizer": "bytes", "val_works": ["val_text"],
                 "cache_dir": cache_dir},
        "train": {"micro_batch_size": 4, "seq_len": 32, "eval_batches": 1, "log_interval": 1,
                  "threads": 1}}))
    return str(path)


def test_mtp_loss_is_logged_and_the_loss_is_the_sum_of_the_printed_terms(
        run_cli, preset_config_file, tmp_path):
    proc = run_cli("train", "--preset", "deepseek_v3_tiny", "--config", preset_config_file,
                   "--steps", "3", cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # also: --steps 3 under the default 30 warmup steps trains, warming up over the 3 steps
    assert "warmup_steps = 30 exceeds train.steps = 3" in proc.stdout
    train = _records(str(tmp_path / "runs" / "deepseek_v3_tiny"), "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["lr"] for r in train] == pytest.approx([1e-3, 2e-3, 3e-3])
    for r in train:
        # 1 MTP module scaled by 0.1: a cross-entropy of a few nats makes it ~0.1-1
        assert 0.05 < r["mtp_loss"] < 1.0, r
        assert r["loss"] == pytest.approx(r["lm_loss"] + r["aux_loss"] + r["mtp_loss"],
                                          rel=1e-6)
        line = next(l for l in proc.stdout.splitlines() if l.startswith(f"step {r['step']:>6} |"))
        assert (f"loss {r['loss']:.4f} (lm {r['lm_loss']:.4f}, aux {r['aux_loss']:.4f}, "
                f"mtp {r['mtp_loss']:.4f})") in line, line


def test_runs_never_mix_in_one_directory(run_cli, preset_config_file, tmp_path):
    """Presets default to their own directory; a used directory is refused (exit 2, nothing
    touched) unless the command resumes it or says --overwrite, which leaves only the new run."""
    cwd = str(tmp_path)

    def train(*args: str):
        return run_cli("train", "--config", preset_config_file, "--steps", "2", *args, cwd=cwd,
                       timeout=600)

    for name in ("mixtral_tiny", "qwen3_moe_tiny"):
        proc = train("--preset", name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = tmp_path / "runs"
    assert sorted(os.listdir(runs)) == ["mixtral_tiny", "qwen3_moe_tiny"]
    old = runs / "mixtral_tiny"
    metrics_before = (old / "metrics.jsonl").read_bytes()

    proc = train("--preset", "qwen3_moe_tiny", "--out", str(old))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"train.out_dir = '{old}' already holds a run (latest, metrics.jsonl, step_000002)" \
        in proc.stderr
    assert "--resume auto" in proc.stderr and "--overwrite" in proc.stderr
    assert "torch.distributed.run" not in proc.stderr
    assert (old / "metrics.jsonl").read_bytes() == metrics_before
    # refused before any process is launched, too
    proc = train("--preset", "qwen3_moe_tiny", "--out", str(old), "--nproc", "2",
                 "--set", "parallel.ep=2")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert "launching" not in proc.stdout and (old / "metrics.jsonl").read_bytes() == metrics_before

    proc = train("--preset", "qwen3_moe_tiny", "--out", str(old), "--steps", "1", "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # and the run lock (moeplug.training.run_dir), which no run removes: a killed one cannot
    assert sorted(os.listdir(old)) == [".moeplug.lock", "latest", "metrics.jsonl", "step_000001"]
    [run] = _records(str(old), "run")
    assert run["config"]["model"]["qk_norm"] is True  # the qwen3 model, alone

    proc = train("--preset", "qwen3_moe_tiny", "--out", str(old), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["start_step"] for r in _records(str(old), "run")] == [0, 1]
    assert [r["step"] for r in _records(str(old), "train")] == [1, 2]


@pytest.mark.slow
@pytest.mark.serial  # its 10 minutes are the README's promise on 2 cores, so the run gets both
def test_default_train_beats_unigram_entropy_within_10_minutes(run_cli, cli_env, tmp_path):
    """The README's promise: `moeplug train` with no arguments, on the bundled Shakespeare corpus,
    ends with validation loss well below the unigram entropy, in under 10 minutes on 2 cores.
    (Includes training the BPE tokenizer into an empty cache, as on a fresh machine.)"""
    import re
    import time
    env = dict(cli_env, MOEPLUG_CACHE=str(tmp_path / "cache"))
    t0 = time.perf_counter()
    # Generous: shared dev machines can be 10x slower; the 10-minute promise is asserted in CI.
    # fresh: the promise includes the interpreter's start, as the user's command pays it.
    proc = run_cli("train", env=env, cwd=str(tmp_path), timeout=3600, fresh=True)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"validation loss ([\d.]+) nats/token vs unigram entropy ([\d.]+)", proc.stdout)
    assert m, proc.stdout[-2000:]
    val_loss, unigram = float(m.group(1)), float(m.group(2))
    # Independent check of the printed numbers against the metrics file.
    val = _records(str(tmp_path / "runs" / "default"), "val")
    assert val[-1]["val_loss"] == pytest.approx(val_loss, abs=1e-4)
    # the whole validation set (Hamlet and The Tempest), from step 0 on, every 100 steps
    assert [r["step"] for r in val] == [0, 100, 200, 300, 400, 500]
    num_val = int(re.search(r"validation \(val_works .*\) \d+ documents, ([\d,]+) tokens",
                            proc.stdout).group(1).replace(",", ""))
    assert {r["val_tokens"] for r in val} == {(num_val - 1) // 128 * 128}
    assert val_loss < unigram - 1.0, (val_loss, unigram)
    # The README quotes these figures with the machine and torch's thread count (all cores).
    import torch
    speed = re.search(r"done: \d+ steps, (\d+) tokens/s", proc.stdout).group(1)
    print(f"default run on {os.cpu_count()} cores, {torch.get_num_threads()} torch threads: "
          f"{elapsed:.0f} s, {speed} tokens/s, val loss {val_loss:.3f} vs unigram {unigram:.3f}")
    if os.environ.get("CI"):  # dev machines are shared and slower; CI has the cores to itself
        assert elapsed < 600, f"default training took {elapsed:.0f} s (limit 600 s)"
