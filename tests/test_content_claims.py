"""Claims the workshop text makes about counts agree with labkit's own counters and tables.

* Widening the model: labs.md (lab 00, "Width 256") and notebooks 00 and 02 say which way compute per gradient byte
  moves. The step's FLOPs are ``flops_per_token`` × the tokens of a step (batch × block, fixed by the config); the
  bytes a DDP step all-reduces are 4 per parameter (fp32 gradients). Both grow about as width², but attention's
  FLOPs (12·L·d·T) only as the width, so FLOPs per byte fall as the model widens: the text must say so, and a text
  that claimed the opposite ("compute grows faster than the bytes sent") fails here.
* Notebook 06's tensor-core ratios are the ratios of ``labkit.gpu_peaks``' datasheet rows.

Pure: configs, counters and text only; no process starts.
"""
import json
import re
from pathlib import Path

import pytest

from labkit.config import load_config
from labkit.data.tokenizer import CharTokenizer
from labkit.gpu_peaks import PEAK_TFLOPS
from labkit.model.flops import count_params, flops_per_token
from labkit.model.gpt import GPTShape

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
GRADIENT_BYTES = 4  # fp32 DDP: one fp32 gradient per parameter, all-reduced each step

# What each place compares: (overrides of configs/quickstart.yaml, widths before → after).
LAB_00 = ({}, [(64, 256)])  # the panel as shipped (width 64), then "Width 256"
# notebook 02's own overrides (4 layers; width 128 in the test run, 256 otherwise), then the next larger width on
# DataParallelLab's dropdown (labkit/widgets/data_parallel.py: 64, 128, 256, 320)
LAB_02 = ({"model.n_layer": 4}, [(128, 256), (256, 320)])

# Ways the text states the direction of compute per gradient byte as the model widens.
CLAIMS = [(re.compile(r"compute per byte (falls|rises)"), None),
          (re.compile(r"compute grows faster than the bytes"), "rises"),
          (re.compile(r"more compute per byte"), "rises"),
          (re.compile(r"less compute per byte"), "falls")]


def normalise(text: str) -> str:
    return " ".join(text.split())


def claimed_directions(text: str) -> set[str]:
    """Every direction of compute per byte that ``text`` states, by any of ``CLAIMS``' phrasings."""
    text = normalise(text)
    return {direction or m.group(1) for pattern, direction in CLAIMS for m in pattern.finditer(text)}


def step_counts(overrides: dict, width: int) -> dict[str, float]:
    """One optimizer step of the quickstart config at this width: its FLOPs (forward + backward, every token of the
    global batch) and the gradient bytes DDP all-reduces, both from labkit's own counters."""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml").replace(**{**overrides, "model.n_embd": width})
    meta = json.loads((ROOT / "datasets" / f"{cfg.data.dataset}.json").read_text(encoding="utf-8"))
    shape = GPTShape.from_config(cfg.model, CharTokenizer(meta["alphabet"]).vocab_size)
    tokens = cfg.data.batch_size * cfg.model.block_size
    flops, grad_bytes = flops_per_token(shape) * tokens, GRADIENT_BYTES * count_params(shape)["total"]
    return {"flops": flops, "bytes": grad_bytes, "per_token": flops / tokens / grad_bytes}


def counted_direction(overrides: dict, before: int, after: int) -> str:
    ratio = [step_counts(overrides, w)["flops"] / step_counts(overrides, w)["bytes"] for w in (before, after)]
    return "falls" if ratio[1] < ratio[0] else "rises"


def lab_00_width_item() -> str:
    """labs.md's lab 00 run "Width 256", its question and expected answer."""
    text = (ROOT / "workshops" / "labs.md").read_text(encoding="utf-8")
    lab = text[text.index('<a id="lab-00"></a>'):text.index('<a id="lab-01"></a>')]
    start = lab.index("*Width 256*")
    end = lab.find("\n\n", start)
    return normalise(lab[start:end if end >= 0 else len(lab)])


