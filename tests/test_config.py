import subprocess
import sys

import pytest

from labkit.config import Config, ConfigError, grad_accum_steps, load_config, parse_override
from labkit.validation import validate


def problems_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_defaults_are_valid():
    validate(Config(), nproc=2)


def test_yaml_and_set_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  n_layer: 3\nrun:\n  steps: 10\n")
    cfg = load_config(path, ["model.n_layer=4", "optim.lr=0.01", "precision.mode=bf16"])
    assert cfg.model.n_layer == 4 and cfg.run.steps == 10
    assert cfg.optim.lr == 0.01 and cfg.precision.mode == "bf16"
    assert parse_override("parallel.dp.degree=auto") == ("parallel.dp.degree", "auto")


def test_unknown_key_suggests_nearest():
    msg = problems_of(load_config, None, {"model.n_layers": 4})
    assert "unknown key 'model.n_layers'" in msg and "did you mean 'model.n_layer'" in msg
    msg = problems_of(load_config, None, {"optimizer.lr": 1.0})
    assert "unknown key 'optimizer'" in msg and "did you mean 'optim'" in msg


def test_wrong_type_and_bad_choice_name_the_key():
    msg = problems_of(load_config, None, {"model.n_layer": "four", "attention.backend": "flsh"})
    assert "model.n_layer: expected int" in msg
    assert "attention.backend: 'flsh' is not one of" in msg and "'naive'" in msg
    assert problems_of(load_config, None, {"run.steps": 1.5}).count("run.steps") == 1


def test_ints_and_exponent_strings_are_accepted_for_floats(tmp_path):
    assert load_config(None, {"optim.lr": 1}).optim.lr == 1.0
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 3e-4\n")  # YAML 1.1 reads this as the string '3e-4'
    assert load_config(path, ["optim.min_lr=1e-5"]).optim.lr == 3e-4
    assert load_config(path, ["optim.min_lr=1e-5"]).optim.min_lr == 1e-5
    assert "optim.lr: expected float" in problems_of(load_config, None, {"optim.lr": "fast"})


def test_batch_not_divisible_by_world_times_micro():
    cfg = load_config(None, {"data.batch_size": 12, "data.micro_batch_size": 4})
    validate(cfg, nproc=1)  # 12 = 1 × 4 × 3 accumulation steps
    assert grad_accum_steps(cfg, 1) == 3
    msg = problems_of(validate, cfg, nproc=2)
    assert "data.batch_size=12 is not divisible by dp (2) × data.micro_batch_size (4) = 8" in msg


def test_parallel_degrees_must_multiply_to_world_size():
    cfg = load_config(None, {"parallel.dp.degree": 2, "data.batch_size": 16})
    validate(cfg, nproc=2)
    msg = problems_of(validate, cfg, nproc=4)
    assert "dp×tp×pp = 2×1×1 = 2 do not match the world size 4" in msg


def test_missing_dataset_lists_the_shipped_ones():
    msg = problems_of(validate, load_config(None, {"data.dataset": "markvo"}), nproc=1)
    assert "data.dataset" in msg and "markvo" in msg and "markov" in msg and "zipf" in msg


def test_nproc_beyond_machine_is_refused():
    """Two processes per core is the default line; a small model may have four per core, with a warning."""
    from labkit.config import cpu_count, max_procs
    from labkit.validation import OVERSUBSCRIBE_PER_CORE, machine_warnings

    big = load_config(None, {"model.n_layer": 12, "model.n_embd": 512})  # 38 M parameters
    too_many = max_procs("cpu") + 1
    assert f"nproc={too_many} is more than this machine supports for backend gloo" in problems_of(validate, big,
                                                                                               nproc=too_many)
    small = load_config(None, {"data.batch_size": 8 * too_many, "data.micro_batch_size": 8})
    validate(small, nproc=too_many)
    assert "processes per core" in machine_warnings(small, too_many)[0]
    assert machine_warnings(small, max_procs("cpu")) == []
    beyond = OVERSUBSCRIBE_PER_CORE * cpu_count() + 1
    assert f"nproc={beyond} is more than this machine supports" in problems_of(validate, small, nproc=beyond)


def test_all_problems_reported_at_once():
    cfg = load_config(None, {"model.n_embd": 30, "model.n_head": 4, "data.batch_size": 10})
    err = problems_of(validate, cfg, nproc=2)
    assert "not divisible by model.n_head" in err and "data.batch_size=10" in err


@pytest.mark.parametrize("key,value", [("optim.beta1", 1.0), ("optim.beta1", -0.1), ("optim.beta2", 1.5)])
def test_adam_betas_outside_zero_to_one_are_refused(key, value):
    assert f"{key}: must be in [0, 1), got {value}" in problems_of(validate, load_config(None, {key: value}), nproc=1)
    validate(load_config(None, {key: 0.0}), nproc=1)  # no momentum is allowed


def test_negative_weight_decay_is_refused_and_zero_allowed():
    assert "optim.weight_decay: must be >= 0" in problems_of(validate, load_config(None, {"optim.weight_decay": -0.1}),
                                                              nproc=1)
    validate(load_config(None, {"optim.weight_decay": 0.0}), nproc=1)


def test_negative_warmup_is_refused_and_zero_allowed():
    assert "optim.warmup_steps: must be >= 0" in problems_of(validate, load_config(None, {"optim.warmup_steps": -5}),
                                                              nproc=1)
    validate(load_config(None, {"optim.warmup_steps": 0}), nproc=1)


def test_fp16_on_cpu_is_refused_with_a_fix():
    msg = problems_of(validate, load_config(None, {"precision.mode": "fp16", "run.device": "cpu"}), nproc=1)
    assert "fp16 needs a CUDA GPU" in msg and "bf16" in msg


@pytest.mark.multiproc
def test_cli_rejects_bad_config_before_any_worker_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "labkit", "train", "configs/quickstart.yaml", "--nproc", "3",
                           "--set", "model.n_layr=2", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "did you mean 'model.n_layer'" in proc.stderr
    assert not run_dir.exists()  # nothing was created, no worker started
