"""Where a GPU run's host and device are at its steps: a timeline without a profiler (``info["timeline_ms"]``)."""

from __future__ import annotations

import time

import torch


class Timeline:
    """Where a run's host and device are at its steps, if ``enabled``: ``mark(step)`` notes the host's time and,
    on a GPU, records an event on the device's current stream; ``milliseconds()`` (after the final
    synchronisation) gives [step, host ms, device ms] from the start, the device's being when it reached the
    step's event. Each mark costs the host an event's creation and record, so nothing is marked unless asked."""

    def __init__(self, device, enabled=True):
        self.device, self.enabled, self.started, self.steps = device, enabled, time.perf_counter(), []
        self.start_event = self._event() if enabled else None

    def _event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self, step, event=None):
        """``event``: instead of one recorded on the current stream now (another stream's, timing enabled)."""
        if self.enabled:
            self.steps.append((step, time.perf_counter(), event or self._event()))

    def note(self, step, at):
        """A step of the host alone (another thread's), at ``at`` (``time.perf_counter()``)."""
        if self.enabled:
            self.steps.append((step, at, None))

    def milliseconds(self):
        return [[step, round((at - self.started) * 1e3, 3),
                 round(self.start_event.elapsed_time(event), 3) if event is not None else None]
                for step, at, event in sorted(self.steps, key=lambda step: step[1])]
