"""Bad input never gets a traceback: random invalid configs at the validator, random invalid
argument lists at the CLI (in-process), and a few real ``moeplug train`` subprocesses with the
inputs a new user tries (nan, inf, absurd sizes, non-UTF-8 files). Each ends in ConfigError /
exit 2 with one line per problem, none hangs."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import subprocess
import sys
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moeplug import cli  # noqa: E402
from moeplug.config import ConfigError, RootConfig, config_from_dict  # noqa: E402
from moeplug.config.loader import _SUBCONFIGS  # noqa: E402

# The hypothesis tests run alone (serial): their deadlines are wall-clock time per example. The
# real-CLI ones run beside other tests: their 30 s bound is ~10x what a refusal takes.


def _leaves(cls: type = RootConfig, prefix: str = "") -> dict[str, str]:
    """Dotted path -> annotated type of every leaf field of the config."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        sub = _SUBCONFIGS.get((cls, f.name))
        if sub:
            out.update(_leaves(sub, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = str(f.type)
    return out


LEAVES = _leaves()
FLOAT_FIELDS = sorted(p for p, t in LEAVES.items() if t == "float")
SECTIONS = ["", "model.", "model.moe.", "model.mla.", "plugins.", "data.", "train.", "parallel."]

ANY_VALUE = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0, -1, -1.5, 10**30, -10**9, 2**20, 1.5, "",
                     "abc", "nan", None, True, False, [], [1, "x"], [0, 1], {}, {"a": {"b": 1}}]),
    st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))


def _nest(pairs: list[tuple[str, object]]) -> dict:
    data: dict = {}
    for path, value in pairs:
        *heads, last = path.split(".")
        node = data
        for h in heads:
            node = node.setdefault(h, {}) if isinstance(node.get(h, {}), dict) else {}
        node[last] = value
    return data


# One change that is always wrong: a non-finite float, or a key no section has.
SURELY_BAD = st.one_of(
    st.tuples(st.sampled_from(FLOAT_FIELDS), st.sampled_from([math.nan, math.inf, -math.inf])),
    st.tuples(st.sampled_from(SECTIONS).map(lambda s: s + "no_such_field"), ANY_VALUE))
RANDOM = st.lists(st.tuples(st.sampled_from(sorted(LEAVES)), ANY_VALUE), max_size=4)
FUZZ = settings(max_examples=300, deadline=2000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.serial
@FUZZ
@given(bad=SURELY_BAD, noise=RANDOM)
def test_invalid_configs_raise_config_error_only(bad, noise):
    with pytest.raises(ConfigError) as e:
        config_from_dict(_nest(noise + [bad]))
    for line in e.value.errors:  # every problem is one line that says how to fix it
        assert "\n" not in line and ("Fix:" in line or "unknown field" in line), line


@pytest.mark.serial
@FUZZ
@given(noise=RANDOM)
def test_random_configs_are_valid_or_config_error(noise):
    try:
        config_from_dict(_nest(noise))
    except ConfigError:
        pass


def _yaml_value(v: object) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return {math.inf: "inf", -math.inf: "-inf"}.get(v, "nan")
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _in_process(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse usage errors
            code = e.code
    return code, err.getvalue()


@pytest.mark.serial
@settings(max_examples=200, deadline=5000, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(bad=SURELY_BAD, noise=RANDOM, steps=st.one_of(st.none(), st.integers(-5, 5)))
def test_cli_invalid_arguments_exit_2_without_traceback(bad, noise, steps, tmp_path_factory):
    argv = ["train", "--set", f"train.out_dir={tmp_path_factory.mktemp('run')}"]
    for path, value in noise + [bad]:
        argv += ["--set", f"{path}={_yaml_value(value)}"]
    if steps is not None:
        argv += ["--steps", str(steps)]
    code, err = _in_process(argv)
    assert code == 2, (argv, err)
    assert "Traceback" not in err and err.strip(), (argv, err)


# The inputs the issue names, through the real CLI: each refused in one line, quickly.
_REAL = [
    (["--set", "train.lr=nan"], "TrainConfig.lr = nan"),
    (["--set", "model.moe.aux_loss_coeff=nan"], "MoEConfig.aux_loss_coeff = nan"),
    (["--set", "train.grad_clip=inf"], "TrainConfig.grad_clip = inf"),
    (["--set", "model.rope_theta=0"], "ModelConfig.rope_theta = 0.0: must be > 0"),
    (["--set", "model.rope_theta=-5"], "ModelConfig.rope_theta = -5.0: must be > 0"),
    (["--set", "model.init_std=-0.02"], "ModelConfig.init_std = -0.02: must be > 0"),
    (["--set", "model.norm_eps=-1e-5"], "ModelConfig.norm_eps = -1e-05: must be > 0"),
    (["--set", "model.moe.num_experts=1000000000"], "model.moe.num_experts = 1000000000"),
    (["--set", "model.hidden_size=1048576"], "model.hidden_size = 1048576"),
    (["--set", "train.micro_batch_size=1000000000"], "train.micro_batch_size = 1000000000"),
]


def _real_cli(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOEPLUG_CACHE": str(tmp_path / "cache")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "moeplug.cli", "train", "--steps", "1", *args,
                          "--set", f"train.out_dir={tmp_path / 'run'}"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert time.monotonic() - t0 < 30, f"{args}: took {time.monotonic() - t0:.0f} s"
    return out


@pytest.mark.parametrize("args, words", _REAL, ids=[a[-1] for a, _ in _REAL])
def test_real_cli_refuses_bad_values_in_one_line(args, words, tmp_path):
    out = _real_cli(args, tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and words in out.stderr, out.stderr
    problem = [ln for ln in out.stderr.splitlines() if "configuration error" in ln]
    assert len(problem) == 1 and "Fix:" in problem[0], out.stderr
    if "= 10" in words:  # the memory estimate: bytes needed vs available
        assert "needs at least" in problem[0] and "available" in problem[0], problem


_BOM = "not UTF-8 text (it starts with a UTF-16/32 byte-order mark)"


@pytest.mark.parametrize("name, data, words", [
    ("utf16.yaml", "model:\n  hidden_size: 64\n".encode("utf-16"), _BOM),
    ("utf32.yaml", "model:\n  hidden_size: 64\n".encode("utf-32"), _BOM),
    ("latin1.yaml", "# café\nmodel:\n  hidden_size: 64\n".encode("latin-1"), "not UTF-8 text"),
    ("binary.yaml", bytes(range(256)), "not UTF-8 text"),
], ids=["utf16", "utf32", "latin1", "binary"])
def test_real_cli_refuses_non_utf8_config_files(name, data, words, tmp_path):
    path = tmp_path / name
    path.write_bytes(data)
    out = _real_cli(["--config", str(path)], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert words in out.stderr and "Fix:" in out.stderr, out.stderr
