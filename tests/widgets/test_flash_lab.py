"""The FlashAttention lab's widgets and measurements."""
import pytest

from labkit.model.attention import attention_costs
from labkit.widgets.flash import OnlineSoftmaxExplorer, attention_costs_figure


def test_explorer_follows_the_sliders_to_the_exact_softmax():
    explorer = OnlineSoftmaxExplorer(seq=12, seed=1)
    explorer.block.value = 5
    assert explorer.step.max == 2  # blocks 0-4, 5-9, 10-11
    explorer.step.value = 0
    assert "keys 0–4" in explorer.text.value and "equal to the softmax" not in explorer.text.value
    explorer.step.value = 2
    assert "equal to the softmax of the whole row" in explorer.text.value
    maxes = [s["max"] for s in explorer.steps]
    assert maxes == sorted(maxes) and maxes[-1] == pytest.approx(explorer.scores.max().item())
    explorer.block.value = 12  # one block: the step slider shrinks and stays valid
    assert explorer.step.max == 0 and explorer.step.value == 0
    assert bytes(explorer.picture.value).startswith(b"\x89PNG")


def test_naive_attention_saves_the_square_matrix_flash_does_not():
    rows = {(r["backend"], r["seq"]): r for r in attention_costs([64, 128], ["naive", "labkit_flash"], heads=2,
                                                                   head_dim=16, repeats=1)}
    naive_growth = rows["naive", 128]["saved_bytes"] / rows["naive", 64]["saved_bytes"]
    flash_growth = rows["labkit_flash", 128]["saved_bytes"] / rows["labkit_flash", 64]["saved_bytes"]
    assert naive_growth > 3 and flash_growth == pytest.approx(2, rel=0.05)  # O(n²) vs O(n)
    assert rows["naive", 128]["saved_bytes"] >= 2 * 128 * 128 * 4  # at least one (heads × seq × seq) fp32 tensor
    assert all(r["time_s"] > 0 for r in rows.values())
    assert len(attention_costs_figure(list(rows.values())).axes) == 2
