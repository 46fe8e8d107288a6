"""A registry of named implementations (tool-call parsers, reasoning parsers, and what comes next:
grammar engines, stores, attention backends): the choice is made once at start-up by name, and a
wrong name is answered with the list of right ones."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, type[T]], Generic[T]):
    """Classes by their ``name`` attribute; ``create(name)`` builds one."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "tool-call parser": how errors name what was asked for
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: add ``cls`` under ``cls.name``."""
        name = cls.name
        if name in self._classes:
            raise ValueError(f"a {self.kind} named {name!r} is registered already")
        self._classes[name] = cls
        return cls

    def names(self) -> str:
        return ", ".join(sorted(self._classes))

    def create(self, name: str) -> T:
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of: {self.names()}")
        return cls()

    def __getitem__(self, name: str) -> type[T]:
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)
