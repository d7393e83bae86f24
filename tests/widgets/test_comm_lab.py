"""The communication lab: widgets, sweeps and the pictures they draw."""
import pytest

from helpers import tiny_config
from labkit.metrics.communication import communication_cut, cumulative
from labkit.plots import illegible_texts
from labkit.widgets.communication import (CommunicationLab, bandwidth_settings, comm_frac_figure, loss_figure,
                                          sent_share_figure)
from labkit.widgets.network_lesson import (FAST_LINK_GBPS, cut_text, lesson_links, mixed_precision_settings,
                                           modelled_comm_s, network_sweep, ordering_notes, step_parts)


def row(compression, bandwidth, frac, tps, comm_s=1.0, wire=(100, 100)):
    return {"label": f"{compression}@{bandwidth}", "comm.compression": compression, "comm.bandwidth_gbps": bandwidth,
            "comm_frac": frac, "tokens_per_s": tps, "comm_s": comm_s, "wire_bytes": list(wire), "loss": [3.0, 2.0],
            "step": [0, 1], "entropy_floor": 1.5}


def test_settings_and_labels_follow_the_widgets():
    lab = CommunicationLab(tiny_config())
    lab.compression.value = "topk"
    lab.ratio.value = 0.1
    lab.bandwidth.value = 10.0
    lab.precision.value = "bf16"
    s = lab.settings()
    assert (s["comm.compression"], s["comm.compression_ratio"], s["comm.bandwidth_gbps"], s["precision.mode"]) == \
        ("topk", pytest.approx(0.1), 10.0, "bf16")
    assert lab.label() == "topk, bf16, 10 Gb/s"
    lab.sync.value = "diloco"
    lab.every.value = 16
    assert lab.settings()["comm.compression"] == "none"  # periodic sync replaces per-step (compressed) sync
    assert lab.label() == "diloco H=16, bf16, 10 Gb/s"


@pytest.mark.multiproc
def test_run_button_launches_a_real_run_and_draws_it():
    lab = CommunicationLab(tiny_config(**{"run.steps": 4}), nproc=2)
    lab.compression.value = "sign"
    lab.bandwidth.value = 1.0
    lab.run_button.click()
    assert len(lab.rows) == 1 and lab.rows[0]["label"] == "sign, fp32, 1 Gb/s"
    assert "communication" in lab.status.value and bytes(lab.picture.value).startswith(b"\x89PNG")
    assert all(w < r for w, r in zip(lab.rows[0]["wire_bytes"], lab.rows[0]["raw_bytes"]))  # 1 bit an entry


def test_bandwidth_sweep_settings():
    got = bandwidth_settings([1, 10], ["none", "topk"], latency_us=20)
    assert [label for label, _ in got] == ["none @ 1 Gb/s", "none @ 10 Gb/s", "topk @ 1 Gb/s", "topk @ 10 Gb/s"]
    assert got[0][1] == {"comm.bandwidth_gbps": 1, "comm.latency_us": 20, "comm.compression": "none"}


def test_comm_frac_figure_draws_the_25_and_35_percent_lines():
    rows = [row("none", 1, 0.5, 100), row("none", 10, 0.2, 300), row("topk", 1, 0.1, 400), row("topk", 10, 0.05, 420)]
    ax_frac, ax_tput = comm_frac_figure(rows).axes
    levels = sorted(line.get_ydata()[0] for line in ax_frac.lines if line.get_linestyle() == "--")
    assert levels == [25, 35]
    assert list(ax_frac.lines[0].get_ydata()) == [50.0, 20.0] and list(ax_tput.lines[1].get_ydata()) == [400, 420]
    with_exposed = [dict(r, comm_exposed_frac=r["comm_frac"] / 2) for r in rows]  # in flight and exposed, both drawn
    ax_frac = comm_frac_figure(with_exposed).axes[0]
    exposed = [line for line in ax_frac.lines if line.get_linestyle() == ":"]
    assert [list(line.get_ydata()) for line in exposed] == [[25.0, 10.0], [5.0, 2.5]]
    assert "none: exposed" in [t.get_text() for t in ax_frac.get_legend().get_texts()]
    for label in ax_frac.texts:  # the lines' labels are inside the axes (they were left of a log axis' view)
        x, _ = ax_frac.transAxes.inverted().transform(label.get_transform().transform(label.get_position()))
        assert 0 <= x <= 1 and "exposed: scaling" in label.get_text()


def test_communication_cut_and_loss_vs_bytes():
    before, after = row("none", 1, 0.5, 100, comm_s=1.0), row("bf16", 1, 0.3, 140, comm_s=0.58, wire=(50, 50))
    cut = communication_cut(before, after)
    assert cut["comm_s_cut"] == pytest.approx(0.42) and cut["bytes_cut"] == pytest.approx(0.5)
    assert cut["speedup"] == pytest.approx(1.4)
    assert cumulative([1, 2, 3]) == [1, 3, 6]
    ax_step, ax_bytes = loss_figure([before, after]).axes
    assert list(ax_bytes.lines[1].get_xdata()) == [50 / 1e6, 100 / 1e6]


