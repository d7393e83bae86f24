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


def test_the_first_block_says_it_has_nothing_to_rescale():
    """Block 1 has no earlier terms: not "rescaled by 0.000" but a sentence; later blocks say what they did."""
    import torch

    from labkit.model.flash import online_softmax_steps
    from labkit.widgets.flash import rescale_text, softmax_step_figure, step_line

    scores = torch.tensor([0.0, 1.0, 3.0, 2.0, 5.0, 4.0])
    steps = online_softmax_steps(scores, 2)  # blocks [0, 1], [3, 2] (max grows), [5, 4] (max grows)
    steps_flat = online_softmax_steps(torch.tensor([3.0, 1.0, 0.0, 2.0]), 2)  # the second block's max is lower
    assert rescale_text(steps[0]) == "first block: nothing earlier to rescale"
    assert rescale_text(steps[1]) == f"max grew: earlier terms × {steps[1]['rescale']:.3f}"
    assert rescale_text(steps_flat[1]) == "max unchanged: earlier terms kept (× 1)"
    assert "0.000" not in step_line(steps[0]) and step_line(steps[0]).startswith("keys  0- 1")
    title = softmax_step_figure(scores, steps, 0).axes[1].get_title()
    assert "nothing earlier to rescale" in title and "0.000" not in title
    explorer = OnlineSoftmaxExplorer(seq=8)
    assert "nothing earlier to rescale" in explorer.text.value and "rescale = 0.0000" not in explorer.text.value


def test_two_backends_with_equal_memory_both_show_and_are_named():
    """sdpa and labkit_flash save the same bytes: drawn with their own marker and dashes, one inside the other, and
    the legend and a sentence say they are equal."""
    rows = [{"backend": backend, "seq": seq, "time_s": 1e-3 * seq * k, "saved_bytes": seq * seq * (4 if k == 4 else 1)}
            for backend, k in (("naive", 4), ("sdpa", 1), ("labkit_flash", 2)) for seq in (64, 128)]
    from labkit.text import too_wide
    from labkit.widgets.flash import equal_memory_text, equal_to

    assert equal_to(rows, "saved_bytes") == {"labkit_flash": "sdpa"} and equal_to(rows, "time_s") == {}
    memory = attention_costs_figure(rows).axes[1]
    sdpa, flash = memory.lines[1], memory.lines[2]
    assert list(sdpa.get_ydata()) == list(flash.get_ydata())
    assert (sdpa.get_marker(), sdpa.get_linestyle()) != (flash.get_marker(), flash.get_linestyle())
    assert sdpa.get_markersize() > flash.get_markersize()  # the later line is drawn inside the earlier one
    assert [t.get_text() for t in memory.get_legend().get_texts()] == ["naive", "sdpa", "labkit_flash (= sdpa)"]
    assert equal_memory_text(rows).startswith("labkit_flash saves exactly what sdpa saves")
    assert not too_wide(equal_memory_text(rows))
    assert equal_memory_text(rows[:2]) == ""
