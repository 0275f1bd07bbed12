"""Argo's duration strings and retry backoff (pipelines/durations.py), which the local executor runs by and the
simulator models the run's retries with."""

from __future__ import annotations

import pytest

from pipelines.durations import backoff_seconds, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10", 10.0), (10, 10.0), ("1m", 60.0), ("1h30m", 5400.0), ("2.5s", 2.5), ("300ms", 0.3), ("0", 0.0)],
)
def test_argo_duration_strings(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_a_bad_duration_names_the_forms_that_work():
    with pytest.raises(ValueError, match="unable to parse 1 minute as a duration"):
        parse_duration("1 minute")


def test_backoff_grows_by_factor_up_to_the_cap():
    backoff = {"duration": "1", "factor": "2", "cap": "5"}
    assert [backoff_seconds(backoff, n) for n in range(1, 7)] == [1, 2, 4, 5, 5, 5]
    assert backoff_seconds({"duration": "30s"}, 4) == 30
