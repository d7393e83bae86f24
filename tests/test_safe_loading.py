"""Nothing read from a run directory is ever executed: checkpoints load as plain data only."""
import ast
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from labkit.comm.compress import COMPRESSORS, build_compressor
from labkit.fault.recovery import from_bytes, to_bytes

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = (("w", (6, 5)), ("b", (4,)))
UNSAFE_ON_PURPOSE = "# unsafe on purpose"  # a line the scan below lets through: it proves the payload is live


class MakesADirectory:
    """Unpickling this calls ``os.mkdir(path)``: the side effect a malicious checkpoint would have."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.fixture
def world1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def crafted_share(marker: Path) -> bytes:
    return to_bytes({"pieces": {}, "parked": {}, "unplaced": {}, "global": {"x": MakesADirectory(marker)}})


def test_a_crafted_compressor_share_is_refused_without_running_it(tmp_path):
    live = tmp_path / "live"
    torch.load(io.BytesIO(crafted_share(live)), weights_only=False)  # unsafe on purpose
    assert live.is_dir()  # the payload works: a pickle load runs it
    refused = tmp_path / "refused"
    with pytest.raises(ValueError, match="refusing to load"):
        from_bytes(crafted_share(refused))
    assert not refused.exists()


def trained_compressor(name: str):
    compressor = build_compressor(name)
    compressor.place(0, LAYOUT)
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        compressor.allreduce(0, torch.randn(34, generator=generator))
    return compressor


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_every_compressor_state_round_trips_as_plain_data(world1, name):
    saved = trained_compressor(name)
    restored = build_compressor(name)
    restored.load_state_dict(from_bytes(to_bytes(saved.state_dict())))
    restored.place(0, LAYOUT)
    grad = torch.randn(34, generator=torch.Generator().manual_seed(9))
    assert torch.equal(restored.allreduce(0, grad), saved.allreduce(0, grad))
    if name == "powersgd":  # torch's own PowerSGD state: its iteration and numpy random generator
        assert restored.torch_state.iter == saved.torch_state.iter
        assert restored.torch_state.rng.random() == saved.torch_state.rng.random()


def unsafe_loads(path: Path) -> list[str]:
    """``torch.load`` calls without ``weights_only=True`` and any ``pickle``/``dill`` load, as "file:line"."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
        safe = any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords)
        unsafe = ((owner, node.func.attr) == ("torch", "load") and not safe
                  or owner in ("pickle", "dill", "cloudpickle") and node.func.attr in ("load", "loads", "Unpickler"))
        if unsafe and UNSAFE_ON_PURPOSE not in lines[node.lineno - 1]:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_code_in_the_repository_unpickles_arbitrary_objects():
    files = [p for folder in ("labkit", "benchmarks", "tests") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 20
    assert [hit for path in files for hit in unsafe_loads(path)] == []
