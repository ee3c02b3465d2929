"""Lightkeeper for PyTorch trainers.

``Manager`` is one trainer's link to its node's replica agent (poll, commit, allreduce over the
cross-group communicator, the group's process group); ``DiLoCo`` runs the DiLoCo outer step of
the C++ library on a model's parameters. The compiled part
(``lightkeeper._native``) links no torch: tensors cross as (data pointer, element count, dtype,
device), so one build serves whatever PyTorch the trainer imports.
"""

from lightkeeper.errors import Error, QuorumLost
from lightkeeper import _native
from lightkeeper._native import Quorum
from lightkeeper.manager import Manager
from lightkeeper.diloco import DiLoCo
from lightkeeper.place import TaskPlace, task_place_from_env

__all__ = ["DiLoCo", "Error", "Manager", "Quorum", "QuorumLost", "TaskPlace", "task_place_from_env"]
