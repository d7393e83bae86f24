"""The intended structure, as checks (issue 36 §1): collectives go through labkit's communication layer
(``labkit/comm/``), where they are counted, timed and emulated; and no process that trains imports a widget.

The first is not yet true everywhere: :data:`STILL_TO_MOVE` lists, file by file, the collectives called on
``torch.distributed`` directly today. The check is that the list is exact, so a new direct call anywhere fails
here, and moving one into ``labkit.comm`` means deleting it from the list — the list only shrinks.
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
STILL_TO_MOVE = {
    "compile.py": {"all_reduce"},
    "consistency/lab.py": {"barrier", "broadcast"},
    "context_lab.py": {"barrier"},
    "fault/checkpoint.py": {"barrier", "broadcast_object_list"},
    "parallel/parallelize.py": {"all_gather", "all_gather_object", "all_reduce"},
    "parallel/pp/pipeline.py": {"irecv", "isend", "recv", "send"},
    "parallel/dp/zero_optimizer.py": {"all_reduce"},
    "session.py": {"broadcast_object_list"},
    "sim/calibrate_measure.py": {"all_gather_single", "all_reduce", "barrier", "recv", "reduce_scatter_single",
                                 "send"},
}


def direct_collectives() -> dict[str, set[str]]:
    """file (under labkit/) → the collectives it calls as ``dist.NAME(...)`` or ``torch.distributed.NAME(...)``."""
    found = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith(LAYER):
            continue
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
                owner = ast.unparse(node.func.value)
                if owner in ("dist", "torch.distributed"):
                    found[name].add(node.func.attr)
    for name, allowed in JOINING.items():
        found[name] -= allowed
    return {name: calls for name, calls in found.items() if calls}


def test_the_finder_sees_a_known_direct_call():
    assert "send" in direct_collectives()["parallel/pp/pipeline.py"]


def test_collectives_outside_the_communication_layer_are_exactly_the_ones_still_to_move():
    found = direct_collectives()
    new = {name: calls - STILL_TO_MOVE.get(name, set()) for name, calls in found.items()}
    assert not any(new.values()), f"call these through labkit.comm instead: {({k: v for k, v in new.items() if v})}"
    moved = {name: calls - found.get(name, set()) for name, calls in STILL_TO_MOVE.items()}
    assert not any(moved.values()), f"moved into labkit.comm: delete them from STILL_TO_MOVE: {moved}"


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
