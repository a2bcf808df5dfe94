"""Issue 29: "non-finite" has one definition per backend, and no copy elsewhere.

The rule (NaN + +Inf + -Inf, the -Inf left out where it is intended) lives
in ``records.nonfinite_count`` (numpy) and ``stats.nonfinite_count`` with
``count_nonfinite`` / ``sums_finite`` / ``all_finite`` (TensorFlow, in
``_stats_core``); the statistics classify elements once, where they count
them. This test reads the package's source and fails on any other place
that tests for NaN or Inf by itself (``is_nan``, ``is_inf``,
``is_finite``, ``np.isnan``, ``np.isinf``, ``np.isfinite``,
``math.isnan``/``isinf``/``isfinite``, or ``x != x``), outside the
allow-list below, where each entry says why it is no copy of the rule.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tb_numerics"

# A call that classifies values as NaN / Inf / finite by itself.
_CALL = re.compile(r"\b(?:tf\.math\.|tf\.)?(?:is_nan|is_inf|is_finite)\b|\b(?:np|numpy|math)\.(?:isnan|isinf|isfinite)\b")
# ``x != x`` (true only for NaN), and ``x == x``.
_SELF_COMPARE = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*(?:\[[^\]]*\])?)\s*[!=]=\s*\1(?![\w.\[(])")

# Where such a test is the home of the rule, or is no copy of it: a whole
# module ("path"), or one function or class in it ("path:qualname").
ALLOWED = {
    # The homes.
    "records.py": "the numpy home: nonfinite_count, and numpy_stats, the reference statistics that classify elements",
    "_stats_core.py": "the TensorFlow home: nonfinite_count, count_nonfinite, sums_finite, all_finite and the element counts",
    "stats.py": "the layer record: its healthy path decides on a finite sum of squares, its other path counts exactly",
    "_stats_op.py": "the op record's statistics: they classify the elements they count",
    "_stats_segments.py": "batched statistics: is_finite tests whether float32 sums are exact, not the values",
    "_stats_replicas.py:combine_stats": "NaN in min/max marks 'no finite value' in a record, not a count",
    # The reading side (issue 29's rules core owns these modules and their rules).
    "detectors.py": "reading side: finite values of a per-step series (norms, max |x|), not a record's counts",
    "evidence.py": "reading side: finite values of a per-step series (a factor over its history, a mean), "
                   "not a record's counts",
    "rules/kinds.py:rolling_median_before": "a per-step series' finite values (the spike rule's median), not counts",
    "rules/kinds.py:_spike_detail": "how many finite norms the spike's median used, for its words",
    "rules/numbers.py:number": "a number's text ('NaN', '+Inf'), not a count",
    "safe_range.py:_parse_param": "a user's safe-range parameter must be a finite number",
    "views.py:_chart_columns": "NaN in sum_sq marks a field not recorded (op level), not a count",
    "views.py:_bucket_finite_mean": "a chart bucket's mean over a series' finite points",
    "compact.py:_Pieces.add": "a long run's chart chunks, as views makes chart points: sums of the finite "
                                     "means, stds and norms, and NaN in sum_sq marking a field not recorded",
    "compare.py:parse_band": "a user's band factor must be a finite number",
    "compare.py:_first_departure": "a reference band's edge (a max over a window) is finite where the reference was",
    "hints.py:_finite": "a replay input's min or max shown only where it is a finite number",
    "scalars.py": "reading side: raw tf.summary.scalar values, one value each, not numerics records",
    # Writing side, not the rule.
    "step_buffer.py:StepBuffer._write": "NaN equals itself when testing that a row is exactly float32",
    "backends/torch_stats.py:_settle_first": "whether the quick path's sums, min and max are exact (finite); "
                                             "a tensor whose are not is counted exactly, by _exact",
    "_keras_batch.py:bad_features": "per feature and per example of the kept batch, which a record (whole-tensor counts) cannot say",
    "_survive_tf.py:SpikeWindow": "the spike trigger's per-step losses and norms: a non-finite one is left out of the "
                                  "window's mean (OLMo-core's rule) and is another trigger's, not a record's counts",
    "_survive_tf.py:_mean_std": "the spike window's mean over its finite entries, not a record's counts",
}


def _qualnames(tree: ast.AST) -> dict[int, str]:
    """Line -> the qualified name of the innermost function or class around it."""
    out: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                for line in range(child.lineno, (child.end_lineno or child.lineno) + 1):
                    out[line] = name
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each line, comments and docstrings blanked."""
    tree = ast.parse(text)
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return [(i, line.split("#", 1)[0]) for i, line in enumerate(text.splitlines(), 1) if i not in doc_lines]


def find_nonfinite_tests(root: pathlib.Path = PACKAGE) -> list[tuple[str, int, str, str]]:
    """(path, line, qualname, code) of each NaN/Inf test in the package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        names = _qualnames(ast.parse(text))
        rel = path.relative_to(root).as_posix()
        for i, code in _code_lines(text):
            if _CALL.search(code) or _SELF_COMPARE.search(code):
                found.append((rel, i, names.get(i, ""), code.strip()))
    return found


def _allowed(path: str, qualname: str) -> bool:
    if path in ALLOWED:
        return True
    parts = qualname.split(".")
    return any("%s:%s" % (path, ".".join(parts[:k])) in ALLOWED for k in range(1, len(parts) + 1))


def test_no_module_tests_for_nan_or_inf_outside_the_homes_of_the_rule():
    stray = ["%s:%d (%s): %s" % (p, i, q or "module", c) for p, i, q, c in find_nonfinite_tests() if not _allowed(p, q)]
    assert not stray, "NaN/Inf tested outside the rule's homes; call records.nonfinite_count or " \
        "stats.nonfinite_count / count_nonfinite / all_finite instead:\n" + "\n".join(stray)


def test_every_allow_list_entry_is_still_needed_and_says_why():
    hits = find_nonfinite_tests()
    for key, reason in ALLOWED.items():
        assert reason.strip(), key
        path, _, qualname = key.partition(":")
        assert (PACKAGE / path).is_file(), key
        used = [h for h in hits if h[0] == path and (not qualname or h[2] == qualname or h[2].startswith(qualname + "."))]
        assert used, "%s no longer tests for NaN or Inf: drop it from ALLOWED" % key


def test_the_scan_finds_each_kind_of_copy(tmp_path):
    """The scan itself: each way of writing the test is found, in a
    function's name, and text in comments and docstrings is not."""
    (tmp_path / "m.py").write_text(
        '"""np.isnan in a docstring."""\n'
        "import math\n"
        "import numpy as np\n"
        "import tensorflow as tf\n\n\n"
        "def a(x):\n    return np.isfinite(x)  # np.isnan in a comment\n\n\n"
        "def b(x):\n    return tf.math.is_nan(x)\n\n\n"
        "class C:\n    def c(self, x):\n        return x != x\n\n\n"
        "def d(x):\n    return math.isinf(x) or x.y == x.y\n\n\n"
        "def e(x, y):\n    return x != y or x[0] != x[1]\n"
    )
    found = [(q, c) for _, _, q, c in find_nonfinite_tests(tmp_path)]
    assert [q for q, _ in found] == ["a", "b", "C.c", "d"], found
