"""Your own data through the CLI, every step a real subprocess: ``moeplug data prepare`` ->
``moeplug train`` -> ``--resume auto`` for a JSONL corpus and for Megatron-prepared ids; a
resume that would change the data order says so; bad data is one line and exit 2 before any
rank starts, with nothing half-written in the cache; which samples every rank of a 4-process
run consumed (DP2 x TP2, DP4 with EP2), read back: disjoint across DP, identical within a
replica, together one process' batches; and after a SIGKILL the resumed run's batches are the
uninterrupted run's, bit for bit, also on another layout with the same global batch."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import yaml

from conftest import tiny_config_dict

STEPS = 6


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory, tiny_corpus):
    """The tiny corpus' training text as JSON lines, one paragraph per line (~600 lines)."""
    text = open(os.path.join(tiny_corpus, "train_text.txt"), encoding="utf-8").read()
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    path = tmp_path_factory.mktemp("jsonl") / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, p in enumerate(paragraphs):
            f.write(json.dumps({"id": i, "text": p}) + "\n")
    return str(path)


def config(tmp_path, corpus, cache_dir, name="cfg.yaml", **data):
    d = tiny_config_dict(corpus, str(tmp_path / "run"), cache_dir)
    d["data"].pop("val_works")
    d["data"].update({"val_fraction": 0.05, **data})
    d["train"].update({"steps": STEPS, "eval_interval": 0, "eval_batches": 2,
                       "log_interval": 1, "warmup_steps": 2})
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d))
    return str(path)


def records(out, kind):
    from moeplug.training.metrics import read_metrics
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == kind]


