"""Where per-backend state lives: the declared seam between the pure state machines and the processes.

A state machine of this package (the circuit breaker) or of the transport (endpoint ejection) keeps
its whole state in a ``Cell``: one immutable *word* (a small named tuple) that it reads with
``read`` and replaces with ``update``, which applies a pure ``change`` atomically. The machines do
their own arithmetic; a cell only stores words.

In one process a cell is a ``LocalCell``: an attribute. With ``--workers N`` the server gives the
machines cells from a ``CellStore`` whose words live in a table every worker maps
(``gateway.server.shared_state``): the machines run the same code, and every worker acts on the
same word, so a circuit opened in one worker is open in all.

What a cell guarantees, and the machines rely on:

- ``read()`` returns the word stored by the last completed ``update`` (in any process that shares
  the cell), never a mix of two words;
- ``update(change)`` calls ``change(word)`` exactly once with the current word and stores the word
  it returns before any other update of the cell (in any process) begins; ``change`` must be pure
  and quick (it may run under a lock other processes wait on), and returns ``(word, result)``;
  ``update`` returns ``result``. Returning the very word it was given means "no change": nothing is
  written.

A ``CellStore`` hands out the cells of keys: ``attach`` (``None`` when it has no room: the caller
keeps a ``LocalCell``, its state then per process) and ``release`` when the key is no longer used.

A count that changes on every call (a bulkhead's calls in flight) is not a word behind a lock: it
is a ``Counter``, to which each process adds its own share and whose ``total`` is the sum of all
shares (``LocalCounter`` in one process). Two processes that read the total at the same instant
may both act on it, so a limit checked against it can be passed by at most one per other process.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

W = TypeVar("W")
R = TypeVar("R")

StateKey = tuple[Hashable, ...]  # what a state belongs to: a backend, an endpoint of a service


class Cell(Protocol[W]):
    """One word of state (see the module docstring for the guarantees)."""

    def read(self) -> W: ...

    def update(self, change: Callable[[W], tuple[W, R]]) -> R: ...


class LocalCell(Generic[W]):
    """A cell of this process only."""

    __slots__ = ("word",)

    def __init__(self, word: W) -> None:
        self.word = word

    def read(self) -> W:
        return self.word

    def update(self, change: Callable[[W], tuple[W, R]]) -> R:
        self.word, result = change(self.word)
        return result


class Counter(Protocol):
    """A count kept in shares: ``add`` changes this process's share, ``total`` sums every share."""

    def total(self) -> int: ...

    def add(self, delta: int) -> None: ...


class LocalCounter:
    """A counter of this process only."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def total(self) -> int:
        return self.value

    def add(self, delta: int) -> None:
        self.value += delta


class CounterStore(Protocol):
    """Counters by key, shared with other processes (``gateway.server.shared_state``)."""

    def attach(self, key: StateKey) -> Counter | None:
        """The counter of ``key`` (the same one again while attached); None when the store is full."""
        ...

    def release(self, key: StateKey) -> None:
        """``key`` is no longer used here: this process's share is dropped (its calls in flight
        then settle in the detached counter)."""
        ...


class CellStore(Protocol[W]):
    """Cells by key, shared with other processes (``gateway.server.shared_state``)."""

    def attach(self, key: StateKey) -> Cell[W] | None:
        """The cell of ``key`` (the same one again while attached); None when the store is full."""
        ...

    def release(self, key: StateKey) -> None:
        """``key`` is no longer used here; its state is dropped once no process uses it."""
        ...
