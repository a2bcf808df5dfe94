"""NumericsCallback on Keras' JAX and PyTorch backends: the same answer as on TensorFlow (issue 32).

One process per backend (Keras picks its backend once per process) runs
every training this module checks (``backend_runs.py``), the three side by
side. Truth comes from outside the product: the injected faults (their step,
layer and source line), TensorFlow's own report of the same model, and on
JAX ``jax_debug_nans``/``jax_debug_infs``, which name the first primitive
that made a NaN or an Inf.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import backend_runs
from tb_numerics import hints

pytestmark = pytest.mark.e2e

BACKENDS = ("tensorflow", "jax", "torch")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """backend -> the results of ``backend_runs.py`` there."""
    missing = [m for m in ("jax", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip("%s not installed: pip install -e '.[test,cpu,jax,torch]' (scripts/test.sh does)" % ", ".join(missing))
    root = tmp_path_factory.mktemp("backends")
    procs = {}
    for b in BACKENDS:
        env = dict(os.environ, KERAS_BACKEND=b, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))  # demo/
        procs[b] = subprocess.Popen([sys.executable, os.path.join(HERE, "backend_runs.py"), str(root / (b + ".json")),
                                     str(root / b)], env=env, cwd=HERE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
    out = {}
    for b, p in procs.items():
        log = p.communicate(timeout=600)[0]
        assert p.returncode == 0, "%s:\n%s" % (b, log[-4000:])
        with open(root / (b + ".json")) as f:
            out[b] = json.load(f)
    return out


# fault -> (the tensor it goes bad in, its phase, the op family a hint names;
# None where the backends' ops differ: TensorFlow's SqrtGrad, a div elsewhere)
TRUTH = {"log0": ("fault/output", "forward", "log"), "div00": ("loss", "forward", "div"),
         "overflow": ("fault/output", "forward", "exp"), "sqrt0": ("gradients/fault/scale", "backward", None),
         # JAX computes the norm's slope (Inf at 0) for the backward pass in the forward part: not the op.
         "norm00": ("fault/output", "forward", "div")}


@pytest.mark.parametrize("kind", backend_runs.FAULTS)
def test_every_backend_names_the_same_first_anomaly_as_tensorflow(runs, kind):
    tensor, phase, _ = TRUTH[kind]
    for b in BACKENDS:
        a = runs[b][kind]["report"]["first_anomaly"]
        assert (a["step"], a["tensor"], a["phase"]) == (backend_runs.BAD_STEP, tensor, phase), b
        assert a["last_healthy_step"] == backend_runs.BAD_STEP - 1, b


@pytest.mark.parametrize("kind", backend_runs.FAULTS)
def test_every_backend_replays_the_step_to_the_faults_own_line(runs, kind):
    _, phase, family = TRUTH[kind]
    for b in BACKENDS:
        r = runs[b][kind]
        op = r["report"]["first_anomaly"]["op"]
        assert r["report"]["first_anomaly"]["replay"] == {"reproduced": True}, b
        assert op["source"].startswith("backend_runs.py:%d (" % r["line"]), (b, op)
        assert op["phase"] == phase, (b, op)
        if family:
            assert hints.op_family(op["name"], op["type"]) == family, (b, op)
        assert r["verdict"]["op"]["inputs"], (b, r["verdict"])  # the ranges of the op's inputs at that step


@pytest.mark.parametrize("kind", backend_runs.FAULTS)
def test_the_jax_replay_names_the_primitive_jax_debug_nans_names(runs, kind):
    r = runs["jax"][kind]
    assert r["oracle"].endswith("encountered in %s" % r["report"]["first_anomaly"]["op"]["type"]), r["oracle"]


def test_the_torch_replay_agrees_with_anomaly_mode_on_the_backward_fault(runs):
    # Anomaly mode checks the backward pass only, and for NaN only: it names
    # the first backward function that returned a NaN (the square's, whose
    # 2x times the sqrt's Inf is 0 x Inf). The replay names the first that
    # returned a NaN or an Inf: the sqrt's own, an Inf (0.5 / sqrt(0)).
    r = runs["torch"]["sqrt0"]
    op = r["report"]["first_anomaly"]["op"]
    assert r["oracle"].endswith("Backward0"), r["oracle"]
    if op["name"].split("/")[0] != r["oracle"]:
        assert op["name"].startswith("SqrtBackward0/") and r["verdict"]["op"]["nan"] == 0, (op, r["oracle"])
        assert r["verdict"]["op"]["posinf"] + r["verdict"]["op"]["neginf"] > 0, r["verdict"]


def test_nothing_imports_tensorflow_on_jax_and_torch(runs):
    # backend_runs.py made TensorFlow impossible to import there; a module
    # that needed it would have failed the run.
    assert runs["jax"]["tensorflow_imported"] == [] and runs["torch"]["tensorflow_imported"] == []
    assert runs["tensorflow"]["tensorflow_imported"]  # the check sees an import where there is one


def test_every_n_steps_still_writes_the_first_bad_step_and_the_one_before(runs):
    # every_n_steps=5, stop_on_anomaly: steps 0 and 5 regularly, 6 as the step
    # before the first bad one, 7; then training stopped.
    for b in ("jax", "torch"):
        report = runs[b]["every_n"]["report"]
        assert report["steps"]["fault/output"] == [0, 5, 6, 7], b
        assert report["first_anomaly"]["step"] == backend_runs.BAD_STEP, b


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_records_the_compute_dtype_on_every_backend(runs, policy):
    compute = policy.split("_")[1]
    for b in ("jax", "torch"):
        infos = runs[b][policy]["report"]["infos"]
        assert runs[b][policy]["report"]["first_anomaly"] is None, b
        assert infos["dense_0/output"]["dtype"] == compute, b
        grad = infos["gradients/faulty/dense_0/kernel"]
        assert (grad["dtype"], grad["compute_dtype"]) == ("float32", compute), b
        assert infos["head/output"]["dtype"] == "float32", b  # the layer the model keeps in float32
        assert ("loss_scale" in infos) == (compute == "float16"), b  # Keras scales the loss for float16 only


def test_the_records_are_the_same_rows_on_every_backend(runs):
    # The layer-level rows; TensorFlow's replay also writes op-level records (ops/...).
    tags = {b: [t for t in runs[b]["log0"]["report"]["infos"] if not t.startswith("ops/")] for b in BACKENDS}
    assert tags["jax"] == tags["tensorflow"] and tags["torch"] == tags["tensorflow"]
    fields = ("order", "role", "phase", "dtype", "shape", "op_type", "activation")
    meta = {b: [[runs[b]["log0"]["report"]["infos"][t][k] for k in fields] for t in tags[b]] for b in BACKENDS}
    assert meta["jax"] == meta["tensorflow"] and meta["torch"] == meta["tensorflow"]


def test_the_demos_keras_fit_story_fails_alike_on_every_backend(runs):
    # Its initial weights are drawn with numpy: the same model on every backend.
    firsts = {b: runs[b]["keras_fit"]["report"]["first_anomaly"] for b in BACKENDS}
    for b, a in firsts.items():
        assert (a["step"], a["tensor"], a["posinf"]) == (9, "dense_3/output", 15), b
        assert a["op"]["source"].startswith("demo/stories/keras_fit.py:") or a["op"]["source"].startswith(
            os.path.join(os.path.dirname(HERE), "demo", "stories", "keras_fit.py")), (b, a["op"])
        assert hints.op_family(a["op"]["name"], a["op"]["type"]) is None and a["op"]["name"].split("/")[-2] == "dense_1", b
    sources = {a["op"]["source"] for a in firsts.values()}
    assert len(sources) == 1, sources


def test_the_weights_and_update_ratios_are_those_keras_held_around_their_steps(runs):
    # Steps 0 and 10 record the weights (before the update) and the update
    # ratios; the truth is the weights Keras handed the callbacks after each
    # batch. Counts and extrema exactly, sums to float32 accumulation.
    F = backend_runs.metadata.FIELD_INDEX
    for b in BACKENDS:
        w = runs[b]["weights"]
        assert all(steps == [0, 10] for steps in w["weight_steps"].values()), (b, w["weight_steps"])
        for step, by_path in w["weights"].items():
            for path, (got, ref) in by_path.items():
                for k in ("count", "nan", "posinf", "neginf", "zeros", "min", "max"):
                    assert got[F[k]] == ref[F[k]], (b, step, path, k)
                for k in ("sum", "sum_sq"):
                    assert abs(got[F[k]] - ref[F[k]]) <= 1e-5 * max(1.0, abs(ref[F["sum_sq"]])), (b, step, path, k)
        assert sorted(w["ratios"]) == ["0", "10"], b
        for step, by_layer in w["ratios"].items():
            for layer, (got, ref) in by_layer.items():
                assert ref > 0 and abs(got - ref) <= 1e-4 * ref, (b, step, layer, got, ref)
    # A bad step records the weights it used too (its update held back for the replay).
    steps = {b: runs[b]["log0"]["report"]["steps"]["faulty/dense_0/kernel"] for b in BACKENDS}
    assert steps["jax"] == steps["tensorflow"] == steps["torch"] and backend_runs.BAD_STEP in steps["tensorflow"], steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_later_fit_runs_the_step_the_first_traced_and_finds_the_same_anomaly(runs, backend):
    """One training as three fit calls with one callback: the second runs the
    step the first traced, as Keras' own second fit does (on PyTorch no step
    is traced: each batch runs in Python, with or without it), and the third's
    bad batch is the first anomaly one fit finds, with the same op's line."""
    got, whole = runs[backend]["refit"], runs[backend]["log0"]
    # The oracle: Keras traces its step once on TensorFlow and JAX; on PyTorch
    # it runs it eagerly, a Python run per batch (the second fit has 3).
    assert got["plain_second_fit_calls"] == (3 if backend == "torch" else 0)
    assert got["second_fit_calls"] == got["plain_second_fit_calls"]
    a, b = got["report"]["first_anomaly"], whole["report"]["first_anomaly"]
    assert (a["step"], a["tensor"], a["phase"]) == (b["step"], b["tensor"], b["phase"]) == (
        backend_runs.BAD_STEP, "fault/output", "forward")
    assert got["report"]["steps"]["fault/output"] == list(range(backend_runs.STEPS))
    assert a["op"]["source"] == b["op"]["source"] and a["op"]["source"].startswith(
        "backend_runs.py:%d (" % whole["line"]), (a["op"], b["op"])


