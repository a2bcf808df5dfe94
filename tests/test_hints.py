"""The hint an op's family gives, where the op's own evidence bears it out (``tb_numerics.hints``)."""

import pytest

from tb_numerics import hints, metadata

pytestmark = pytest.mark.unit

_POW = "pow of a negative base"


def _pow_evidence(inputs: list, output: dict) -> hints.Evidence:
    op = {"name": "bn/pow", "type": "pow", "source": "model.py:3 (call)", "phase": "forward", "inputs": inputs}
    return hints.Evidence("bn/output", metadata.TensorInfo(role="activation"), 7, {}, op=op, op_output=output)


def _input(zeros: int, lo: float, hi: float) -> dict:
    return {"shape": [4], "count": 4, "min": lo, "max": hi, "zeros": zeros, "nan": 0, "posinf": 0, "neginf": 0}


@pytest.mark.parametrize("inputs, output, named", [
    # x ** -1 at x = 0: Inf from a zero base.
    ([_input(1, 0.0, 2.0)], {"nan": 0, "posinf": 1, "neginf": 0, "count": 4}, True),
    # x ** 0.5 at x < 0: NaN from a negative base.
    ([_input(0, -2.0, 2.0)], {"nan": 2, "posinf": 0, "neginf": 0, "count": 4}, True),
    # x ** 2 at x = 3e19: Inf from a large base, which the pow hint does not explain.
    ([_input(0, -6e19, 8e19)], {"nan": 0, "posinf": 3, "neginf": 0, "count": 4}, False),
    # Where the op's output is unknown, the op's family decides.
    ([_input(0, -6e19, 8e19)], None, True),
    # Untrusted counts never mean "overflow".
    ([_input(0, -6e19, 8e19)], {"nan": "0", "posinf": 3}, True),
])
def test_pow_is_named_only_where_its_evidence_fits_a_zero_or_negative_base(inputs, output, named):
    assert hints.choose(_pow_evidence(inputs, output)).startswith(_POW) == named


def _cast_evidence(op_type: str, inputs: list, output: dict | None) -> hints.Evidence:
    op = {"name": "net/Cast", "type": op_type, "source": "model.py:3 (call)", "phase": "forward", "inputs": inputs}
    return hints.Evidence("d1/output", metadata.TensorInfo(role="activation"), 3, {}, op=op, op_output=output)


_INF = {"nan": 0, "posinf": 1, "neginf": 0, "count": 4}


@pytest.mark.parametrize("op_type", ["Cast", "convert_element_type", "_to_copy"])
def test_a_cast_that_made_inf_from_finite_values_names_float16s_range(op_type):
    text = hints.choose(_cast_evidence(op_type, [_input(0, -2.0, 1e6)], _INF))
    assert text.startswith("A cast (%s) made +Inf from finite values at step 3" % op_type)
    assert "max |x| 1e6" in text and "65,504" in text


@pytest.mark.parametrize("inputs, output", [
    # A NaN out of the cast: it came in, or the op is not what overflowed.
    ([_input(0, -2.0, 1e6)], {"nan": 1, "posinf": 1, "neginf": 0, "count": 4}),
    # An Inf already in the input: nothing overflowed here.
    ([dict(_input(0, -2.0, 1e6), posinf=1)], _INF),
    # Nothing known of the inputs or the output.
    (None, _INF),
    ([_input(0, -2.0, 1e6)], None),
])
def test_a_cast_is_not_called_an_overflow_without_the_evidence(inputs, output):
    assert not hints.choose(_cast_evidence("Cast", inputs, output)).startswith("A cast")


