"""What a run could not do as configured but went on without (a tensor left float, an option
without effect, shapes onnx could not infer): one Notice each, logged at WARNING and listed in
the quantizer's summary, so that nothing degrades silently. One structure for every such case."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

NAMES_SHOWN = 8  # names per reason in one log or summary line; the summary JSON lists them all

Subject = Literal["tensor", "node", "model", "config", "unit"]  # "unit": a fine-tuning unit or layer


@dataclass(frozen=True)
class Notice:
    """One thing that is not as configured: its subject (a tensor, a node, the model, a config
    entry), the subject's name and the reason, in words a user can act on."""

    subject: Subject
    name: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        """The summary JSON entry: {"tensor": name, "reason": ...} (or "node", "model", "config")."""
        return {self.subject: self.name, "reason": self.reason}


def warn(logger: logging.Logger, notices: list[Notice] | None, new: Iterable[Notice]) -> None:
    """Log the notices not yet in `notices` at WARNING, one line per reason, and add them there
    (None: log only, for callers that keep no summary)."""
    fresh = list(dict.fromkeys(n for n in new if notices is None or n not in notices))
    for line in describe(n.as_dict() for n in fresh):
        logger.warning("%s", line)
    if notices is not None:
        notices.extend(fresh)


def describe(entries: Iterable[Mapping[str, str]]) -> list[str]:
    """Summary entries as readable lines, one per (subject, reason), naming its first subjects."""
    by_reason: dict[tuple[str, str], list[str]] = defaultdict(list)
    for entry in entries:
        subject = next(key for key in entry if key != "reason")
        by_reason[(subject, entry["reason"])].append(entry[subject])
    lines = []
    for (subject, reason), names in by_reason.items():
        shown = ", ".join(names[:NAMES_SHOWN]) + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")
        lines.append(f"{subject} {shown}: {reason}" if len(names) == 1 else f"{len(names)} {subject}s ({shown}): {reason}")
    return lines


class Warnings(list[dict[str, str]]):
    """What a fine-tuning run left out, kept back or undid: each logged at WARNING and kept as an
    entry {"unit": name, "reason": why} of its report's "warnings" list, so nothing degrades unseen."""

    def add(self, name: str, reason: str, subject: Subject = "unit") -> None:
        """Log one warning about a unit (or a layer; or another subject: a config key, the model)
        and keep it for the report, as the quantizer's summary keeps its notices."""
        notice = Notice(subject, name, reason)
        warn(_logger, None, [notice])
        self.append(notice.as_dict())


_logger = logging.getLogger(__name__)