def test_a_nan_born_inside_a_nested_model_is_first_seen_at_the_layer_that_made_it(runs):
    """A model inside a model (a base in a ``Sequential``): the first anomaly
    is the output of the inner layer that Keras itself, calling the layers
    one by one on the injected batch, finds non-finite first, not the nested
    model's output, at the injected step, on every backend."""
    for b in BACKENDS:
        r = runs[b]["nested"]
        a = r["report"]["first_anomaly"]
        assert r["oracle_layer"] == "base/fault", (b, r["oracle_layer"])
        assert (a["step"], a["tensor"]) == (backend_runs.BAD_STEP, r["oracle_layer"] + "/output"), (b, a)
        # Every layer's output is recorded, the nested model's own too.
        assert {"base/fault/output", "base/dense_0/output", "base/output", "head/output"} <= set(r["report"]["steps"])


def test_a_nan_born_inside_a_layer_the_user_wrote_is_first_seen_at_the_layer_that_made_it(runs):
    """A user-written layer holding layers (as a Transformer block is
    written): the first anomaly is the output of the inner layer that Keras
    itself, calling the layers one by one, finds non-finite first, at the
    injected step, on every backend."""
    for b in BACKENDS:
        r = runs[b]["block"]
        a = r["report"]["first_anomaly"]
        assert r["oracle_layer"] == "block/fault", (b, r["oracle_layer"])
        assert (a["step"], a["tensor"]) == (backend_runs.BAD_STEP, r["oracle_layer"] + "/output"), (b, a)
        assert {"block/fault/output", "block/dense_0/output", "block/output", "head/output"} <= set(
            r["report"]["steps"]), (b, sorted(r["report"]["steps"]))


