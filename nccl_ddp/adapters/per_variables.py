"""A cache of objects built once per set of framework variables (a grad reducer per list of
`tf.Variable`s), keyed by the variables' identities.

`id()` alone is not a key: a variable that dies frees its id for the next one, and a new variable
would then find the dead one's reducer on one rank but not on another (their allocators differ),
so the ranks' collectives would pair up out of step. An entry here goes when any of its variables
is collected; a variable that cannot be weakly referenced is kept alive by its entry instead.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Generic, Hashable, Sequence, Tuple, TypeVar

T = TypeVar("T")


class PerVariables(Generic[T]):
    """`get(variables, settings, build)`: the object `build()` made for these very variables and
    settings, made now if there is none."""

    def __init__(self) -> None:
        self._entries: Dict[Tuple[Tuple[int, ...], Hashable], Tuple[T, Tuple[object, ...]]] = {}

    def get(self, variables: Sequence[object], settings: Hashable, build: Callable[[], T]) -> T:
        key = (tuple(id(v) for v in variables), settings)
        entry = self._entries.get(key)
        if entry is not None:
            return entry[0]
        made, pinned = build(), []
        for v in variables:
            try:
                weakref.finalize(v, self._entries.pop, key, None)
            except TypeError:  # no weak references: the entry keeps it, so its id stays its own
                pinned.append(v)
        self._entries[key] = (made, tuple(pinned))
        return made

    def __len__(self) -> int:
        return len(self._entries)
