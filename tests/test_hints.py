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
