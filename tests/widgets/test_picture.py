"""An empty picture shows its placeholder text, never the browser's broken-image icon."""
from labkit.plots import render_png
from labkit.widgets.picture import Picture
from matplotlib.figure import Figure


def _png() -> bytes:
    fig = Figure(figsize=(2, 1))
    fig.subplots().plot([0, 1])
    return render_png(fig)


def test_the_placeholder_shows_until_the_first_frame_and_the_image_hides():
    pic = Picture("waiting for the first step…")
    assert pic.showing_placeholder and pic.value == b""
    assert pic.children[1].layout.display == "none"  # the empty Image is never displayed
    assert "waiting for the first step…" in pic.children[0].value and pic.children[0].layout.display is None
    png = _png()
    pic.value = png
    assert not pic.showing_placeholder and pic.value == png
    assert pic.children[0].layout.display == "none" and pic.children[1].layout.display is None
    pic.value = b""  # cleared: back to the text
    assert pic.showing_placeholder


def test_the_placeholder_text_can_change_and_is_escaped():
    pic = Picture()
    pic.waiting = "press <Run> to start"
    assert "press &lt;Run&gt; to start" in pic.children[0].value
