"""benchmarks/compression.py's settings: each compressor's own AdamW betas and learning rate, and bad input
refused at once."""
import argparse
import pathlib
import sys

import pytest

from helpers import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("compression")


def test_parse_betas_and_lr_read_compressor_and_values(bench):
    assert bench.parse_betas("topk=0,0.99") == ("topk", (0.0, 0.99))
    assert bench.parse_betas("none=0.5,0.95") == ("none", (0.5, 0.95))
    assert bench.parse_lr("powersgd=0.02") == ("powersgd", 0.02)


@pytest.mark.parametrize("parser,text,message", [
    ("parse_betas", "topk=0.5", "COMPRESSOR=BETA1,BETA2"), ("parse_betas", "topk", "COMPRESSOR=BETA1,BETA2"),
    ("parse_betas", "topx=0,0.99", "unknown compressor 'topx'"),
    ("parse_lr", "powersgd", "COMPRESSOR=LR"), ("parse_lr", "powersgd=fast", "COMPRESSOR=LR"),
    ("parse_lr", "psgd=0.02", "unknown compressor 'psgd'"),
])
def test_parsers_reject_malformed_text(bench, parser, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        getattr(bench, parser)(text)


def test_only_compressors_with_their_own_settings_override_the_optimizer(bench):
    own = bench.own_settings({"topk": (0.0, 0.99), "powersgd": (0.2, 0.9)}, {"topk": 0.03, "sign": 0.02})
    assert bench.compressor_settings("topk", own) == {"comm.compression": "topk", "optim.beta1": 0.0,
                                                       "optim.beta2": 0.99, "optim.lr": 0.03}
    assert bench.compressor_settings("powersgd", own) == {"comm.compression": "powersgd", "optim.beta1": 0.2,
                                                           "optim.beta2": 0.9}
    assert bench.compressor_settings("sign", own) == {"comm.compression": "sign", "optim.lr": 0.02}
    assert bench.compressor_settings("none", own) == {"comm.compression": "none"}


def test_the_table_header_names_each_compressors_own_settings(bench):
    own = {"powersgd": {"optim.lr": 0.02}, "topk": {"optim.beta1": 0.0, "optim.beta2": 0.99}, "sign": {}}
    assert bench.describe_own(["none", "powersgd", "topk", "sign"], own) == \
        ", powersgd lr 0.02, topk (β1, β2) (0, 0.99)"
    assert bench.describe_own(["none", "topk"], own) == ", topk (β1, β2) (0, 0.99)"


@pytest.mark.parametrize("argv,message", [
    (["--betas", "topk=1,0.9"], "--betas/--lrs topk: invalid labkit config"),
    (["--lrs", "powersgd=0"], "optim.lr: must be > 0"),
    (["--lrs", "powersgd"], "expected COMPRESSOR=LR"),
    (["--betas", "sign=0,2"], "optim.beta2: must be in [0, 1)"),
    (["--beta1", "1.0"], "optim.beta1: must be in [0, 1)"),
    (["--lr", "-0.01"], "optim.lr: must be > 0"),
    (["--weight-decay", "-0.1"], "optim.weight_decay: must be >= 0"),
    (["--warmup-steps", "-1"], "optim.warmup_steps: must be >= 0"),
    (["--dataset", "nosuch"], "invalid choice: 'nosuch'"),
])
def test_bad_settings_are_a_usage_error_before_any_run(bench, monkeypatch, capsys, tmp_path, argv, message):
    monkeypatch.setattr(sys, "argv", ["compression.py", *argv])
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))  # where a corpus would be written
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no corpus left behind, no run started


def test_the_learning_rate_warmup_and_weight_decay_flags_reach_every_run(bench):
    args = argparse.Namespace(dataset="bigram", powersgd_rank=8, powersgd_min_rate=6.0, beta1=0.5, lr=0.015,
                              weight_decay=0.02, warmup_steps=123)
    config = bench.bench_config(args)
    assert (config.optim.lr, config.optim.weight_decay, config.optim.warmup_steps) == (0.015, 0.02, 123)
    topk = config.replace(**bench.compressor_settings("topk", bench.own_settings({}, {})))
    assert (topk.optim.lr, topk.optim.weight_decay, topk.optim.warmup_steps) == (0.015, 0.02, 123)