def test_an_ops_output_is_the_first_of_its_runs_in_the_step_that_went_bad():
    """A Cast that made +Inf, then ran again on a NaN in the same step: its output is the first
    run's (+Inf, no NaN), not their sum."""
    import numpy as np

    from tb_numerics import evidence
    from tb_numerics.records import F, TensorSeries

    rows = np.zeros((3, len(metadata.FIELDS)))
    rows[:, F["count"]] = 4
    rows[1, F["posinf"]] = 1
    rows[2, F["nan"]] = 4
    s = TensorSeries("ops/net/Cast", metadata.TensorInfo(role="activation"), np.array([2, 3, 3]), rows)
    assert evidence.op_output([s], {"name": "net/Cast"}, 3) == {"nan": 0, "posinf": 1, "neginf": 0, "count": 4}
    assert evidence.op_output([s], {"name": "net/Cast"}, 2) == {"nan": 0, "posinf": 0, "neginf": 0, "count": 4}
    assert evidence.op_output([s], {"name": "net/Cast"}, 4) is None


def _record(nan=0, posinf=0, neginf=0, count=4) -> list:
    import numpy as np

    from tb_numerics.records import F

    v = np.zeros(len(metadata.FIELDS))
    v[F["count"]], v[F["nan"]], v[F["posinf"]], v[F["neginf"]] = count, nan, posinf, neginf
    return list(v)


@pytest.mark.parametrize("output, inputs, masked, passes", [
    # where(mask, scores, -inf): the -inf constant is a mask's; so is its output.
    (_record(neginf=2), [_record(), _record(neginf=1, count=1)], [False, True], True),
    # A full of -inf, made from no float: a constant the program wrote.
    (_record(neginf=4), [], [], True),
    # A log of 0: -Inf from finite values, made here.
    (_record(neginf=1), [_record()], [False], False),
    # -Inf read from a value that came in so (not a mask's): not passed on as intended.
    (_record(neginf=1), [_record(neginf=1)], [False], False),
    # A softmax over a row all -inf: NaN made of a mask's -Inf.
    (_record(nan=4), [_record(neginf=4)], [True], False),
    # +Inf is never a mask's.
    (_record(neginf=1, posinf=1), [_record(neginf=1)], [True], False),
])
def test_an_op_passes_a_mask_on_only_where_it_read_one_and_made_nothing_else(output, inputs, masked, passes):
    from tb_numerics.oplevel.record import passes_mask

    assert passes_mask(output, inputs, masked) is passes


def test_a_softmax_that_read_a_masks_minus_inf_made_its_nan_itself():
    from tb_numerics.oplevel.record import OpRecord

    op = OpRecord("ops/attn/Softmax", "Softmax", "m.py:3 (call)", "m.py:3 (call)", "forward", 7,
                  tuple(_record(nan=4)), input_records=(tuple(_record(neginf=4)),))
    assert op.reads_nonfinite()  # read a -Inf that came in: not born in the step
    import dataclasses

    assert not dataclasses.replace(op, inputs_masked=(True,)).reads_nonfinite()  # the mask's: born here


def _masked_evidence(inputs: list, output: dict | None) -> hints.Evidence:
    op = {"name": "attn/Softmax", "type": "Softmax", "source": "m.py:3 (call)", "phase": "forward", "inputs": inputs}
    return hints.Evidence("attn/output", metadata.TensorInfo(role="activation"), 7, {}, op=op, op_output=output)


def test_a_nan_made_from_minus_inf_names_the_row_all_masked():
    held = dict(_input(0, -2.0, 2.0), neginf=216)
    assert hints.choose(_masked_evidence([held], {"nan": 36, "posinf": 0, "neginf": 0, "count": 576})).startswith(
        "Softmax (m.py:3 (call)) made NaN from -Inf at step 7: its input 1 held 216 -Inf")
    # No -Inf in, or a NaN in already: not this rule.
    assert "from -Inf" not in hints.choose(_masked_evidence([_input(0, -2.0, 2.0)], {"nan": 36, "count": 576}))
    assert "from -Inf" not in hints.choose(_masked_evidence([dict(held, nan=1)], {"nan": 36, "count": 576}))