@pytest.mark.parametrize("run", ["masked", "masked_looped"])
def test_a_softmax_over_a_row_all_masked_with_minus_inf_is_the_op_not_the_mask(runs, run):
    """Hand-written attention masks its scores with -inf (intended: no anomaly of its own) and
    a sample of the injected batch has nothing to attend to: its row is all -inf, and the
    softmax makes NaN of it. The first anomaly is the layer Keras itself finds non-finite, at
    the injected step; the replay names the softmax's line, reproduced, on every backend
    (before, it stopped at the mask's -inf, called it a value that came in non-finite and said
    the fault was not reproducible), and the hint names the all-masked row. The same where the
    mask is applied inside a loop of the graph and the softmax after it (JAX's replay stepped
    into the loop, found no op there that made a value non-finite, and stopped at the loop)."""
    for b in BACKENDS:
        r = runs[b][run]
        a = r["report"]["first_anomaly"]
        assert r["oracle_layer"] == "masked", (b, r["oracle_layer"])
        assert (a["step"], a["tensor"]) == (backend_runs.BAD_STEP, "masked/output"), (b, a)
        assert r["verdict"]["reproduced"] is True, (b, r["verdict"])
        assert a["op"]["source"].startswith("backend_runs.py:%d (" % r["line"]), (b, a["op"])
        assert a["op"]["phase"] == "forward", (b, a["op"])
        assert "made NaN from -Inf at step %d" % backend_runs.BAD_STEP in a["hint"], (b, a["hint"])


