"""Lightkeeper for PyTorch trainers.

``Manager`` is one trainer's link to its node's replica agent (poll, commit, allreduce over the
cross-group communicator, the group's process group); ``DiLoCo`` runs the DiLoCo outer step of
the C++ library on a model's parameters. The compiled part
(``lightkeeper._native``) links no torch: tensors cross as (data pointer, element count, dtype,
device), so one build serves whatever PyTorch the trainer imports.

The package is typed (``py.typed``, a stub of ``_native``): results are frozen dataclasses
(``Quorum``, ``SyncResult``), bad arguments raise ``InvalidArgument`` (a ``ValueError`` too),
and ``mypy --strict`` checks code that uses it.
"""

from lightkeeper.errors import Error, InvalidArgument, QuorumLost
from lightkeeper import _native
from lightkeeper.results import Quorum, SyncResult, SyncStats
from lightkeeper.manager import Manager
from lightkeeper.diloco import DiLoCo, shard_rows
from lightkeeper.place import TaskPlace, task_place_from_env

__all__ = ["DiLoCo", "Error", "InvalidArgument", "Manager", "Quorum", "QuorumLost",
           "SyncResult", "SyncStats", "TaskPlace", "shard_rows", "task_place_from_env"]
