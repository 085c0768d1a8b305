"""What the Horovod integrations compare at each step to see that an elastic reset re-formed
the world. Imports no Horovod: ``DiLoCo`` uses it on Horovod and ``torchrun`` alike."""
from typing import Any, Optional, Tuple

# Bumped by every elastic sync() (``integration/elastic.py``): the integration compares it at
# each step to see that the world was re-formed, even when the rank and size came out the same.
_generation = 0


def world_generation() -> int:
    return _generation


def next_generation() -> None:
    global _generation
    _generation += 1


def current_world(process_set: Any) -> Tuple[int, Optional[int], Optional[int]]:
    """What an elastic reset changes: (reset count, rank, size) within a Horovod process set;
    a process outside ``process_set`` has no rank in it."""
    if not process_set.included():
        return world_generation(), None, None
    return world_generation(), process_set.rank(), process_set.size()
