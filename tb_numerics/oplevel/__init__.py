"""Op-level numerics: the exact op, its type and source line, where values go bad.

The layer-level API records the tensors a user names. ``op_numerics`` records
every floating-point op output of a training step without the user naming
anything, forward ops and the gradient ops the tape builds alike::

    recorder = tbn.op_numerics()              # or op_numerics(flight_recorder=8)

    @tf.function                              # a traced step: each call is one step
    @recorder
    def train_step(x, y):
        ...

    for step, (x, y) in enumerate(data):      # or an eager step, which may call
        with writer.as_default(step=step), recorder:   # tf.functions of its own
            train_step_eager(x, y)

Each op output becomes an ordinary numerics record under the tag
``ops/<op name>`` (the graph op name in a ``tf.function``, ``<name
scope><OpType>`` eagerly), with ``TensorInfo.op_type`` the op type and
``TensorInfo.description`` the user's source line that created it
(``file:line (function)``; for a gradient op, the line of the forward op it
differentiates). Ops built inside the gradient computation have role
"gradient" (backward phase); ops run after it, such as the optimizer's, role
"weight" (update phase); all others role "activation" (forward phase). So
the analysis core's "first anomaly" names the first op whose output left
the safe range.

**An eager block owns its step.** Around an eager step, the recorder also
records the ops of the ``tf.function``s the step calls (and their gradients,
their ``tf.cond`` branches and ``tf.while_loop`` bodies, such as Keras RNN
loops): their record ops, added when a function is traced inside the block,
store each record with its execution position in the recorder's own
variables, and the block writes them when it closes, in execution order, at
the step the block was entered with (a Python int or a ``tf.Variable``).
Outside any block those record ops do nothing, so an evaluation pass through
an instrumented function records nothing. Every execution of an op counts:
an op in a loop body gives one record per iteration (occurrences of its tag
at that step, in execution order), and tags are first written in execution
order, so the order the analysis sorts by is the order ops first ran. Where
that cannot tell (an op early in a loop body whose record of iteration 3
went bad because of a later op at iteration 2), the block also writes, at a
step with a non-finite op record, a mark naming the first of them in exact
execution order (``oplevel.record``). ``OpNumerics.first_bad`` is that record of
the last eager step, and ``replay_step`` runs a step function once this way
and returns it. What a block calls that was traced before the recorder was
active is traced anew in it (``retrace``): a ``tf.function`` through a copy,
a ``tf.data`` pipeline iterated in an eager block rebuilt with its functions
traced anew. Where that cannot be (a concrete function, or one whose first
trace made variables) the function has no record ops (a warning names it);
its outputs are recorded instead, under its name, with the op type of its
call (``__inference_<name>_<uid>``), so a value it made is pinned on it and
not on the op after it; an iterator's output is recorded as the input
pipeline's (phase "input"), naming its functions. A function a called
function calls files its ops under both names (``ops/outer/inner/Log``). Gradient
bodies of ``tf.while_loop`` (a Keras RNN's backward pass) are not recorded:
they may only capture values of the forward loop.

The record is ``stats.op_stats``, lighter than the layer-level
``tensor_stats`` because it runs on every op output. Count, NaN / +Inf /
-Inf counts, min, max and the overflow count are the same (exact); **sum and
sum of squares are not computed and are always NaN** (so mean, std and L2
norm read as NaN, "not recorded"), and **the zero and underflow counts are
not computed and are always 0** (0 keeps the counts valid; no underflow
warning is ever raised from an op-level record). Naming the op where a
value first goes NaN/Inf or beyond the overflow margin needs none of them,
and each cost every op output another pass over its values (zeros and
underflow, elementwise ones, in every tensor holding a zero); left out, a
typical op output costs two reductions. For those statistics of a tensor,
use ``log_numerics`` on it.

Like TensorFlow's ``enable_check_numerics``, it hooks op creation with op
callbacks: inside a ``tf.function`` the statistics ops are added to the graph
when it is traced, so only traces made while the recorder is active are
instrumented (put ``@recorder`` under ``@tf.function``). Under
``jit_compile=True`` it raises ``ValueError`` at trace time: summary ops
cannot run inside XLA, and XLA fuses ops so their outputs do not exist.

The package, by job: ``recorder`` (``OpNumerics``: the op callback, and
``replay_step``), ``step`` (one step's state, and an op's role, source line
and name in it), ``source`` (the user's line, a gradient op's forward op),
``tags`` (tag names), ``nested`` (records inside called functions, branches
and loop bodies), ``retrace`` (what a block calls that was traced before
it, traced anew in it), ``flight`` (the flight recorders), ``write`` (an
eager step's records in one call), ``record`` (``OpRecord``, the first
non-finite op, and its mark).
"""

from tb_numerics.oplevel.record import OpRecord, parse_mark
from tb_numerics.oplevel.tags import TAG_PREFIX

# The recorder's names import TensorFlow: imported on first use, so that
# ``oplevel.record`` (``OpRecord``, which the JAX and PyTorch replays use)
# imports none.
_RECORDER = ("DEFAULT_SKIP_OP_TYPES", "OpNumerics", "numerics_check_failed", "op_numerics", "replay_step")

__all__ = [
    "DEFAULT_SKIP_OP_TYPES",
    "OpNumerics",
    "OpRecord",
    "TAG_PREFIX",
    "numerics_check_failed",
    "op_numerics",
    "parse_mark",
    "replay_step",
]


def __getattr__(name: str):
    if name in _RECORDER:
        from tb_numerics.oplevel import recorder

        return getattr(recorder, name)
    raise AttributeError("module 'tb_numerics.oplevel' has no attribute %r" % name)
