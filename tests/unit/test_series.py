"""``gateway.series``: the percentiles a histogram's bucket counts give, as Prometheus' ``histogram_quantile``."""

from __future__ import annotations

import math

import pytest

from gateway.series import _window, quantile

INF = math.inf


def test_a_quantile_is_interpolated_within_its_bucket():
    buckets = [(0.1, 10.0), (0.2, 30.0), (0.5, 40.0), (INF, 40.0)]  # 10 below 0.1, 20 in (0.1, 0.2], 10 in (0.2, 0.5]
    assert quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20: halfway through the second
    assert quantile(0.99, buckets) == pytest.approx(0.2 + 0.3 * (39.6 - 30) / 10)
    assert quantile(0.05, buckets) == pytest.approx(0.02)  # rank 2 of the first 10: the first bucket starts at 0


def test_past_the_last_finite_bound_the_answer_is_that_bound_and_nothing_counted_is_none():
    assert quantile(0.99, [(1.0, 5.0), (INF, 10.0)]) == 1.0
    assert quantile(0.5, [(1.0, 0.0), (INF, 0.0)]) is None
    assert quantile(0.5, []) is None


def test_a_window_is_the_difference_of_two_cumulative_readings():
    before = {0.1: 4.0, 0.2: 6.0, INF: 6.0}
    now = {0.1: 5.0, 0.2: 9.0, INF: 10.0}
    assert _window(now, before) == [(0.1, 1.0), (0.2, 3.0), (INF, 4.0)]
    assert _window(now, {}) == sorted(now.items())  # a histogram first seen this second
