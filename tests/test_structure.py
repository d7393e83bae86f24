"""The intended structure, as checks (issue 36 §1): collectives go through labkit's communication layer
(``labkit/comm/``), where training traffic is counted, timed and emulated (``labkit.comm.collectives``) and what is
not training traffic is visibly left uncounted (``labkit.comm.control``); and no process that trains imports a widget.

Both hold: outside ``labkit/comm`` only the joining of the group (:data:`JOINING`) calls ``torch.distributed``'s
collectives, so a new direct call anywhere fails here.
"""
import ast
from collections import defaultdict
from pathlib import Path

import labkit
from test_import_graph import import_graph

PACKAGE = Path(labkit.__file__).parent
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
               "broadcast_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "barrier"}
LAYER = ("comm/",)  # labkit's communication layer: the one place collectives are called
JOINING = {"distributed.py": {"barrier"}}  # joining and leaving the group (torchrun's rendezvous is done by then)


def collectives_called(source: str, name: str = "<source>") -> set[str]:
    """The collectives ``source`` calls as ``dist.NAME(...)`` or ``torch.distributed.NAME(...)``."""
    return {node.func.attr for node in ast.walk(ast.parse(source, name))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
            and ast.unparse(node.func.value) in ("dist", "torch.distributed")}


def direct_collectives() -> dict[str, set[str]]:
    """file (under labkit/, outside the layer) → the collectives it calls directly, joining the group aside."""
    found = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if not name.startswith(LAYER):
            found[name] = collectives_called(path.read_text(), name)
    for name, allowed in JOINING.items():
        found[name] -= allowed
    return {name: calls for name, calls in found.items() if calls}


def test_the_finder_sees_direct_calls_and_only_those():
    source = "dist.send(t, 1)\ntorch.distributed.barrier()\nwork = dist.irecv(t, 0)\nqueue.send(t)\ndist.get_rank()\n"
    assert collectives_called(source) == {"send", "barrier", "irecv"}
    # the layer's bookkeeping module calls them directly too: the layer is where that is allowed
    assert {"barrier", "broadcast_object_list", "send"} <= collectives_called((PACKAGE / "comm/control.py").read_text())
    assert "comm/control.py" not in direct_collectives()


def test_no_collective_is_called_outside_the_communication_layer():
    found = {name: calls for name, calls in direct_collectives().items() if calls}
    assert not found, f"call these through labkit.comm instead: {found}"


def test_no_process_that_trains_imports_a_widget():
    edges, where = import_graph()
    assert not [key for key in where if key[1] == "labkit.widgets" and key[0] != "labkit.widgets"], \
        "only notebooks import labkit.widgets"
    reached, todo = set(), ["labkit.__main__", "labkit.train"]  # a worker: `python -m labkit train …`
    while todo:
        for unit in edges.get(todo.pop(), ()):
            if unit not in reached:
                reached.add(unit)
                todo.append(unit)
    assert "labkit.widgets" not in reached


def test_every_notebook_cell_has_an_id():
    """nbformat 4.5 gives each cell an id; a cell written without one makes nbformat warn on every read (and a
    later normalisation rewrite every notebook's ids)."""
    import json
    root = Path(labkit.__file__).parent.parent
    notebooks = sorted(root.glob("notebooks/*.ipynb")) + sorted(root.glob("workshops/**/*.ipynb"))
    missing = [f"{path.relative_to(root)} cell {i}" for path in notebooks
               for i, cell in enumerate(json.loads(path.read_text())["cells"]) if "id" not in cell]
    assert not missing, missing
