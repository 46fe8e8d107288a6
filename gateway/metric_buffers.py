"""Buffers in front of prometheus_client metrics (``gateway.metrics`` explains why): each adds up what a gateway
records in plain numbers of this process, and ``flush`` adds it to its metric in bulk."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Labels = tuple[object, ...]  # label values in the metric's label order; str() is applied when flushed


class BufferedCounter:
    """A Counter's increments, summed per label tuple until ``flush`` adds them to it."""

    __slots__ = ("metric", "_pending")

    def __init__(self, metric: Counter):
        self.metric = metric
        self._pending: dict[Labels, float] = {}

    def inc(self, amount: float = 1, labels: Labels = ()) -> None:
        pending = self._pending
        pending[labels] = pending.get(labels, 0) + amount

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for labels, amount in pending.items():
            (self.metric.labels(*labels) if labels else self.metric).inc(amount)


class BufferedHistogram:
    """A Histogram's observations, as bucket counts and a sum per label tuple until ``flush`` adds them to it."""

    __slots__ = ("metric", "_bounds", "_pending")

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry | None):
        self.metric = Histogram(name, documentation, labelnames, buckets=buckets, registry=registry)
        self._bounds = [float(b) for b in buckets]
        if self._bounds[-1] != math.inf:
            self._bounds.append(math.inf)
        self._pending: dict[Labels, list[float]] = {}

    def observe(self, amount: float, labels: Labels = (), n: int = 1) -> None:
        """Observe ``amount`` ``n`` times."""
        acc = self._pending.get(labels)
        if acc is None:
            acc = self._pending[labels] = [0] * len(self._bounds) + [0.0]  # bucket counts (not cumulative), sum
        acc[bisect_left(self._bounds, amount)] += n  # the first bucket with amount <= bound, as observe() picks
        acc[-1] += amount * n

    @property
    def bounds(self) -> list[float]:
        """The buckets' upper bounds, +Inf last: ``add`` takes one count per bound."""
        return self._bounds

    def add(self, counts: Sequence[int], total: float, labels: Labels = ()) -> None:
        """Observations counted already: ``counts[i]`` of them in bucket ``i`` (the first bound not below them,
        as ``observe`` files one: ``bisect_left(bounds, value)``), adding up to ``total``."""
        acc = self._pending.get(labels)
        if acc is None:
            acc = self._pending[labels] = [0] * len(self._bounds) + [0.0]
        for i, count in enumerate(counts):
            acc[i] += count
        acc[-1] += total

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for labels, acc in pending.items():
            child = self.metric.labels(*labels) if labels else self.metric
            # prometheus_client has no public bulk observe(): add to the values observe() adds to, one per
            # bucket (not cumulative) and the sum (tests/unit/test_metrics_recorder.py pins this).
            for value, count in zip(child._buckets, acc):
                if count:
                    value.inc(count)
            child._sum.inc(acc[-1])


class BufferedGauge:
    """A (livesum) Gauge's net change until ``flush`` adds it."""

    __slots__ = ("metric", "_pending")

    def __init__(self, metric: Gauge):
        self.metric = metric
        self._pending = 0.0

    def inc(self, amount: float = 1) -> None:
        self._pending += amount

    def dec(self, amount: float = 1) -> None:
        self._pending -= amount

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, 0.0
            self.metric.inc(pending)
