"""Exceptions that the CLI turns into one clear line and exit code 2.

Every user-facing error of optmem derives from :class:`OptmemInputError`. Its
message names *where* the problem is (file, stage, field) and *what* was expected,
so that the CLI can print ``str(exc)`` alone, without a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class OptmemInputError(ValueError):
    """Bad input from the user: a malformed file, an unknown method, a bad option.

    Parameters
    ----------
    message
        What is wrong and what was expected.
    source
        The file (or other origin) the bad input came from, if any.
    stage
        1-based stage index the problem concerns, if any.
    field
        Name of the offending field, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        stage: int | None = None,
        field: str | None = None,
    ) -> None:
        self.source = source
        self.stage = stage
        self.field = field
        self.reason = message
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.source:
            where.append(str(self.source))
        if self.stage is not None:
            where.append(f"stage {self.stage}")
        if self.field:
            where.append(f"field '{self.field}'")
        prefix = ": ".join([", ".join(where)]) if where else ""
        return f"{prefix}: {self.reason}" if prefix else self.reason

    def with_source(self, source: str) -> OptmemInputError:
        """Return a copy of this error that names ``source`` as the origin."""
        return type(self)(self.reason, source=source, stage=self.stage, field=self.field)


class ChainError(OptmemInputError):
    """A chain file or chain dictionary does not follow ``optmem.chain/1``."""


class PlanError(OptmemInputError):
    """A plan is malformed or invalid when replayed by the simulator.

    Parameters
    ----------
    message
        Why the plan is invalid.
    index
        0-based index of the offending op in the plan, if known.
    field
        The plan file's field at fault (``unit``, ``problem``), if any.
    """

    def __init__(self, message: str, *, index: int | None = None, source: str | None = None,
                 field: str | None = None):
        self.index = index
        text = f"op {index}: {message}" if index is not None else message
        super().__init__(text, source=source, field=field)

    def with_source(self, source: str) -> PlanError:
        """Return a copy of this error that names ``source`` as the origin."""
        err = PlanError(self.reason, source=source, field=self.field)
        err.index = self.index
        return err


class UnavailableError(OptmemInputError):
    """An optional engine (HiGHS, CBC, CP-SAT, Gurobi, torch) is not installed."""


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (for "did you mean"), or ``None``."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return found[0] if found else None


def check_keywords(given: Iterable[str], known: Iterable[str], *, what: str,
                   elsewhere: dict[str, str] | None = None) -> None:
    """Raise one :class:`OptmemInputError` for the first name of ``given`` not in ``known``.

    The message names the unknown option, the closest known one and the known ones;
    ``elsewhere`` maps names that belong somewhere else to where (``{"time_limit_s":
    "a SolveOptions field"}``), so a misplaced or misspelt one is pointed there.

    Examples
    --------
    >>> check_keywords(["time_limt_s"], ["time_limit_s", "slots"], what="SolveOptions")
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: field 'time_limt_s': unknown option of SolveOptions; \
did you mean 'time_limit_s'? (known: slots, time_limit_s)
    """
    names = sorted(set(known))
    other = elsewhere or {}
    for name in given:
        if name in names:
            continue
        if name in other:  # not misspelt: misplaced ("did you mean" itself, until the audit)
            hint = f": {name!r} is {other[name]}"
        else:
            near = closest(name, names) or closest(name, other)
            hint = f"; did you mean {near!r}?" if near else ""
            if near in other and near not in names:
                hint += f" ({near!r} is {other[near]})"
        listed = ", ".join(names) if names else "none"
        raise OptmemInputError(f"unknown option of {what}{hint} (known: {listed})",
                               field=name)