def test_a_nan_the_batch_brought_is_the_inputs_and_the_replay_says_so(runs):
    """One NaN put into the batch at the injected step: the first anomaly is the input's, in
    phase ``input``, and the hint says it came from the data, on every backend. The replay's
    verdict says the batch held it as it arrived (before, it blamed "a variable an earlier
    update made so", and the compiler or the random draws, where a survival event showed it)."""
    for b in BACKENDS:
        r = runs[b]["nan_batch"]
        a = r["report"]["first_anomaly"]
        assert (a["step"], a["tensor"], a["phase"]) == (backend_runs.BAD_STEP, "input", "input"), (b, a)
        assert "arrived so from the data pipeline" in a["hint"], (b, a["hint"])
        assert r["verdict"]["reproduced"] is False, (b, r["verdict"])
        assert r["verdict"]["why"].startswith("the step's batch held NaN or Inf as it arrived"), (b, r["verdict"])


def test_under_gradient_accumulation_each_batch_is_its_own_step(runs):
    """An update every 4 batches (``gradient_accumulation_steps=4``), where
    ``optimizer.iterations`` counts updates: every batch is still a step of its
    own, as Keras' TensorBoard callback steps its batch losses (from 1, where
    a record's step is the optimizer's count before the step's update), and the fault
    injected at ``BAD_STEP`` is found there. Before, the records of four
    batches shared a step and the anomaly was filed at BAD_STEP // 4 on
    TensorFlow, and JAX raised as ``fit`` began."""
    for b in BACKENDS:
        r = runs[b]["accumulated"]
        a = r["report"]["first_anomaly"]
        assert (a["step"], a["tensor"]) == (backend_runs.BAD_STEP, "fault/output"), (b, a)
        assert r["report"]["steps"]["fault/output"] == list(range(backend_runs.STEPS)), b
        assert r["updates"] < backend_runs.STEPS // 2, (b, r["updates"])  # the accumulation was on
    assert runs["tensorflow"]["accumulated"]["keras_tb_steps"] == list(range(1, backend_runs.STEPS + 1))


