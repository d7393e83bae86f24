"""A config panel: the knobs of a run as widgets, checked as you turn them, and a Run button.

Every change re-validates the whole config (the same ``labkit.validation.validate`` the CLI uses),
so an impossible combination — a batch that does not split over the processes, more processes
than the machine has — is explained on the panel and the Run button stays disabled.
"""
from __future__ import annotations

from typing import Optional

import ipywidgets as W

from labkit.config import Config, ConfigError, grad_accum_steps, max_procs, resolve_device
from labkit.validation import validate
from labkit.data import load_metadata
from labkit.model import GPTShape, count_params, flops_per_token
from labkit.widgets.dashboard import RunDashboard

WIDE = W.Layout(width="420px")
STYLE = {"description_width": "140px"}


class ConfigPanel:
    """Widgets for the common knobs; ``config()`` is the resulting, validated :class:`Config`."""

    def __init__(self, config: Config, nproc: int = 2):
        self.base = config
        self.run = None
        self.dashboard: Optional[RunDashboard] = None
        limit = max(1, max_procs(resolve_device(config)))
        m, d = config.model, config.data
        self.n_layer = W.IntSlider(m.n_layer, min=1, max=12, description="layers", style=STYLE, layout=WIDE)
        self.n_embd = W.Dropdown(options=sorted({32, 64, 128, 256, 384, m.n_embd}), value=m.n_embd,
                                 description="width (n_embd)", style=STYLE, layout=WIDE)
        self.nproc = W.IntSlider(min(nproc, limit), min=1, max=limit, description="processes", style=STYLE,
                                 layout=WIDE)
        self.batch_size = W.Dropdown(options=sorted({8, 16, 24, 32, 48, 64, 96, 128, d.batch_size}), value=d.batch_size,
                                     description="global batch", style=STYLE, layout=WIDE)
        self.precision = W.Dropdown(options=["auto", "fp32", "bf16", "fp16", "fp8"], value=config.precision.mode,
                                    description="precision", style=STYLE, layout=WIDE)
        self.attention = W.Dropdown(options=["auto", "naive", "sdpa", "labkit_flash", "labkit_triton", "flash_attn"],
                                    value=config.attention.backend,
                                    description="attention", style=STYLE, layout=WIDE)
        self.steps = W.IntSlider(config.run.steps, min=5, max=max(2000, config.run.steps), step=5,
                                 description="steps", style=STYLE, layout=WIDE)
        self.status = W.HTML()
        self.output = W.VBox()  # the Run button's live dashboard appears here
        self.run_button = W.Button(description="Run", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.run_button.on_click(self._on_run)
        self.stop_button.on_click(self._on_stop)
        for widget in self.controls:
            widget.observe(self._on_change, names="value")
        self._on_change()

    @property
    def controls(self) -> list[W.ValueWidget]:
        return [self.n_layer, self.n_embd, self.nproc, self.batch_size, self.precision, self.attention, self.steps]

    def micro_batch(self) -> int:
        """The largest micro-batch up to the config's that splits each process's share evenly."""
        share = self.batch_size.value // self.nproc.value
        limit = self.base.data.micro_batch_size
        return max((m for m in range(1, min(limit, share) + 1) if share % m == 0), default=limit)

    def config(self) -> Config:
        heads = self.base.model.n_head if self.n_embd.value % self.base.model.n_head == 0 else 1
        micro = self.micro_batch()
        return self.base.replace(**{
            "model.n_layer": self.n_layer.value, "model.n_embd": self.n_embd.value, "model.n_head": heads,
            "data.batch_size": self.batch_size.value, "data.micro_batch_size": micro,
            "precision.mode": self.precision.value, "attention.backend": self.attention.value,
            "run.steps": self.steps.value,
        })

    def problems(self) -> list[str]:
        batch, nproc = self.batch_size.value, self.nproc.value
        if batch % nproc:
            fits = [n for n in range(1, self.nproc.max + 1) if batch % n == 0]
            batches = [b for b in self.batch_size.options if b % nproc == 0]
            return [f"a global batch of {batch} sequences cannot be split evenly over {nproc} processes: "
                    f"try {' or '.join(map(str, fits))} process(es), or a batch of {' / '.join(map(str, batches))}"]
        try:
            validate(self.config(), nproc=self.nproc.value)
        except ConfigError as error:
            return error.problems
        return []

    def _describe(self, cfg: Config) -> str:
        meta = load_metadata(cfg.data.dataset) if cfg.data.tokenizer == "char" else None
        vocab = len(meta["alphabet"]) if meta else 256  # a user file's char vocabulary is known only once read
        shape = GPTShape.from_config(cfg.model, vocab_size=cfg.model.vocab_size or vocab)
        accum = grad_accum_steps(cfg, self.nproc.value)
        params = count_params(shape)["total"]
        return (f"✓ {self.nproc.value} process(es) × {cfg.data.micro_batch_size} sequences × {accum} "
                f"accumulation step(s) = batch {cfg.data.batch_size}; ≈{params / 1e6:.2f} M parameters, "
                f"{flops_per_token(shape) / 1e6:.2f} MFLOP per token")

    def _on_change(self, change=None) -> None:
        problems = self.problems()
        busy = self.run is not None and self.run.status == "running"
        self.run_button.disabled = bool(problems) or busy
        if problems:
            items = "".join(f"<li>{p}</li>" for p in problems)
            self.status.value = (f"<div style='color:#b00020;font-size:1.1em'><b>Cannot run:</b>"
                                 f"<ul style='margin:0;padding-left:1.2em'>{items}</ul></div>")
        else:
            self.status.value = f"<div style='color:#1b5e20;font-size:1.1em'>{self._describe(self.config())}</div>"

    def _on_run(self, button=None) -> None:
        import labkit

        self.run = labkit.launch(self.config(), nproc=self.nproc.value)
        self.run_button.disabled, self.stop_button.disabled = True, False
        self.dashboard = RunDashboard()
        self.output.children = [self.dashboard.widget]
        thread = self.dashboard.follow_in_background(self.run)
        self._watch_until_done(thread)

    def _watch_until_done(self, thread) -> None:
        import threading

        def reenable() -> None:
            thread.join()
            self.stop_button.disabled = True
            self._on_change()

        threading.Thread(target=reenable, daemon=True).start()

    def _on_stop(self, button=None) -> None:
        if self.run is not None:
            self.run.stop()
        self.stop_button.disabled = True
        self._on_change()

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML("<h3>Run configuration</h3>"), *self.controls, self.status,
                       W.HBox([self.run_button, self.stop_button]), self.output])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
