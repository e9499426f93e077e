"""ProgramStateGroup: the states `s.fork(n)` returns, appended to together and joined back."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loom.interpreter import _GatherJoin
from loom.ir import SglConcateAndAppend, SglExpr, as_expr

if TYPE_CHECKING:  # annotations only: state.py imports this module to fork
    from loom.state import ProgramState


class ProgramStateGroup:
    def __init__(self, states: list[ProgramState], src_state: ProgramState):
        self.states = states
        self.src_state = src_state

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if self.states[i] is not value:  # `forks[i] += x` rebinds the same state
            raise ValueError("a fork group's states cannot be replaced")

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        """`forks += expr` (each state), `+= lambda i: ...` (state i), `+= [e0, e1, ...]`."""
        if isinstance(other, (SglExpr, str)):
            for s in self.states:
                s += as_expr(other)
        elif isinstance(other, Callable):
            for i, s in enumerate(self.states):
                s += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forks")
            for s, e in zip(self.states, other):
                s += e
        else:
            raise TypeError(f"cannot append {type(other).__name__} to a fork group")
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Merge the forks back: `gather_variable` turns each variable the forks created into
        a list on the source state; `concate_and_append` appends each fork's new text."""
        children = [s.stream_executor for s in self.states]
        for child in children:
            child.end()
        src = self.src_state.stream_executor
        if mode == "gather_variable":
            src.submit(_GatherJoin(children))
        elif mode == "concate_and_append":
            src.submit(SglConcateAndAppend(self.states))
        else:
            raise ValueError(
                f"join: mode must be gather_variable or concate_and_append, got {mode!r}"
            )