def assert_exit_2(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("moeplug: configuration error")]
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_prepare_train_resume_jsonl_and_the_same_ids_raw(run_cli, tmp_path, cache_dir,
                                                          jsonl_corpus):
    prepared = str(tmp_path / "prepared")
    proc = run_cli("data", "prepare", "--corpus", jsonl_corpus, "--tokenizer", "bytes",
                   "--out", prepared)
    assert proc.returncode == 0, proc.stderr
    assert "documents" in proc.stdout and "empty documents skipped" in proc.stdout
    assert sorted(os.listdir(prepared)) == ["corpus.bin", "corpus.idx", "meta.json",
                                            "token_counts.npy"]
    out = str(tmp_path / "run")
    cfg = config(tmp_path, prepared, cache_dir)
    proc = run_cli("train", "--config", cfg, "--steps", "3", "--set", "train.ckpt_interval=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: train" in proc.stdout and "validation (val_fraction 0.05)" in proc.stdout
    val = records(out, "val")
    assert val[0]["step"] == 0 and val[0]["val_tokens"] == 2 * 8 * 32  # eval before step 1
    # the raw JSONL (prepared into the cache) holds the same ids: the same data order, so
    # the resume continues where the prepared folder's run stopped
    raw = config(tmp_path, jsonl_corpus, cache_dir, "raw.yaml")
    proc = run_cli("train", "--config", raw, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    assert [r["step"] for r in records(out, "train")] == list(range(1, STEPS + 1))
    meta = json.load(open(os.path.join(out, "step_000006", "meta.json")))
    assert meta["data"]["consumed_samples"] == STEPS * 8


def test_train_on_a_megatron_prefix(run_cli, tmp_path, cache_dir):
    np = pytest.importorskip("numpy")
    from moeplug.data.indexed import IndexedWriter
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 400, 200).astype(np.int32)
    prefix = str(tmp_path / "my-corpus_text_document")
    w = IndexedWriter(prefix, np.uint16)
    w.add_documents(rng.integers(0, 256, int(lengths.sum())).astype(np.uint16), lengths)
    w.finalize()
    proc = run_cli("train", "--config", config(tmp_path, prefix, cache_dir), "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: train 190 documents" in proc.stdout


def test_resume_on_other_data_is_refused_naming_both(run_cli, tmp_path, cache_dir, tiny_corpus,
                                                     jsonl_corpus):
    out = str(tmp_path / "run")
    proc = run_cli("train", "--config", config(tmp_path, jsonl_corpus, cache_dir), "--steps",
                   "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    other = config(tmp_path, tiny_corpus, cache_dir, "other.yaml", val_fraction=0.0,
                   val_works=["val_text"])
    proc = run_cli("train", "--config", other, "--steps", "4", "--resume", "auto")
    line = assert_exit_2(proc, "this run would feed the model another data order than the "
                         "checkpoint's", f"corpus: checkpoint '{jsonl_corpus}', now "
                         f"'{tiny_corpus}'", "data.allow_new_order: true")
    assert "step_000002" in line
    assert [r["step"] for r in records(out, "train")] == [1, 2]  # nothing trained
    proc = run_cli("train", "--config", other, "--steps", "4", "--resume", "auto",
                   "--set", "data.allow_new_order=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in records(out, "train")] == [1, 2, 3, 4]


def test_bad_data_is_one_line_before_any_rank_and_nothing_half_written(run_cli, tmp_path,
                                                                       cache_dir):
    src = tmp_path / "bad.jsonl"
    src.write_text("".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(99))
                   + '{"text": "broken\n')
    cache = str(tmp_path / "cache")
    proc = run_cli("train", "--config", config(tmp_path, str(src), cache), "--nproc", "2",
                   "--steps", "2")
    assert_exit_2(proc, f"{src} line 100: not JSON", "Fix: write one JSON object per line")
    assert "rank" not in proc.stderr  # no rank was started
    assert not [d for d in os.listdir(cache) if d.startswith("prepared-") or ".tmp" in d]
    proc = run_cli("data", "prepare", "--corpus", str(src), "--tokenizer", "bytes", "--out",
                   str(tmp_path / "p"))
    assert_exit_2(proc, f"{src} line 100: not JSON")
    assert not (tmp_path / "p").exists()
    proc = run_cli("train", "--config", config(
        tmp_path, [{"path": str(src), "weight": 1}, {"path": str(src), "weight": 0}], cache))
    assert_exit_2(proc, "DataConfig.corpus", "entry 1", "not a positive number")
    proc = run_cli("data", "prepare", "--corpus", str(tmp_path / "nothing.csv"), "--tokenizer",
                   "bytes", "--out", str(tmp_path / "p"))
    assert_exit_2(proc, "no such file or folder")


# --------------------------------------------------------------------------------------------
# Which samples each rank consumed, read back (MOEPLUG_TEST_SAMPLES)
# --------------------------------------------------------------------------------------------

def sample_log(prefix):
    """rank -> step -> the record each rank wrote for its share of the step."""
    out: dict = {}
    folder, base = os.path.split(prefix)
    for f in sorted(os.listdir(folder)):
        if f.startswith(base + ".rank"):
            for line in open(os.path.join(folder, f)):
                r = json.loads(line)
                out.setdefault(r["rank"], {})[r["step"]] = r
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout, dp", [(["parallel.tp=2"], 2), (["parallel.ep=2"], 4)])
def test_four_ranks_read_disjoint_dp_shares_identical_within_a_replica(
        run_cli, tmp_path, cache_dir, cli_env, jsonl_corpus, layout, dp):
    cfg = config(tmp_path, jsonl_corpus, cache_dir)
    sets = [s for item in layout for s in ("--set", item)]
    env = dict(cli_env, MOEPLUG_TEST_SAMPLES=str(tmp_path / "par"))
    proc = run_cli("train", "--config", cfg, "--nproc", "4", "--steps", "3", "--out",
                   str(tmp_path / "par-run"), *sets, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = dict(cli_env, MOEPLUG_TEST_SAMPLES=str(tmp_path / "one"))
    proc = run_cli("train", "--config", cfg, "--steps", "3", "--out", str(tmp_path / "one-run"),
                   "--set", f"train.grad_accum_steps={dp}", env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    par, one = sample_log(str(tmp_path / "par")), sample_log(str(tmp_path / "one"))[0]
    assert sorted(par) == [0, 1, 2, 3]
    for step in range(3):
        by_dp: dict = {}
        for rank in range(4):
            r = par[rank][step]
            by_dp.setdefault(r["dp_rank"], []).append(r)
        assert sorted(by_dp) == list(range(dp))
        for members in by_dp.values():  # the ranks of one replica: the same samples
            assert all(m["positions"] == members[0]["positions"] and
                       m["tokens"] == members[0]["tokens"] for m in members)
        shares = [by_dp[d][0] for d in range(dp)]
        positions = [p for s in shares for p in s["positions"]]
        assert len(set(positions)) == len(positions)  # disjoint across DP
        # together: the one-process run's global batch, sample for sample
        assert positions == one[step]["positions"]
        assert [t for s in shares for t in s["tokens"]] == one[step]["tokens"]
        assert [x for s in shares for x in s["samples"]] == one[step]["samples"]


@pytest.mark.slow
@pytest.mark.serial
def test_resume_after_sigkill_continues_with_the_uninterrupted_batches(
        tmp_path, cache_dir, cli_env, jsonl_corpus):
    from moeplug.testing.runs import launch_and_wait, latest_step
    cfg = config(tmp_path, jsonl_corpus, cache_dir)
    steps = 8

    def args(out, *extra):
        return [sys.executable, "-m", "moeplug", "train", "--config", cfg, "--out", out,
                "--steps", str(steps), "--resume", "auto", "--set", "train.ckpt_interval=2",
                *extra]

    ref = str(tmp_path / "ref")
    env = dict(cli_env, MOEPLUG_TEST_SAMPLES=os.path.join(ref, "samples"))
    os.makedirs(ref)
    import subprocess
    done = subprocess.run(args(ref), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = {s: r["tokens"] for s, r in sample_log(os.path.join(ref, "samples"))[0].items()}
    # killed once a checkpoint exists and more steps ran, then resumed
    out = str(tmp_path / "killed")
    os.makedirs(out)
    env = dict(cli_env, MOEPLUG_TEST_SAMPLES=os.path.join(out, "samples"))
    proc, _ = launch_and_wait(args(out), out, env, 5, 0.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    resumed_at = latest_step(out)
    assert 2 <= resumed_at < steps
    open(os.path.join(out, "samples.rank0"), "w").close()  # only what the resume reads
    done = subprocess.run(args(out), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = {s: r["tokens"] for s, r in sample_log(os.path.join(out, "samples"))[0].items()}
    assert sorted(got) == list(range(resumed_at, steps))
    assert all(got[s] == expected[s] for s in got)
    # a layout change that keeps the global batch (8 x 1 on one process -> 4 x 1 on 2 DP
    # ranks): the resumed steps read the same samples, split over the ranks
    moved = str(tmp_path / "moved")
    env = dict(cli_env, MOEPLUG_TEST_SAMPLES=os.path.join(moved, "samples"))
    os.makedirs(moved)
    first = args(moved, "--set", "train.ckpt_interval=3")
    first[first.index("--steps") + 1] = "3"
    done = subprocess.run(first, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for f in os.listdir(moved):
        if f.startswith("samples.rank"):
            os.remove(os.path.join(moved, f))
    done = subprocess.run(args(moved, "--nproc", "2", "--set", "train.micro_batch_size=4"),
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    log = sample_log(os.path.join(moved, "samples"))
    for s in range(3, steps):
        assert log[0][s]["tokens"] + log[1][s]["tokens"] == expected[s], s