def test_a_loss_that_overflows_with_finite_gradients_holds_the_update_back(runs):
    """The squared error of a 1e20 target is +Inf, its gradients finite; under
    Adafactor, applying them makes the weights NaN. On every backend the
    step's update is held back on its loss, the weights stay finite, and the
    replay, on the weights the step used, reproduces it. Before, JAX held
    back on the gradients only: the weights went NaN, and the replay blamed
    "a variable an earlier update made so"."""
    for b in BACKENDS:
        r = runs[b]["loss_overflow"]
        a = r["report"]["first_anomaly"]
        assert (a["step"], a["tensor"], a["phase"]) == (backend_runs.BAD_STEP, "loss", "forward"), (b, a)
        assert r["weights_finite"], b
        assert r["verdict"]["reproduced"] is True and r["verdict"]["op"]["phase"] == "forward", (b, r["verdict"])


def test_a_model_with_batchnorm_and_dropout_replays_to_the_faults_line(runs):
    """The 0/0 in the loss of a model with BatchNormalization and Dropout: the replay names
    the injected line, reproduced, on every backend. Before, JAX's replay stopped at the NaN
    that ``jnp.var`` casts and selects away (``where(n > 0, s / n, nan)``: no value of the
    step's making) and called the fault not reproduced, and with Dropout it raised at the
    random key's dtype (``key<fry>``)."""
    for b in BACKENDS:
        r = runs[b]["normed_dropout"]
        a = r["report"]["first_anomaly"]
        assert (a["step"], a["tensor"], a["phase"]) == (backend_runs.BAD_STEP, "loss", "forward"), (b, a)
        assert r["verdict"]["reproduced"] is True, (b, r["verdict"])
        assert a["op"]["source"].startswith("backend_runs.py:%d (" % backend_runs.fault_line("div00")), (b, a["op"])
        assert a["op"]["phase"] == "forward", (b, a["op"])


@pytest.mark.parametrize("run", ["guide_compute", "guide_hand"])
def test_a_custom_train_step_as_keras_guide_writes_it_has_its_loss_recorded(runs, run):
    """Keras' guide's custom ``train_step`` on each backend (a ``GradientTape``, ``backward()``,
    ``jax.value_and_grad`` of its own ``compute_loss_and_updates``), its loss from
    ``compute_loss`` or from a loss function it calls by hand. Before, the callback stopped
    JAX's ``fit`` with a ValueError (it unpacked the auxiliary output as Keras' own), and
    recorded no loss on PyTorch, nor on TensorFlow by hand: the NaN was first seen in a
    gradient. The truth: the loss each step returned to Keras, and the injected 0/0's line."""
    for b in BACKENDS:
        r = runs[b][run]
        assert len(r["returned"]) == backend_runs.STEPS and np.isnan(r["returned"][backend_runs.BAD_STEP]), b
        bad = backend_runs.BAD_STEP
        assert np.isfinite(r["returned"][:bad]).all(), b
        assert r["recorded"] is not None and len(r["recorded"]) == backend_runs.STEPS, (b, r["recorded"])
        np.testing.assert_allclose(r["recorded"][:bad], r["returned"][:bad], rtol=1e-5, err_msg=b)
        a = r["report"]["first_anomaly"]
        assert (a["step"], a["tensor"], a["phase"]) == (bad, "loss", "forward"), (b, a)
        assert a["op"]["source"].startswith("backend_runs.py:%d (" % backend_runs.fault_line("div00")), (b, a["op"])


