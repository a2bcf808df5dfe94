"""The every-N latch: one rule, the same on the host and in a traced step."""

import numpy as np
import pytest
import tensorflow as tf

from tb_numerics import latch

pytestmark = pytest.mark.unit


NAN, POSINF, NEGINF = (latch.KIND_BITS[k] for k in ("nan", "posinf", "neginf"))


def _kinds(bad):
    """A record's kinds mask: a bool (True: a NaN) or a mask."""
    return (NAN if bad else latch.NO_KINDS) if isinstance(bad, bool) else bad


def run_host(steps, bad, every_n):
    """The decisions of a sequence of records, on the host."""
    prev, seen, out = latch.NO_PREVIOUS_STEP, latch.NO_KINDS, []
    for step, kinds in zip(steps, bad):
        d = latch.decide(step, prev, _kinds(kinds), seen, every_n)
        out.append((bool(d.write_now), bool(d.write_prev)))
        prev, seen = step, d.seen
    return out


def run_graph(steps, bad, every_n):
    """The same in a tf.function, with its state in variables."""
    prev = tf.Variable(np.int64(latch.NO_PREVIOUS_STEP))
    seen = tf.Variable(np.int64(latch.NO_KINDS))

    @tf.function
    def one(step, kinds):
        d = latch.decide(step, prev.read_value(), kinds, seen.read_value(), every_n)
        prev.assign(step)
        seen.assign(d.seen)
        return tf.stack([d.write_now, d.write_prev])

    return [tuple(one(tf.constant(s, tf.int64), tf.constant(_kinds(b), tf.int64)).numpy().tolist())
            for s, b in zip(steps, bad)]


def written(steps, decisions):
    """The steps written, in order (a previous record before the current one)."""
    out = []
    for i, (now, prev) in enumerate(decisions):
        if prev:
            out.append(steps[i - 1])
        if now:
            out.append(steps[i])
    return out


def test_every_nth_step_the_first_bad_step_and_the_one_before():
    steps = list(range(20))
    bad = [s >= 13 for s in steps]
    assert written(steps, run_host(steps, bad, 5)) == [0, 5, 10, 12, 13, 15]


def test_the_step_before_is_not_written_twice():
    steps = list(range(12))
    bad = [s == 11 for s in steps]  # the step before, 10, is a multiple of 5
    assert written(steps, run_host(steps, bad, 5)) == [0, 5, 10, 11]


def test_an_earlier_record_of_the_same_step_counts_as_the_one_before():
    steps = [0, 1, 1, 2]  # a tag logged twice at step 1 (micro-batches)
    bad = [False, False, True, False]
    assert run_host(steps, bad, 5) == [(True, False), (False, False), (True, True), (False, False)]


def test_steps_going_back_do_not_write_a_later_step_as_the_one_before():
    steps = [7, 3]  # a restarted loop
    assert run_host(steps, [False, True], 5) == [(False, False), (True, False)]


def test_a_new_kind_of_nonfinite_value_is_written_whatever_n():
    # -Inf every step (intended, but only the reader knows), a NaN at 13, +Inf at 17, a NaN again at 18.
    steps = list(range(20))
    kinds = [NEGINF | (NAN if s in (13, 18) else 0) | (POSINF if s == 17 else 0) for s in steps]
    assert written(steps, run_host(steps, kinds, 5)) == [0, 5, 10, 12, 13, 15, 16, 17]
    assert run_host(steps, kinds, 5) == run_graph(steps, kinds, 5)


def test_kinds_of_host_records():
    assert latch.kinds([0, 0], [0, 0], [0, 0]) == latch.NO_KINDS
    assert latch.kinds([0, 2], [0, 0], [1, 0]) == NAN | NEGINF
    # An intended -Inf is left out, per record.
    assert latch.kinds([0, 0], [0, 0], [1, 3], neginf_ok=[True, True]) == latch.NO_KINDS
    assert latch.kinds([0, 0], [1, 0], [1, 3], neginf_ok=[True, False]) == POSINF | NEGINF


def test_python_and_numpy_arguments_agree():
    d = latch.decide(6, 4, latch.NO_KINDS, NAN, 5)
    assert (bool(d.write_now), bool(d.write_prev), int(d.seen)) == (False, False, NAN)
    d = latch.decide(np.int64(6), np.int64(4), np.int64(NAN), np.int64(latch.NO_KINDS), 5)
    assert (bool(d.write_now), bool(d.write_prev), int(d.seen)) == (True, True, NAN)


@pytest.mark.parametrize("every_n", [1, 3, 7])
def test_host_and_graph_decide_the_same(every_n):
    rng = np.random.default_rng(every_n)
    # Rising steps with gaps and repeats, a restart, sparse non-finite records.
    steps = np.cumsum(rng.integers(0, 3, 60)).tolist()
    steps[40:] = [s - 25 for s in steps[40:]]
    bad = (rng.random(60) < 0.08).tolist()
    host = run_host(steps, bad, every_n)
    assert host == run_graph(steps, bad, every_n)
    # Whatever N, the first non-finite record is written.
    assert host[bad.index(True)][0]
