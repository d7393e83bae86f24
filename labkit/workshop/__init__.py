"""Workshop material that is code: the exercises' generator and the paths the exercises read.

The instructor's side of a workshop lives in ``workshops/`` (agendas, questions for the room, failures
and fixes); each exercise is written once, as a solution notebook, and :mod:`labkit.workshop.exercises`
turns it into the participant's notebook. ``labkit workshop exercises`` regenerates them;
``labkit workshop exercises --check`` says whether the committed ones are current.
"""
from labkit.workshop.exercises import exercise_data, repo_root

__all__ = ["exercise_data", "repo_root"]
