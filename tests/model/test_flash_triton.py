"""FlashAttention-2 in Triton (labkit_triton) and the flash_attn backend.

The kernels run here under Triton's CPU interpreter, in a subprocess: TRITON_INTERPRET=1 must be set
before the kernels are decorated, which this pytest process may already have done without it
(tests/model/triton_interpreter_checks.py does the work and prints JSON). They are compared, output and the
three input gradients, with softmax(QKᵀ/√d)·V computed in float64. The rest checks what a machine
without a CUDA GPU says when asked for labkit_triton or flash_attn.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.config import Config, ConfigError, resolve_auto
from labkit.validation import validate
from labkit.model import attention as attention_module

HELPER = Path(__file__).with_name("triton_interpreter_checks.py")
ROOT = Path(__file__).resolve().parents[2]


def run_python(args, **env):
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env)
    # the repository (labkit) and tests/ (helpers.py); the script's own folder comes first by itself
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, *args], check=False, env=environ, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def interpreter():
    return json.loads(run_python([str(HELPER)], TRITON_INTERPRET="1").strip().splitlines()[-1])


def describe(case):
    return f"{case['dtype']} {tuple(case['shape'])} causal={case['causal']}: {case['errors']}"


@pytest.mark.multiproc
def test_kernels_ran_in_the_interpreter(interpreter):
    assert interpreter["interpreted"] is True and interpreter["env"] == "1"
    seqs = {(c["shape"][-2], c["causal"]) for c in interpreter["cases"]}
    assert {(s, causal) for s in (1, 17, 40, 64) for causal in (True, False)} <= seqs


@pytest.mark.multiproc
def test_fp32_output_and_gradients_match_float64_reference(interpreter):
    for case in interpreter["cases"]:
        assert case["finite"], f"NaN/inf in {describe(case)}"
        assert case["dtypes_kept"], describe(case)
        assert max(case["errors"].values()) < 1e-4, describe(case)


@pytest.mark.multiproc
def test_fp16_and_bf16_keep_their_dtype_and_match(interpreter):
    for case in interpreter["low_precision"]:
        assert case["finite"] and case["dtypes_kept"], describe(case)
        assert max(case["errors"].values()) < 1e-2, describe(case)


@pytest.mark.multiproc
def test_saves_only_q_k_v_out_and_log_sum_exp(interpreter):
    saved = interpreter["saved"]  # seq 64, batch·heads 2, head_dim 16
    assert saved["grad_fn"] == interpreter["saved_class"] + "Backward"
    assert saved["shapes"] == [[2, 64, 16]] * 4 + [[2, 64]]
    assert not any(len(s) >= 2 and s[-1] == 64 and s[-2] == 64 for s in saved["shapes"]), "seq × seq tensor saved"


@pytest.mark.multiproc
def test_causal_skips_tiles_above_the_diagonal(interpreter):
    """64 tokens, 16 × 16 tiles: causal visits the 10 tiles on or below the diagonal of 16, in every kernel."""
    assert interpreter["dots"]["causal"] / interpreter["dots"]["full"] == pytest.approx(10 / 16)


@pytest.mark.multiproc
def test_gpt_trains_the_same_with_labkit_triton(interpreter):
    assert interpreter["gpt"]["loss"] < 1e-5 and interpreter["gpt"]["grads"] < 1e-4


@pytest.mark.multiproc
def test_cpu_without_interpreter_says_what_to_do_and_import_labkit_needs_no_triton():
    code = ("import sys, torch, labkit\n"
            "from labkit.model.attention import get_attention\n"
            "print('triton imported by labkit:', 'triton' in sys.modules)\n"
            "q = torch.randn(1, 2, 8, 16)\n"
            "try:\n"
            "    get_attention('labkit_triton')(q, q, q)\n"
            "except RuntimeError as e:\n"
            "    print('error:', e)\n")
    out = run_python(["-c", code])
    assert "triton imported by labkit: False" in out
    assert ("error: labkit_triton runs Triton kernels on a CUDA GPU; on CPU set TRITON_INTERPRET=1 "
            "(Triton's interpreter: correct but slow)") in out


@pytest.mark.parametrize("shape, kwargs, message", [
    ((1, 2, 8, 24), {}, r"head_dim in \(16, 32, 64, 128\).*got 24"),
    ((1, 2, 8, 256), {}, r"head_dim .*got 256"),
    ((1, 2, 8, 16), {"block_q": 8}, r"block_q must be a power of two ≥ 16"),
    ((1, 2, 8, 16), {"block_k": 48}, r"block_k must be a power of two ≥ 16"),
])
def test_unsupported_shapes_and_tiles_raise_value_error(shape, kwargs, message):
    from labkit.model.flash_triton import triton_flash_attention

    q = torch.randn(shape)
    with pytest.raises(ValueError, match=message):
        triton_flash_attention(q, q, q, **kwargs)


def test_mismatched_shapes_raise_value_error():
    from labkit.model.flash_triton import triton_flash_attention

    with pytest.raises(ValueError, match=r"one shape"):
        triton_flash_attention(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16))


def test_config_refuses_flash_attn_without_cuda_and_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as error:
        validate(Config().replace(**{"attention.backend": "flash_attn"}), check_data=False)
    message = str(error.value)
    assert "attention.backend=flash_attn" in message and "no CUDA GPU" in message
    assert "pip install labkit[gpu]" in message and "attention.backend=sdpa" in message


def test_flash_attn_missing_on_a_cuda_machine_says_how_to_install(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention_module, "_import_problem", lambda module: f"No module named {module!r}")
    problem = attention_module.backend_unavailable("flash_attn", "cuda")
    assert "does not import" in problem and "pip install labkit[gpu]" in problem and "sdpa" in problem


def test_flash_attn_backend_on_cpu_tensors_raises_a_clear_error():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match=r"flash_attn: .*NVIDIA GPUs only"):
        attention_module.get_attention("flash_attn")(q, q, q)


def test_config_refuses_labkit_triton_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = Config().replace(**{"attention.backend": "labkit_triton"})
    with pytest.raises(ConfigError, match=r"attention.backend=labkit_triton: .*TRITON_INTERPRET=1.*labkit_flash"):
        validate(cfg, check_data=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate(cfg, check_data=False)  # the interpreter is slow, but a valid choice


def test_auto_picks_flash_attn_only_where_it_runs(monkeypatch):
    import labkit.hardware

    advice = {"precision": ("fp32", "x"), "attention": ("flash_attn", "the flash-attn package is installed")}
    monkeypatch.setattr(labkit.hardware, "recommend", lambda: advice)
    cfg = Config().replace(**{"attention.backend": "auto", "run.device": "cpu"})
    chosen, reasons = resolve_auto(cfg)
    assert chosen.attention.backend == "sdpa" and "flash_attn cannot run here" in reasons["attention.backend"]

    monkeypatch.setattr(attention_module, "backend_unavailable", lambda name, device: None)  # a GPU with flash-attn
    chosen, reasons = resolve_auto(cfg)
    assert chosen.attention.backend == "flash_attn"
    assert reasons["attention.backend"] == "auto → flash_attn: the flash-attn package is installed"
