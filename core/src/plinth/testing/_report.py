"""The result every conformance check returns (or raises)."""

from __future__ import annotations

from dataclasses import dataclass, field


class ConformanceError(AssertionError):
    """A plugin broke the contract; the message lists every problem found.

    An ``AssertionError``, so pytest shows it as a test failure with the text;
    ``report`` is the whole ``Report`` (what passed and was skipped too).
    """

    report: Report | None = None


@dataclass
class Report:
    """What one conformance check looked at.

    subject:  what was checked ("distribution plinth-plugin-cpu", "accelerator cpu")
    passed:   one line per check that held
    skipped:  one line per check that could not run here, with why
    problems: one line per broken rule; ``raise_for_problems`` turns them into
              a ``ConformanceError``
    """

    subject: str
    passed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def ok(self, what: str) -> None:
        self.passed.append(what)

    def skip(self, what: str) -> None:
        self.skipped.append(what)

    def problem(self, what: str) -> None:
        self.problems.append(what)

    def expect(self, condition: bool, what: str, why: str = "") -> bool:
        """Record ``what`` as passed when condition holds, else as a problem."""
        if condition:
            self.ok(what)
        else:
            self.problem(f"{what}: {why}" if why else what)
        return condition

    def raise_for_problems(self) -> Report:
        if self.problems:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            error = ConformanceError(f"{self.subject} does not conform to the plinth plugin contract:\n{lines}")
            error.report = self
            raise error
        return self

    def __str__(self) -> str:
        out = [f"{self.subject}: {len(self.passed)} passed, {len(self.skipped)} skipped, {len(self.problems)} problems"]
        out += [f"  ok    {p}" for p in self.passed]
        out += [f"  skip  {p}" for p in self.skipped]
        out += [f"  FAIL  {p}" for p in self.problems]
        return "\n".join(out)
