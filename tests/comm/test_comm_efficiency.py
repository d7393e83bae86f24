"""Communicating less (local SGD, DiLoCo) and an emulated network you can dial."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import tiny_config
from labkit.comm import collectives as comm
from labkit.comm.network import LOOPBACK, Network, hold_until, network_from_config, set_network
from labkit.config import ConfigError
from labkit.validation import validate
from labkit.distributed import DistEnv
from labkit.metrics.timers import CommTimer
from labkit.parallel.dp.local_sgd import DiLoCo


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_alpha_beta_model():
    net = Network(latency_s=50e-6, bandwidth_bytes_per_s=1e9 / 8)  # 1 Gb/s
    assert net.transfer_s(125_000_000) == pytest.approx(1.0 + 50e-6)
    assert net.describe() == "emulated network: 1 Gb/s, 50 µs latency, ring collectives"
    assert not LOOPBACK.emulated and LOOPBACK.transfer_s(10**9) == 0
    cfg = tiny_config(**{"comm.bandwidth_gbps": 10, "comm.latency_us": 20}).comm
    net = network_from_config(cfg)
    assert net.latency_s == pytest.approx(20e-6) and net.bandwidth_bytes_per_s == pytest.approx(10e9 / 8)


def test_emulator_holds_each_collective_for_its_modelled_time(group_of_one):
    net = Network(latency_s=0.05, bandwidth_bytes_per_s=4e6)
    start = time.perf_counter()
    hold_until(start, "send", 400_000, 2, net)  # one message: α + n/β = 0.05 + 0.1 s
    assert time.perf_counter() - start >= 0.15
    start = time.perf_counter()
    hold_until(start, "all_reduce", 400_000, 2, net)  # ring over 2: 2 α + n/β = 0.1 + 0.1 s
    assert time.perf_counter() - start >= 0.2
    set_network(Network(latency_s=0.05))
    try:
        timer = CommTimer()
        comm.all_reduce(torch.ones(10), timer=timer)  # a group of one sends nothing: not held
        work = comm.all_reduce(torch.ones(10), async_op=True, timer=timer)
        work.wait()
        assert timer.collect()["comm_calls"] == 2  # both counted
    finally:
        set_network(LOOPBACK)


def test_a_group_of_one_gets_every_result_without_waking_the_backend(group_of_one):
    """Over one rank a collective's result is its input: labkit leaves gloo (and its thread) out of it,
    and still counts the call (an emulated network holds it for nothing: one rank sends no message)."""
    timer = CommTimer()
    x, out, scattered = torch.arange(6.0), torch.zeros(6), torch.zeros(6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comm.all_reduce(x, timer=timer)
        mean = comm.timed_all_reduce_mean(x, timer=timer).wait()
        comm.all_gather(out, x, async_op=True, timer=timer).wait()
        comm.reduce_scatter(scattered, x, timer=timer)
        comm.broadcast(x, 0, timer=timer)
    assert torch.equal(mean, torch.arange(6.0)) and torch.equal(out, x) and torch.equal(scattered, x)
    backend_ops = [e.key for e in prof.key_averages() if "c10d" in e.key or "gloo" in e.key]
    assert backend_ops == [], backend_ops
    got = timer.collect()
    assert got["comm_calls"] == 5 and got["comm_bytes"] == 0


def test_diloco_outer_step_by_hand(group_of_one):
    cfg = tiny_config(**{"comm.sync": "diloco", "comm.sync_every": 2, "comm.outer_lr": 0.7,
                         "comm.outer_momentum": 0.9})
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    strategy = DiLoCo(cfg, DistEnv(0, 1, 0, 1, "cpu", "gloo", 1))
    strategy.wrap(model)
    with torch.no_grad():
        model.weight.fill_(0.6)  # the inner optimizer moved the replica from 1.0 to 0.6
    strategy.after_optimizer_step(model, step=0)  # not due yet (H = 2): nothing happens
    assert model.weight.item() == pytest.approx(0.6)
    strategy.after_optimizer_step(model, step=1)
    # Δ = 1.0 − 0.6 = 0.4; Nesterov: buf = 0.4, update = Δ + 0.9·buf = 0.76; θ = 1 − 0.7·0.76
    assert model.weight.item() == pytest.approx(1.0 - 0.7 * 0.76)
    assert strategy.global_params[0].item() == pytest.approx(0.468)


@pytest.mark.multiproc
def test_local_sgd_with_h1_equals_every_step_gradient_averaging(tmp_path):
    """Plain SGD: averaging the replicas after each step = averaging their gradients (2 real ranks)."""
    base = {"run.name": "sync", "run.steps": 4, "run.eval_every": 0, "run.seed": 3, "model.n_layer": 1,
            "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16, "data.batch_size": 8,
            "data.micro_batch_size": 4, "optim.name": "sgd", "optim.beta1": 0.0, "optim.lr": 0.1,
            "optim.min_lr": 0.1, "optim.warmup_steps": 0, "optim.grad_clip": 0.0,
            "run.runs_dir": str(tmp_path)}
    cases = [{"name": "ddp", "overrides": base},
             {"name": "local", "overrides": {**base, "comm.sync": "local_sgd", "comm.sync_every": 1}},
             {"name": "local4", "overrides": {**base, "comm.sync": "local_sgd", "comm.sync_every": 4}}]
    from labkit.launcher import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()),
                           str(Path(__file__).parents[1] / "dp_cases.py"), str(tmp_path), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp, local, local4 = (torch.load(tmp_path / n / "final_model.pt", weights_only=True)
                          for n in ("ddp", "local", "local4"))
    for key in ddp:
        torch.testing.assert_close(local[key], ddp[key], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(local4[k], ddp[k], atol=1e-6) for k in ddp)  # H = 4 really differs
    steps = {n: [e for e in map(json.loads, open(tmp_path / n / "events.jsonl")) if e["type"] == "step"]
             for n in ("ddp", "local4")}
    assert [e["comm_bytes"] > 0 for e in steps["local4"]] == [False, False, False, True]  # one sync in 4 steps


@pytest.mark.parametrize("key,value,message", [
    ("comm.bandwidth_gbps", 0, "comm.bandwidth_gbps: must be > 0"),
    ("comm.compression_ratio", 0, "comm.compression_ratio"),
    ("comm.powersgd_rank", 0, "comm.powersgd_rank: must be >= 1"),
    ("comm.powersgd_min_compression_rate", 0.5, "comm.powersgd_min_compression_rate: must be >= 1"),
    ("comm.sync_every", 0, "comm.sync_every: must be >= 1"),
])
def test_bad_communication_settings_are_explained(key, value, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**{key: value}), nproc=1)


def test_powersgd_start_iteration_is_checked_only_for_powersgd():
    validate(tiny_config(**{"comm.powersgd_start_iter": 1}), nproc=1)  # no compressor uses it
    with pytest.raises(ConfigError, match="comm.powersgd_start_iter=1: must be >= 2"):
        validate(tiny_config(**{"comm.compression": "powersgd", "comm.powersgd_start_iter": 1}), nproc=1)
    validate(tiny_config(**{"comm.compression": "powersgd", "comm.powersgd_start_iter": 1,
                            "comm.powersgd_warm_start": False, "comm.error_feedback": False}), nproc=1)


def test_sync_modes_do_not_mix_with_sharding_or_compression():
    with pytest.raises(ConfigError, match="comm.sync=diloco replaces per-step gradient synchronisation"):
        validate(tiny_config(**{"comm.sync": "diloco", "parallel.dp.strategy": "zero2"}), nproc=1)
    with pytest.raises(ConfigError, match="unknown key|is not one of"):
        validate(tiny_config(**{"comm.compression": "zip"}), nproc=1)


@pytest.mark.multiproc
def test_emulated_time_shows_up_in_a_real_runs_comm_frac(tmp_path):
    from labkit.launcher import launch

    gbps = 0.05
    run = launch(tiny_config(**{"run.steps": 4, "comm.bandwidth_gbps": gbps, "comm.latency_us": 200}), nproc=2,
                 run_dir=tmp_path / "slow")
    assert run.wait(timeout=120) == "finished", run.log()
    assert run.events()[0]["network"] == "emulated network: 0.05 Gb/s, 200 µs latency, ring collectives"
    for e in (e for e in run.events() if e["type"] == "step"):
        assert e["comm_s"] >= 200e-6 + e["comm_bytes"] / (gbps * 1e9 / 8)  # held at least α + n/β
        assert e["comm_frac"] == pytest.approx(e["comm_s"] / e["step_time_s"])


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["torch_ddp", "ddp_bucketed"])
def test_compressed_training_reports_raw_and_wire_bytes(tmp_path, strategy):
    from labkit.launcher import launch

    run = launch(tiny_config(**{"run.steps": 4, "comm.compression": "topk", "comm.compression_ratio": 0.01,
                                "parallel.dp.strategy": strategy}), nproc=2, run_dir=tmp_path / "topk")
    assert run.wait(timeout=120) == "finished", run.log()
    steps = [e for e in run.events() if e["type"] == "step"]
    for e in steps:
        assert e["raw_bytes"] > 20 * e["comm_bytes"] > 0  # 1% of the values, plus their indices
        assert e["compression_ratio"] == pytest.approx(e["raw_bytes"] / e["comm_bytes"])
        assert e["compress_s"] >= 0
    shares = run.summary["sent_shares"]  # rank 0's picks: the fraction of each parameter sent per step
    final = torch.load(run.run_dir / "final_model.pt", weights_only=True)
    sizes = {name: tensor.numel() for name, tensor in final.items()}
    assert set(shares) <= set(sizes) and "wte.weight" in shares and all(0 <= s <= 1 for s in shares.values())
    sent_per_step, offered = sum(shares[n] * sizes[n] for n in shares), sum(sizes[n] for n in shares)
    assert 0.01 * offered <= sent_per_step <= 0.01 * offered + len(shares)  # k = ceil(1%) of each bucket
