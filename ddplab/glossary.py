"""ddplab's words, each written once with what it means.

Every word a verdict, a status or a classification can be is a member of
one of these string enums: :class:`VerdictKind` (what a case or a
comparison concludes), :class:`RunStatus` (how a compared configuration's
run ended), :class:`NotebookStatus` (how a notebook of ``ddplab report``
ended) and :class:`ReductionLabel` (what the referee says of one reduced
tensor). A member is a ``str`` (``VerdictKind.BUG == "bug"``) and prints as
one, so records, JSON and printed values hold the plain word;
``member.meaning`` is the one sentence the README and the pages print beside it.

Example::

    >>> VerdictKind("by design") is VerdictKind.BY_DESIGN, VerdictKind.BUG == "bug"
    (True, True)
    >>> NotebookStatus.TIMED_OUT.css
    'timed-out'
"""
from __future__ import annotations

import enum

__all__ = ["Term", "VerdictKind", "RunStatus", "NotebookStatus", "ReductionLabel", "markdown_table"]


class Term(enum.StrEnum):
    """A word with its meaning: members are written ``NAME = "word", "one sentence"``."""

    def __new__(cls, value: str, meaning: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    def __repr__(self) -> str:
        # Printed as the plain word, so that a dict or tuple holding one reads as it did as a str.
        return repr(self.value)

    @property
    def css(self) -> str:
        """The word as a CSS class name (spaces become dashes)."""
        return self.value.replace(" ", "-")

    @classmethod
    def parse(cls, word: str) -> "Term":
        """The member called ``word``; ValueError naming every word of the vocabulary otherwise."""
        try:
            return cls(word)
        except ValueError:
            raise ValueError(f"{word!r} is not a {cls.__name__}: one of "
                             f"{', '.join(repr(m.value) for m in cls)}") from None


class VerdictKind(Term):
    """What a verdict concludes about the reported behaviour (a case's or a compared configuration's)."""

    EXACT = ("exact", "The run equals ddplab's bit-exact model of what it promises, in every bit, so any "
                      "difference from one process is provably the rounding of the split.")
    ROUNDING = ("rounding", "The differences are what rounding gives: equal to an emulated order, "
                            "within the rigorous bound, or within the tolerance band.")
    APPROXIMATION = ("approximation", "The differences come from a lossy step the configuration declares "
                                      "or ddplab recognizes (PowerSGD, a gradient rounded on purpose); its "
                                      "size is reported, it is never rounding, and no evidence shows a bug.")
    BUG = ("bug", "Rounding cannot explain the differences: the computation is not the one it promises.")
    BY_DESIGN = ("by design", "The behaviour differs from what the report expected, and it is what the "
                              "library documents and intends.")
    UNDETERMINED = ("undetermined", "The measurements cannot decide between rounding and a bug: they "
                                    "are reported, not judged.")
    UNEXPLAINED = ("unexplained", "The reported behaviour was reproduced, but none of the explanations "
                                  "checked accounts for all of it.")
    CRASHED = ("crashed", "A rank raised or died before the last step; the steps it finished are still "
                          "judged.")
    HUNG = ("hung", "The launch ran past its timeout and was stopped; the steps it finished are still "
                    "judged.")
    STOPPED = ("stopped", "A stop request ended the run before its last step.")
    NOT_RUN = ("not run", "A stop request came before this run started.")
    UNAVAILABLE = ("unavailable", "This run cannot happen on this machine (a library or backend is "
                                  "missing), and the verdict says which.")


class RunStatus(Term):
    """How one compared configuration's launch ended (its ``steps_completed`` record's ``status``)."""

    COMPLETED = ("completed", "Every rank finished every step.")
    CRASHED = ("crashed", "A rank raised or died; the steps before it are kept.")
    HUNG = ("hung", "The launch ran past its timeout and its ranks were killed.")
    STOPPED = ("stopped", "A stop request ended the launch.")
    NOT_RUN = ("not run", "A stop request came before the launch started.")
    UNAVAILABLE = ("unavailable", "The configuration cannot run here (a library or backend is missing).")


class NotebookStatus(Term):
    """How one case's notebook ended in ``ddplab report``."""

    OK = ("ok", "Every cell ran and the report was published.")
    FAILED = ("failed", "A cell raised, or the case's files could not be written; the report says "
                        "which and why.")
    TIMED_OUT = ("timed out", "The notebook ran past --timeout and its whole process tree was killed.")
    KERNEL_DIED = ("kernel died", "The notebook's kernel process died (killed, out of memory or a "
                                  "crash in native code).")
    INTERRUPTED = ("interrupted", "SIGINT, SIGTERM or SIGHUP stopped the batch while the notebook ran.")


class ReductionLabel(Term):
    """The referee's classification of one reduced tensor (:func:`ddplab.numerics.measure`)."""

    ROUNDING = ("rounding", "What rounding in the stated order gives: equal to its bit-exact emulation, "
                            "or within its rigorous bound.")
    NOT_ROUNDING = ("not rounding", "Rounding in that order cannot give it (a bit differs from the "
                                    "bit-exact emulation, or an error exceeds the bound): a bug.")
    UNDETERMINED = ("undetermined", "Neither a bit-exact model nor a finite bound exists: measured, "
                                    "not judged.")
    OVERFLOW = ("overflow", "The dtype's range was exceeded; overflow_matches_order says whether the "
                            "order overflows the same way (then it is legal IEEE arithmetic).")


def markdown_table(vocabulary: type[Term], heading: str = "word") -> str:
    """``| word | meaning |`` for every member, in declaration order (the README prints these)."""
    rows = [f"| {heading} | meaning |", "|---|---|"]
    rows += [f"| `{term.value}` | {term.meaning} |" for term in vocabulary]
    return "\n".join(rows) + "\n"