def test_sent_share_figure_sorts_parameters_and_draws_the_budget():
    shares = {"wte.weight": 0.23, "blocks.0.attn.qkv.weight": 0.0002, "ln_f.weight": 0.6, "blocks.0.ln_1.weight": 0.0}
    ax = sent_share_figure(shares, "topk 1%", budget=0.01).axes[0]
    bars = ax.patches
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "blocks.0.ln_1.weight", "blocks.0.attn.qkv.weight", "wte.weight", "ln_f.weight"]  # largest on top
    assert [round(b.get_width(), 6) for b in bars[1:]] == [0.02, 23.0, 60.0]  # percent of the parameter
    assert 0 < bars[0].get_width() < 0.02  # a parameter that sent nothing still shows, at the edge
    assert [line.get_xdata()[0] for line in ax.lines] == [1.0] and "0%" in [t.get_text().strip() for t in ax.texts]


def test_the_lab_shows_where_a_sparsifiers_bytes_went_and_hides_it_otherwise():
    lab = CommunicationLab(tiny_config())
    topk = {**row("topk", 1, 0.1, 400), "comm.compression_ratio": 0.01, "sent_shares": {"wte.weight": 0.3, "h": 0.001}}
    lab.rows = [topk]
    lab.draw(topk)
    assert bytes(lab.shares_picture.value).startswith(b"\x89PNG") and lab.shares_picture.layout.display is None
    plain = {**row("none", 1, 0.5, 100), "sent_shares": {}}
    lab.rows.append(plain)
    lab.draw(plain)
    assert lab.shares_picture.layout.display == "none" and bytes(lab.picture.value).startswith(b"\x89PNG")


def test_every_figure_of_notebook_04_is_legible_at_the_output_width():
    rows = [row("none", 1, 0.5, 100), row("none", 10, 0.2, 300), row("topk", 1, 0.1, 400), row("topk", 10, 0.05, 420)]
    rows = [dict(r, comm_exposed_frac=r["comm_frac"] / 2) for r in rows]
    for fig in (comm_frac_figure(rows), loss_figure(rows),
                sent_share_figure({"wte.weight": 0.3, "h": 0.001}, "topk", 0.01)):
        assert illegible_texts(fig) == []


def test_loss_against_bytes_shows_no_negative_megabytes_and_steps_are_whole():
    """Section 3's runs: none sends 1.6 MB a step, topk and randomk 1% about 32 kB; the axis showed −10⁰ MB."""
    def sent(label, wire, steps=16):
        return dict(row(label, 1, 0.5, 100), wire_bytes=[wire] * steps, loss=[3.0 - 0.05 * i for i in range(steps)],
                    step=list(range(steps)))

    ax_step, ax_bytes = loss_figure([sent("none", 1_616_384), sent("topk 1%", 32_000), sent("randomk 1%", 32_000),
                                     sent("local_sgd H=8", 0)]).axes
    left, right = ax_bytes.get_xlim()
    assert left >= 0 and all(t >= 0 for t in ax_bytes.get_xticks() if left <= t <= right)
    assert all(float(t).is_integer() for t in ax_step.get_xticks()
               if ax_step.get_xlim()[0] <= t <= ax_step.get_xlim()[1])


def test_the_lab_shows_a_placeholder_not_a_broken_image_until_its_first_run():
    lab = CommunicationLab(tiny_config())
    assert lab.picture.showing_placeholder and "Press Run" in lab.picture.waiting
    assert lab.shares_picture.layout.display == "none"
    lab.rows = [row("none", 1, 0.5, 100)]
    lab.draw(dict(lab.rows[0], sent_shares={}))
    assert not lab.picture.showing_placeholder


def measured(label, bandwidth, tps, step_s=0.150, exposed_s=0.010, wire=1_616_384, jitter=0.05, load=1.0,
             compression="none"):
    """A section-1 row as the sweep collects it: per-step tokens/s alternating ±jitter around ``tps``."""
    return {"label": label, "comm.compression": compression, "comm.bandwidth_gbps": bandwidth, "comm.latency_us": 50.0,
            "tokens_per_s": tps, "tokens_per_s_steps": [tps * (1 + jitter * (-1) ** i) for i in range(16)],
            "step_time_s": step_s, "comm_s": exposed_s, "comm_exposed_s": exposed_s, "comm_frac": exposed_s / step_s,
            "comm_exposed_frac": exposed_s / step_s, "wire_bytes": [wire] * 16, "comm_calls": 1.0, "load_1min": load}


