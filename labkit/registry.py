"""A registry: the one place a family of interchangeable parts (strategies, compressors) is listed.

Each part is declared once, in its own module, with everything labkit needs to know about it —
its name, the config keys it reads, what it combines with, its checks and its analytic facts —
and registers itself::

    STRATEGIES = Registry("parallel.dp.strategy", what="parallel.dp.strategy")

    @STRATEGIES.register
    class Zero2(Strategy):
        name, order, zero_stage = "zero2", 50, 2

        @classmethod
        def problems(cls, cfg, world: int) -> list[str]: ...

Everything that lists or checks the family reads the registry: the config's allowed values, the
widgets' option lists, the memory and wire-volume tables, validation. So adding a part is one new
module (every module of the family's package is imported, see :func:`import_submodules`) plus its
test; nothing else changes.

An entry is any object with a ``name`` (a class, usually), optionally an ``order`` (its place in
option lists; lower first, then registration order) and a ``problems(cfg, world)`` returning what
is wrong with a config, one sentence per problem. :meth:`Registry.problems` asks *every* entry, not
only the chosen one: an entry checks the config keys it reads whether or not it is selected (as
validation always did), and checks that concern its selection start with ``if registry.chosen(cfg)
== cls.name``. Entries that share a key report the same sentence once.

This module knows nothing of labkit's config and imports nothing from labkit.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping, Generic[T]):
    """Name → entry, in option-list order. A read-only mapping; :meth:`register` adds to it.

    ``key`` is the dotted config key that selects an entry (``parallel.dp.strategy``); ``what``
    names the family in error messages and ``choices`` introduces the list of names there.
    """

    def __init__(self, key: str, what: str | None = None, choices: str = "choose one of"):
        self.key, self.what, self.choices = key, what or key, choices
        self._entries: dict[str, T] = {}

    # -- declaring -----------------------------------------------------------------------------
    def register(self, entry: T) -> T:
        """Add ``entry`` under ``entry.name`` (use as a class decorator). A name is registered once."""
        name = getattr(entry, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what}: an entry needs a non-empty string 'name', got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what}: {name!r} is already registered ({self._entries[name]!r})")
        self._entries[name] = entry
        order = {n: (getattr(e, "order", float("inf")), i) for i, (n, e) in enumerate(self._entries.items())}
        self._entries = dict(sorted(self._entries.items(), key=lambda item: order[item[0]]))
        return entry

    def unregister(self, name: str) -> T:
        """Remove ``name`` again (tests that register a toy entry clean up with this)."""
        return self._entries.pop(name)

    # -- reading -------------------------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def get(self, name: str) -> T:  # type: ignore[override]
        """The entry called ``name``; a ``ValueError`` listing the choices (and the nearest) if none is."""
        if name not in self._entries:
            near = difflib.get_close_matches(str(name), self._entries, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown {self.what} {name!r}; {self.choices}: {', '.join(self._entries)}{hint}")
        return self._entries[name]

    def chosen(self, cfg: Any) -> Any:
        """The value of this registry's config key in ``cfg`` (a name, or an off value such as "every_step")."""
        node = cfg
        for part in self.key.split("."):
            node = getattr(node, part)
        return node

    def problems(self, cfg: Any, world: int) -> list[str]:
        """Every entry's ``problems(cfg, world)``, in order, each sentence once."""
        found: list[str] = []
        for entry in self._entries.values():
            check = getattr(entry, "problems", None)
            found += check(cfg, world) if check is not None else []
        return list(dict.fromkeys(found))

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.key!r}: {', '.join(self._entries)})"


def import_submodules(package_name: str, package_path) -> None:
    """Import every public module of a package, so each registers what it declares.

    Call it at the end of the package's ``__init__`` as ``import_submodules(__name__, __path__)``:
    a new module is then picked up without editing any list.
    """
    for module in pkgutil.iter_modules(package_path):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package_name}.{module.name}")
