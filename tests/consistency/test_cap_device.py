"""The CAP lab on a GPU machine: its tensors live on the CPU, so its process group is gloo, never NCCL.

No GPU is needed: ``torch.cuda.is_available`` is made to say a GPU is there, which is what
``run.device=auto`` and ``comm.backend=auto`` decide from (``labkit.config.resolve_device`` and
``resolve_backend``). The lab itself runs in this process, in a real gloo group of one.
"""
import pytest
import torch
import torch.distributed as dist

from helpers import tiny_config
from labkit.config import ConfigError, resolve_backend, resolve_device
from labkit.consistency import lab
from labkit.consistency.lab import cap_config, train_consistency
from labkit.consistency.replica import Replica
from labkit.data import build_datasets
from labkit.model import GPTShape
from labkit.validation import validate


@pytest.fixture
def claims_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_on_a_cuda_machine_the_lab_is_gloo_and_its_tensors_stay_on_the_cpu(claims_a_gpu):
    cfg = tiny_config(**{"comm.consistency": "async"})
    # what the lab was given before, and passed on unchanged: NCCL for CPU tensors
    assert (resolve_device(cfg), resolve_backend(cfg)) == ("cuda", "nccl")
    ran = cap_config(cfg)
    assert (resolve_device(ran), resolve_backend(ran)) == ("cpu", "gloo")
    assert ran.replace(**{"run.device": "auto", "comm.backend": "auto"}) == cfg  # nothing else changed
    train_ds, _, tokenizer, _ = build_datasets(ran.data.dataset, ran.data.tokenizer, ran.model.block_size,
                                               ran.data.val_fraction)
    replica = Replica(ran, GPTShape.from_config(ran.model, tokenizer.vocab_size, "naive"), train_ds, 0, 2)
    _, grad = replica.gradient()
    assert replica.vector().device.type == grad.device.type == "cpu"  # what gloo moves


def test_the_lab_runs_on_a_gpu_machine_in_a_gloo_group_with_cpu_tensors(claims_a_gpu, monkeypatch, tmp_path):
    """Before, this run asked for device cuda and an NCCL group, and failed before its first message."""
    seen = {}
    run_role = lab._run_role

    def watched(session):
        seen.update(backend=dist.get_backend(), env_backend=session.env.backend, device=session.env.device)
        run_role(session)

    monkeypatch.setattr(lab, "_run_role", watched)
    cfg = tiny_config(**{"comm.consistency": "sync", "run.steps": 3, "comm.measure_every": 1})
    summary = train_consistency(cfg, tmp_path)
    assert summary["status"] == "finished", summary.get("error")
    assert seen == {"backend": "gloo", "env_backend": "gloo", "device": "cpu"}
    snapshots = torch.load(tmp_path / "cap" / "params_rank0.pt", weights_only=True)
    assert snapshots["vectors"].device.type == "cpu" and len(snapshots["steps"]) == 4
    assert not dist.is_initialized()  # the group the lab started is gone


def test_nccl_set_by_hand_for_the_lab_is_refused_before_any_worker_starts():
    with pytest.raises(ConfigError, match="comm.backend=nccl: the CAP lab"):
        validate(tiny_config(**{"comm.consistency": "sync", "comm.backend": "nccl", "run.device": "cpu"}), nproc=2)
