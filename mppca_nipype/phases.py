"""Where a command's time goes: the seconds of each named phase, in order, for ``--timings`` and the
provenance.

``Phases`` times blocks of a command (``with phases("read"): ...``) and takes the engine's own phases
(``DenoiseResult.info["seconds"]``) as the parts of one (``parts_of``); ``process_age`` says how long the
process ran before the command's first line (the interpreter's start and the imports), which a command
gives as ``Phases(start_up=...)``. ``parse_line`` reads ``Phases.line()`` back (what a benchmark timing the
command from outside does with its ``--timings`` line).
"""

from __future__ import annotations

from contextlib import contextmanager
import os
import re
import time


class Phases:
    """Seconds by phase, in the order they were first entered; a phase may hold its parts (``parts_of``).
    ``start_up``: the seconds before this object was made, the first phase (None: not known, not shown)."""

    def __init__(self, start_up=None):
        self.seconds, self.parts = {}, {}
        self.started = time.perf_counter() - (start_up or 0.0)
        if start_up is not None:
            self.seconds["start-up"] = start_up

    @contextmanager
    def __call__(self, name):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name, seconds):
        """``seconds`` more in phase ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def parts_of(self, name, parts):
        """{part: seconds} within phase ``name`` (the engine's, say)."""
        self.parts[name] = dict(parts)

    def as_dict(self) -> dict:
        """{phase: seconds} rounded to the ms, with a phase's parts as {phase: {"seconds", "parts"}}, and
        the total since the start (start-up included)."""
        timings = {}
        for name, seconds in self.seconds.items():
            if name in self.parts:
                timings[name] = dict(seconds=round(seconds, 3),
                                     parts={part: round(s, 3) for part, s in self.parts[name].items()})
            else:
                timings[name] = round(seconds, 3)
        timings["total"] = round(time.perf_counter() - self.started, 3)
        return timings

    def line(self) -> str:
        """'start-up 1.82 s, read 0.69 s, denoise 2.31 s (plan 0.02, backend 2.10, ...), write 0.58 s; total
        5.41 s'."""
        shown = []
        for name, seconds in self.seconds.items():
            text = f"{name} {seconds:.2f} s"
            if name in self.parts:
                text += " (" + ", ".join(f"{part} {s:.2f}" for part, s in self.parts[name].items()) + ")"
            shown.append(text)
        return ", ".join(shown) + f"; total {self.as_dict()['total']:.2f} s"


#: One phase of ``Phases.line()``: "read 0.69 s" or "denoise 2.31 s (plan 0.02, backend 2.10)".
_PHASE = re.compile(r"(?P<name>[^,;() ][^,;()]*?) (?P<seconds>\d+(?:\.\d+)?) s(?: \((?P<parts>[^()]*)\))?")


def parse_line(text: str) -> dict:
    """``Phases.line()`` read back, as ``Phases.as_dict()`` gives it (to the line's precision): {phase:
    seconds, or {"seconds", "parts": {part: seconds}}, ..., "total": seconds}. ``text`` may carry a prefix
    ending in ': ' ("mppca-denoise: timings: start-up 1.82 s, ..."). Raises ValueError on anything else."""
    body = text.strip().rsplit(": ", 1)[-1]
    phases_text, separator, total = body.rpartition("; total ")
    if not separator or not total.endswith(" s"):
        raise ValueError(f"not a timings line: {text!r}")
    timings, position = {}, 0
    for match in _PHASE.finditer(phases_text):
        if phases_text[position:match.start()] not in ("", ", "):
            raise ValueError(f"not a timings line: {text!r}")
        seconds = float(match["seconds"])
        if match["parts"] is None:
            timings[match["name"]] = seconds
        else:
            parts = {}
            for part in match["parts"].split(", "):
                name, _, value = part.rpartition(" ")
                parts[name] = float(value)
            timings[match["name"]] = dict(seconds=seconds, parts=parts)
        position = match.end()
    if position != len(phases_text):
        raise ValueError(f"not a timings line: {text!r}")
    timings["total"] = float(total[:-2])
    return timings


def process_age() -> float | None:
    """Seconds since this process started (Linux: its start in /proc/self/stat against the machine's
    uptime), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
        return max(0.0, up - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, IndexError, ValueError):
        return None
