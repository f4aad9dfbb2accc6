"""``Value``: a base for small read-only records built on hot paths.

Frozen dataclasses would do, but the simulator builds several such records per
request and the compiled build (mypyc, ``scripts/build_compiled.py``) runs a
dataclass's generated ``__init__`` as interpreted code. Subclasses are plain classes
that list their fields once, in constructor order, in ``_FIELDS`` (``__slots__ =
_FIELDS``), assign them in ``__init__`` as ``Final`` (mypy rejects later writes) and
get equality, hashing, ``repr`` and copy/pickle support from here.
"""

from __future__ import annotations

from typing import ClassVar, Self

__all__ = ["Value"]


class Value:
    """Equality, hash, repr and pickling from the fields named in ``_FIELDS``."""

    __slots__ = ()
    _FIELDS: ClassVar[tuple[str, ...]] = ()  # (mypyc classes have no __slots__ at run time)

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Value)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __reduce__(self) -> tuple[type[Value], tuple[object, ...]]:
        # copy and pickle through the constructor (its parameters follow _FIELDS): a
        # compiled class has no instance __dict__ for the default protocol to restore
        return (type(self), self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._FIELDS)
        return f"{type(self).__name__}({fields})"

    def replaced(self, **changes: object) -> Self:
        """A copy with some fields changed (``dataclasses.replace`` for these classes);
        unknown names raise ``TypeError``."""
        unknown = set(changes) - set(self._FIELDS)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}")
        values = [changes.get(n, v) for n, v in zip(self._FIELDS, self._values(), strict=True)]
        return type(self)(*values)