def markdown_with(notebook: str, anchor: str) -> str:
    nb = json.loads((NOTEBOOKS / notebook).read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    found = [cell for cell in cells if anchor in cell]
    assert len(found) == 1, f"{notebook}: {len(found)} markdown cells say {anchor!r}"
    return found[0]


def test_the_counters_say_compute_per_gradient_byte_falls_as_the_labs_widen():
    for overrides, pairs in (LAB_00, LAB_02):
        for before, after in pairs:
            small, wide = step_counts(overrides, before), step_counts(overrides, after)
            assert wide["flops"] / small["flops"] < wide["bytes"] / small["bytes"], (overrides, before, after)
            assert counted_direction(overrides, before, after) == "falls"


def test_labs_md_states_the_counters_direction_and_numbers_for_width_256():
    item = lab_00_width_item()
    (overrides, [(before, after)]) = LAB_00
    counted = counted_direction(overrides, before, after)
    assert claimed_directions(item) == {counted}, item
    # with the same batch, less compute per byte means, speeds unchanged, a larger communication share
    share = re.search(r'up or down\?" — \*Expect:\* (?:by the counts, )?(?:slightly )?(up|down)\b', item)
    assert share and share.group(1) == {"falls": "up", "rises": "down"}[counted], item
    small, wide = step_counts(overrides, before), step_counts(overrides, after)
    assert f"FLOPs by ~{round(wide['flops'] / small['flops'])} " in item, item
    assert f"all-reduced by ~{round(wide['bytes'] / small['bytes'])} " in item, item
    numbers = re.search(r"(\d+\.\d+) → (\d+\.\d+) FLOPs per byte per token", item)
    assert numbers, item
    assert [float(n) for n in numbers.groups()] == [round(small["per_token"], 2), round(wide["per_token"], 2)]


@pytest.mark.parametrize("notebook,anchor,lab", [
    ("00_quickstart.ipynb", "**A wider model** (`width` 256)", LAB_00),
    ("02_data_parallel.ipynb", "* A larger width", LAB_02),
], ids=["00_quickstart", "02_data_parallel"])
def test_the_notebooks_state_the_counters_direction_for_a_wider_model(notebook, anchor, lab):
    overrides, pairs = lab
    counted = {counted_direction(overrides, before, after) for before, after in pairs}
    assert len(counted) == 1, f"{notebook}'s comparisons disagree: one sentence cannot say them all"
    cell = markdown_with(notebook, anchor)
    assert claimed_directions(cell) == counted, normalise(cell)


@pytest.mark.parametrize("text,directions", [
    ('*Expect:* down: compute grows faster than the bytes sent. MFU rises.', {"rises"}),  # labs.md's old sentence
    ("(`width` 256): more compute per byte communicated, so the communication shares fall.", {"rises"}),  # 00's old
    ("compute grows as width², communication as width²", set()),  # 02's old sentence: no direction at all
    ("so compute per byte\nfalls; less compute per byte", {"falls"}),
])
def test_a_text_claiming_another_direction_is_caught(text, directions):
    assert claimed_directions(text) == directions


def test_notebook_06_states_the_datasheet_ratios_of_labkits_gpu_peaks():
    a100, h100 = PEAK_TFLOPS["NVIDIA A100-SXM4-80GB"], PEAK_TFLOPS["NVIDIA H100 80GB HBM3"]
    text = normalise(markdown_with("06_mixed_precision.ipynb", "# 06 · Mixed precision"))
    m = re.search(r"\(dense, no sparsity\): tensor cores do bf16/fp16 at (\d+)× the plain fp32 rate on an A100 "
                  r"\((\d+) vs (\d+(?:\.\d+)?) TFLOP/s\) and ~(\d+)× on an H100 SXM \((\d+) vs (\d+)\), twice their "
                  r"TF32 rate; the H100 does fp8 at (\d+)× its bf16", text)
    assert m, f"notebook 06 no longer states the datasheet ratios in the expected words: {text[:600]}"
    a_ratio, a_bf16, a_fp32, h_ratio, h_bf16, h_fp32, fp8_ratio = (float(g) for g in m.groups())
    assert (a_bf16, a_fp32) == (a100["bf16"], a100["fp32"]) and a100["fp16"] == a100["bf16"]
    assert a_ratio == pytest.approx(a100["bf16"] / a100["fp32"], rel=0.01)  # exactly: no "~"
    assert (h_bf16, h_fp32) == (round(h100["bf16"]), round(h100["fp32"])) and h100["fp16"] == h100["bf16"]
    assert h_ratio == round(h100["bf16"] / h100["fp32"])  # about: "~"
    for row in (a100, h100):
        assert row["bf16"] / row["tf32"] == pytest.approx(2, rel=0.01)  # "twice their TF32 rate"
    assert fp8_ratio == pytest.approx(h100["fp8"] / h100["bf16"], rel=0.01) and "fp8" not in a100
