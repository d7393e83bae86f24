"""Shared helpers for the tests."""
import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from labkit.config import Config, load_config
from labkit.source import Source, show_source


def figure_fonts(fig) -> list[float]:
    """Every text a matplotlib figure draws (titles, labels, tick labels, legends, annotations): its font size."""
    texts = [t for t in fig.findobj(match=lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text"))
             if t.get_text().strip()]
    return [t.get_fontsize() for t in texts]


def legible(fig, smallest: float = 12) -> bool:
    """Projector-sized: at most 9.5 inches wide at 100 dpi, no text under ``smallest`` points."""
    width, _ = fig.get_size_inches()
    return width <= 9.5 and min(figure_fonts(fig)) >= smallest


def tiny_config(**dotted) -> Config:
    """A model small enough that a multi-process run takes a few seconds on 2 cores."""
    base = {
        "run.name": "test", "run.runs_dir": str(Path(tempfile.gettempdir()) / "labkit-test-runs"),
        "run.steps": 6, "run.eval_every": 0, "run.seed": 7,
        "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32,
        "data.batch_size": 8, "data.micro_batch_size": 4, "optim.warmup_steps": 2,
    }
    base.update(dotted)
    return load_config(None, base)


def gpt_loss_and_grads(attention: str, n_layer: int = 2):
    """Loss and parameter gradients of a tiny seeded GPT (head_dim 16) through one attention backend."""
    import torch

    from labkit.model import GPT
    from labkit.model.gpt import GPTShape

    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=16, block_size=40, n_layer=n_layer, n_head=2, n_embd=32, attention=attention))
    idx = torch.randint(0, 16, (2, 40))
    _, loss = model(idx, idx)
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


def assert_equal_but_floats(got: dict, want: dict, rel: float) -> None:
    """Two flat records are equal: every value exactly, but floats to a relative tolerance ``rel``."""
    import pytest

    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=rel, abs=0), key
        else:
            assert got[key] == value, key


def load_benchmark(name: str):
    """A benchmark script (``benchmarks/NAME.py``) imported as a module, for testing its functions."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_quick_benchmark(name: str, results_dir: Path, timeout: int = 900) -> tuple[str, list[dict]]:
    """Run ``benchmarks/NAME.py --quick`` with its results going to ``results_dir``; assert it exits 0 (showing the
    end of its output if not) and return its stdout and the records it appended to ``NAME.jsonl``."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / f"{name}.py"), "--quick"], cwd=root,
                          env={**os.environ, "LABKIT_RESULTS_DIR": str(results_dir)}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, [json.loads(line) for line in (results_dir / f"{name}.jsonl").read_text().splitlines()]


def processes_mentioning(text: str) -> list[int]:
    """pids of live processes whose command line contains ``text`` (a run's directory): none may outlive a run."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if text in cmdline and not zombie:
            found.append(int(entry))
    return found


# ---------------------------------------------------------------- the labs' Read-the-code cells

def code_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def read_the_code_cells(path: Path) -> list[str]:
    return [cell for cell in code_cells(path) if "show_source(" in cell]


def dotted(node: ast.expr) -> bool:
    """A name or an attribute chain (``BucketedDDP._launch``): safe and cheap to evaluate."""
    return isinstance(node, ast.Name) or (isinstance(node, ast.Attribute) and dotted(node.value))


def imports_of(cells: list[str]) -> list[ast.stmt]:
    """The top-level import statements of some cells, in order."""
    return [node for cell in cells for node in ast.parse(cell).body if isinstance(node, (ast.Import, ast.ImportFrom))]


def run_read_the_code_cells(path: Path) -> list[Source]:
    """Each ``show_source(...)`` call of a notebook, after the imports above it; nothing else of the notebook runs."""
    cells, shown = code_cells(path), []
    for i, cell in enumerate(cells):
        calls = [n for n in ast.walk(ast.parse(cell))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "show_source"]
        if not calls:
            continue
        namespace: dict = {"show_source": show_source}
        exec(compile(ast.Module(body=imports_of(cells[:i + 1]), type_ignores=[]), str(path), "exec"), namespace)
        for call in calls:
            assert len(call.args) == 1 and dotted(call.args[0]), f"{path.name}: {ast.unparse(call)}"
            options = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            obj = eval(compile(ast.Expression(call.args[0]), str(path), "eval"), namespace)
            shown.append(namespace["show_source"](obj, **options))
    return shown


def step_events(run_dir: Path) -> list[dict]:
    """A run's step events, in order."""
    return [e for e in map(json.loads, open(Path(run_dir) / "events.jsonl")) if e["type"] == "step"]


def train_variants(tmp_path_factory, prefix: str, base: dict, variants: dict[str, dict]) -> dict[str, Path]:
    """One process trains ``base`` with each variant's overrides: the references multi-process runs are held to."""
    from labkit.train import train

    roots = {}
    for variant, overrides in variants.items():
        roots[variant] = tmp_path_factory.mktemp(f"{prefix}-{variant}")
        train(tiny_config(**{**base, **overrides}), roots[variant])
    return roots


def run_cases(root: Path, cases: list[dict], nproc: int, timeout: int = 600) -> None:
    """Every case of ``cases`` ({"name", "overrides"}) trained in one torchrun launch of ``nproc`` gloo processes
    (tests/dp_cases.py), each into ``root / name``; fails with the workers' stderr, or if a worker outlives them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    from labkit.launcher import free_port

    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", str(nproc),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(Path(__file__).parent / "dp_cases.py"), str(root), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert processes_mentioning(str(root)) == []


def assert_trains_as_one_process(got: Path, want: Path, name: str, atol: float = 1e-5) -> None:
    """A multi-process MoE run (``got``) against one process on the same micro-batches (``want``): each step's loss,
    the routing counts summed over the replicas, and the final model (to ``atol``: fp32 rounding of other sums)."""
    import pytest
    import torch

    mine, theirs = step_events(got), step_events(want)
    assert [e["loss"] for e in mine] == pytest.approx([e["loss"] for e in theirs], rel=1e-5), name
    assert [e["moe_load"] for e in mine] == [e["moe_load"] for e in theirs], name
    assert [e["moe_drop_rate"] for e in mine] == [e["moe_drop_rate"] for e in theirs], name
    one, many = (torch.load(d / "final_model.pt", weights_only=True) for d in (want, got))
    assert many.keys() == one.keys(), name
    for key in one:
        torch.testing.assert_close(many[key], one[key], rtol=1e-4, atol=atol, msg=f"{name} {key}")
