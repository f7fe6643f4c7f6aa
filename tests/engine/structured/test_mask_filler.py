"""The mask filler's deadline (engine.structured.mask_filler), issue 64 item 3: one row whose
fill runs past the deadline is given up (reported, its request ends) while every other row of
the step is filled exactly; the engine waits at most about one deadline per slow row, the
stuck worker is replaced, and a fill that never ends holds neither later steps nor the exit."""

from __future__ import annotations

import threading
import time

import pytest

from engine.structured.mask_filler import MaskFiller


def _unit(out: list, value, delay: float = 0.0, failure: str | None = None,
          release: threading.Event | None = None):
    def run():
        if release is not None:
            release.wait(30)
        if delay:
            time.sleep(delay)
        out.append(value)
        return value, failure
    return run


def test_every_row_fills_when_none_is_slow():
    filler = MaskFiller(deadline=5.0)
    out: list = []
    job = filler.submit([_unit(out, i) for i in range(4)])
    assert job.wait() == {} and job.values == [0, 1, 2, 3] and sorted(out) == [0, 1, 2, 3]
    assert filler.given_up == 0
    filler.close()


def test_a_row_past_the_deadline_is_given_up_and_the_rest_still_fill():
    filler = MaskFiller(deadline=0.3)
    out: list = []
    hang = threading.Event()  # row 1 never finishes until the test releases it
    job = filler.submit([_unit(out, 0), _unit(out, 1, release=hang), _unit(out, 2),
                         _unit(out, 3, failure="nothing allowed")])
    failures = job.wait()
    assert sorted(failures) == [1, 3]
    assert failures[1].timed_out and "longer than 0.3 s" in failures[1].reason
    assert not failures[3].timed_out and failures[3].reason == "nothing allowed"
    assert job.values[0] == 0 and job.values[2] == 2
    assert filler.given_up == 1
    # the next step runs on a fresh worker: the stuck one still holds row 1
    job2 = filler.submit([_unit(out, 10)])
    assert job2.wait() == {} and job2.values == [10]
    hang.set()  # the stuck fill ends into a row nobody reads; its value goes nowhere
    time.sleep(0.1)
    assert job.values[1] is None and job.failures[1].timed_out
    filler.close()


def test_two_slow_rows_are_each_given_their_own_deadline():
    filler = MaskFiller(deadline=0.2)
    out: list = []
    hang = threading.Event()
    job = filler.submit([_unit(out, 0, release=hang), _unit(out, 1, release=hang),
                         _unit(out, 2)])
    failures = job.wait()
    assert sorted(failures) == [0, 1] and job.values[2] == 2 and filler.given_up == 2
    hang.set()
    filler.close()


def test_an_exception_in_a_fill_fails_that_row_only():
    filler = MaskFiller(deadline=5.0)

    def boom():
        raise RuntimeError("library error")
    out: list = []
    job = filler.submit([boom, _unit(out, 1)])
    failures = job.wait()
    assert list(failures) == [0] and "library error" in failures[0].reason
    assert job.values[1] == 1
    filler.close()


def test_the_deadline_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        MaskFiller(deadline=0)


def test_workers_are_daemon_threads():
    filler = MaskFiller(deadline=0.1)
    hang = threading.Event()
    filler.submit([_unit([], 0, release=hang)]).wait()
    assert all(t.daemon for t in threading.enumerate() if t.name == "kvserve-grammar-mask")
    hang.set()
    filler.close()
