"""Errors of the topology package: each names the source, the line, and what was expected."""

from __future__ import annotations


class TopologyParseError(ValueError):
    """A capture that cannot be read as a topology; the message names the line and what was expected."""

    def __init__(self, message: str, line: int | None = None, source: str = "<text>") -> None:
        self.line = line
        self.source = source
        where = f"{source}: line {line}: " if line is not None else f"{source}: "
        super().__init__(where + message)


class NotATopologyMatrix(TopologyParseError):
    """The text is another tool's output (nvlink -s/-R, an NCCL XML dump, nccl-tests ...)."""

    def __init__(self, message: str, looks_like: str, line: int | None = None, source: str = "<text>") -> None:
        self.looks_like = looks_like
        super().__init__(message, line=line, source=source)