@pytest.mark.parametrize("kind", ["log0", "sqrt0"])
def test_a_nan_born_in_a_layer_called_inside_a_loop_is_seen_where_the_loop_hands_it_out(runs, kind):
    """A user-written layer calls the fault it holds inside a loop of the
    graph (``keras.ops.fori_loop``). Tensors made inside a traced loop cannot
    leave it, so where the step is traced (TensorFlow, JAX) a forward fault
    is first seen at the output of the layer that holds the loop; eager
    PyTorch records the inner layer, the one Keras itself finds non-finite
    first. Training runs on, and the replay steps into the loop: the
    injected op's line and phase (sqrt's derivative at 0: backward, the
    coefficient JAX computes in the forward loop too), not the loop."""
    tensor, phase, family = TRUTH[kind]
    for b in BACKENDS:
        r = runs[b]["looped_" + kind]
        a = r["report"]["first_anomaly"]
        assert r["oracle_layer"] == ("looped/fault" if kind == "log0" else None), (b, r["oracle_layer"])
        if kind == "log0":
            tensor = ("looped/fault" if b == "torch" else "looped") + "/output"
        assert (a["step"], a["tensor"]) == (backend_runs.BAD_STEP, tensor), (b, a)
        assert len(r["report"]["steps"]["head/output"]) == backend_runs.STEPS, b
        assert a["op"] and a["op"]["phase"] == phase, (b, a.get("op"), a.get("replay"))
        assert a["op"]["source"].startswith("backend_runs.py:%d (" % backend_runs.fault_line(kind)), (b, a["op"])
        if family:
            assert a["op"]["type"].lower() == family, (b, a["op"])


def test_a_nan_the_optimizer_makes_from_finite_gradients_is_the_updates_and_explained_on_every_backend(runs):
    """Adam(epsilon=0) and a weight that never has a gradient: its update is
    0/0. On every backend the first anomaly is at the first batch after which
    Keras' own weights held a NaN (a callback reading them), in phase update,
    and the hint names the optimizer's 0/0 and its epsilon."""
    for b in BACKENDS:
        r = runs[b]["adam_eps0"]
        a = r["report"]["first_anomaly"]
        assert r["oracle_bad"] and a is not None, b
        assert (a["step"], a["phase"]) == (r["oracle_bad"][0], "update"), (b, a)
        assert "Adam divides" in a["hint"] and "0/0 unless epsilon is positive" in a["hint"], (b, a["hint"])
        # No replay of the step runs the update: what a replay says, it says of the update, not of
        # a compiler or random draws that made a step's replay come out finite.
        why = (a.get("replay") or {}).get("why", "")
        assert not why or "update" in why and "random" not in why, (b, why)


def test_a_moving_statistic_that_went_non_finite_is_the_first_anomaly_at_its_step(runs):
    """A finite batch of 3e19 makes BatchNormalization's moving variance +Inf.
    On TensorFlow and JAX the layer's output, the loss and the gradients stay
    finite (training normalises by the batch's own variance): only inference
    would show it, so only the variable's own record can. The truth: the
    batch after which Keras' moving variance was first not finite (a callback
    reading it), and the op the backend's own check names in that batch's
    forward pass (TensorFlow's enable_check_numerics, JAX's jax_debug_infs)."""
    for b in BACKENDS:
        r = runs[b]["moving_variance"]
        a = r["report"]["first_anomaly"]
        assert r["oracle_bad"] and a is not None, b
        assert a["step"] == r["oracle_bad"][0] == backend_runs.BAD_STEP, b
        if r["losses_finite"]:  # else the output went bad too, and is the step's first record (PyTorch's pow)
            assert (a["tensor"], a["posinf"]) == (r["path"], a["size"]), (b, a)
        assert a["op"]["phase"] == "forward" and a["op"]["name"].split("/")[-2] == "bn", (b, a["op"])
        if r["oracle_op"]:
            assert a["op"]["type"] == r["oracle_op"], (b, a["op"], r["oracle_op"])
        # The cause is the batch, not the op: no op's own hint (pow's negative base) is given.
        assert a["hint"].startswith("The batch at step %d was already far out of range" % backend_runs.BAD_STEP), (b, a)
        # Computed every step, written with the weights' (0, 10) and from the step it went bad.
        assert r["report"]["steps"][r["path"]] == [0] + list(range(backend_runs.BAD_STEP, backend_runs.STEPS)), b
    assert runs["tensorflow"]["moving_variance"]["losses_finite"] and runs["jax"]["moving_variance"]["losses_finite"]
    assert runs["tensorflow"]["moving_variance"]["oracle_op"] and runs["jax"]["moving_variance"]["oracle_op"]