def test_the_slow_links_are_chosen_from_this_machines_compute_so_communication_dominates_there():
    """The quick-mode inversion: on a ~150 ms step, 1 Gb/s holds a 1.6 MB all-reduce for 13 ms and 10 Gb/s for 1.3 ms,
    a difference inside the step-to-step noise. The links are now chosen from the measured compute."""
    first = measured("none @ 100 Gb/s", FAST_LINK_GBPS, 13_000.0)
    links = lesson_links(first, 2, shares=(0.15, 0.6))
    assert [share for share, _ in links] == [0.15, 0.6] and links[0][1] > links[1][1]
    compute = step_parts(first)["compute_s"]
    for share, gbps in links:
        comm = modelled_comm_s(step_parts(first), 2, gbps)
        assert comm / (comm + compute) == pytest.approx(share, rel=0.06)  # two significant digits of bandwidth
    assert modelled_comm_s(step_parts(first), 2, 1.0) == pytest.approx(2 * 50e-6 + 1_616_384 / 125e6)
    slow_machine = measured("none @ 100 Gb/s", FAST_LINK_GBPS, 2_000.0, step_s=1.0)
    assert lesson_links(slow_machine, 2, (0.6,))[0][1] < links[1][1]  # a slower core needs a slower link
    assert lesson_links(first, 2, (0.6,), latency_us=200_000.0) == []  # the latencies alone exceed that share


def test_a_bandwidth_ordering_within_the_noise_or_inverted_is_explained_from_the_numbers():
    fast, slow = measured("none @ 10 Gb/s", 10.0, 6_000.0), measured("none @ 1 Gb/s", 1.0, 6_100.0, exposed_s=0.0216)
    note = " ".join(ordering_notes([fast, slow], 2).split())
    assert note.startswith("none @ 10 Gb/s → none @ 1 Gb/s: 6,000 → 6,100 tokens/s (+2%), "
                           "within the step-to-step noise")
    assert ("adds 11.6 ms of modelled communication to a 150 ms step (8%); "
            "exposed communication measured 10.0 → 21.6") in note
    assert note.endswith("The machine's 1-minute load went from 1.0 to 1.0 between the runs.")
    noisy = " ".join(ordering_notes([dict(fast, tokens_per_s_steps=[6000, 9000] * 8), slow], 2).split())
    assert noisy.endswith("Too little to stand out of the noise: the links are too close for this machine.")
    hidden = " ".join(ordering_notes([fast, dict(slow, comm_exposed_s=0.011, comm_s=0.011)], 2).split())
    assert hidden.endswith("measured 10.0 → 11.0 ms a step. Backward hid most of it.")
    inverted = " ".join(ordering_notes([fast, measured("none @ 1 Gb/s", 1.0, 9_000.0, jitter=0.01, load=4.2)],
                                       2).split())
    assert "faster on the slower link, beyond the step-to-step noise" in inverted and "from 1.0 to 4.2" in inverted
    holds = ordering_notes([measured("a", 100.0, 13_000.0, jitter=0.01), measured("b", 0.06, 5_000.0, jitter=0.01)], 2)
    assert holds.startswith("Throughput falls as the link slows")


def test_mixed_precision_computes_in_bf16_only_where_bf16_measured_fast():
    from labkit.widgets.precision import bf16_here

    cpu = tiny_config(**{"run.device": "cpu"})
    slow = {"fp32": 0.080, "bf16": 0.001, "speedup": 0.0125, "size": 256, "threads": 1}
    label, settings, why = mixed_precision_settings(*bf16_here(cpu, 2, slow, native=[])[:2])
    assert label == "fp32 + bf16 gradients" and settings == {"precision.mode": "fp32", "comm.compression": "bf16"}
    assert "no native bf16" in why and "only the communication half" in why
    fast = dict(slow, bf16=0.19, speedup=0.19 / 0.08)
    assert mixed_precision_settings(*bf16_here(cpu, 2, fast, native=["avx512_bf16"])[:2])[1] == \
        {"precision.mode": "bf16", "comm.compression": "bf16"}


def test_a_communication_cut_against_the_lesson_is_explained_not_printed_bare():
    """The issue's EPYC: bf16 compute 24x slower, "communication time cut by -182% ... throughput ×0.13"."""
    before = measured("fp32", 1.0, 10_000.0, step_s=0.150, exposed_s=0.010)
    after = measured("bf16", 1.0, 1_300.0, step_s=1.150, exposed_s=0.0282, wire=808_192)
    text = " ".join(cut_text(before, after, "2 CPU processes").split())
    assert text.startswith("communication time up by 182% (bytes cut by 50%)") and "cut by -" not in text
    assert "throughput ×0.13" in text and "waits for the slower rank included" in text
    assert "Throughput fell: compute went from 140 to 1122 ms a step, and communication saved nothing." in text
    good = cut_text(before, measured("bf16", 1.0, 12_000.0, step_s=0.145, exposed_s=0.005, wire=808_192), "x")
    assert good.startswith("communication time cut by 50% (bytes cut by 50%)") and "fell" not in good


@pytest.mark.multiproc
def test_the_network_sweep_measures_compute_first_then_runs_the_links_it_chose(tmp_path):
    cfg = tiny_config(**{"run.steps": 4, "run.runs_dir": str(tmp_path)})
    rows, why = network_sweep(cfg, 2, ["none"], shares=(0.5,))
    assert [r["comm.bandwidth_gbps"] for r in rows][0] == FAST_LINK_GBPS and len(rows) == 2
    assert 0 < rows[1]["comm.bandwidth_gbps"] < FAST_LINK_GBPS and f"{rows[1]['comm.bandwidth_gbps']:g} Gb/s" in why
    assert "ms of compute per step" in " ".join(why.split()) and len(rows[1]["tokens_per_s_steps"]) == 4
