"""The numerics plugin's name and its versioned on-disk record format.

Numpy and TensorBoard protos only: no TensorFlow import, so the backend, the
CLI and the writer all share these definitions.

One record is a float64 vector of ``NUM_FIELDS`` statistics of one tensor at
one step, written as a TensorBoard tensor summary under the tensor's tag. The
field layout (index: meaning) is:

====  ===========  ==========================================================
 0    count        number of elements
 1    nan          number of NaN elements
 2    posinf       number of +Inf elements
 3    neginf       number of -Inf elements
 4    min          minimum of the finite elements (NaN if there are none)
 5    max          maximum of the finite elements (NaN if there are none)
 6    sum          sum of the finite elements
 7    sum_sq       sum of squares of the finite elements
 8    zeros        number of elements equal to zero
 9    overflow     number of finite elements with |x| > the dtype's margin
10    underflow    number of nonzero finite elements with |x| < smallest normal
====  ===========  ==========================================================

Mean, standard deviation, max |x| and the L2 norm of the finite values are
derived from these exactly (see ``analysis``); storing them again would cost
bytes in every record for no information.

Per-tag facts that do not change from step to step (dtype, shape, role,
execution order, op type) live in the JSON plugin content of the summary
metadata, which TensorBoard reads from the first event of each series. So
that a damaged first event does not take the series with it, later events
carry enough to be read without it: a packed block's its table compressed
(``create_block_metadata(..., compact=True)``), a per-tensor record the
plugin's name with no content (``create_later_metadata``; a reader infers
the rest with ``info_from_tag``).

Records come in two layouts. Version 1: one event per tensor per step, under
the tensor's own tag (what ``log_numerics`` writes inside a training step).
Version 2 added packed blocks (``packed.py``): every record of one step in
one event, ``[n, 1 + NUM_FIELDS]``, under a block tag whose metadata holds the
table of tensors the rows point into. Version 3 packs several steps in one
event, ``[n, 2 + NUM_FIELDS]`` with the step in the second column. Readers
read all three; per-tensor records are still written as version 1, so older
readers keep reading them and refuse only blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import zlib
from typing import Any

from tensorboard.compat.proto import summary_pb2, tensor_pb2

PLUGIN_NAME = "numerics"

# Major version: a reader refuses records of a newer major version. Minor
# version: additions that older readers may ignore.
FORMAT_VERSION = 3
FORMAT_MINOR_VERSION = 2
# The version per-tensor records are written with (their layout is version 1's).
RECORD_VERSION = 1

FIELDS = (
    "count",
    "nan",
    "posinf",
    "neginf",
    "min",
    "max",
    "sum",
    "sum_sq",
    "zeros",
    "overflow",
    "underflow",
)
NUM_FIELDS = len(FIELDS)
FIELD_INDEX = {name: i for i, name in enumerate(FIELDS)}

# Minor version 2 added the role "input": a reader of minor version 1 reads
# a role it does not know as "other" (phase forward), so there an input's
# records are forward ones, ordered before the layers' by their order.
ROLES = ("activation", "loss", "gradient", "global_norm", "weight", "other", "loss_scale", "update", "input")
PHASES = ("input", "forward", "backward", "update")
PHASE_RANK = {p: i for i, p in enumerate(PHASES)}

# The phase of the training step a role belongs to, for "forward before
# backward" ordering and for the words the dashboard and CLI print.
ROLE_PHASE = {
    # The batch as it arrived (a model input, the targets, the sample
    # weights): before any layer ran, so a batch that arrives broken is the
    # first anomaly, not the first layer that reads it.
    "input": "input",
    "activation": "forward",
    "loss": "forward",
    "other": "forward",
    "gradient": "backward",
    "global_norm": "backward",
    "weight": "update",
    # A LossScaleOptimizer's scale, decided with the update; the analysis
    # reads it to tell a skipped step from an anomaly.
    "loss_scale": "update",
    # A tensor a user logged after the step's gradients (a clipped norm in
    # the optimizer's update, say).
    "update": "update",
}

# Fraction of a dtype's largest finite value beyond which a value counts as
# an overflow risk: squaring, summing or exponentiating it is likely to
# overflow. 1/64 leaves float16 about 1,000 of headroom and float32 5e36.
OVERFLOW_MARGIN_FRACTION = 2.0**-6

# (largest finite value, smallest positive normal) of each supported dtype.
DTYPE_LIMITS = {
    "float16": (65504.0, 2.0**-14),
    "bfloat16": (3.3895313892515355e38, 2.0**-126),
    "float32": (3.4028234663852886e38, 2.0**-126),
    "float64": (1.7976931348623157e308, 2.0**-1022),
}
SUPPORTED_DTYPES = tuple(DTYPE_LIMITS)


def overflow_margin(dtype: str) -> float:
    """The |x| beyond which a value of ``dtype`` counts as an overflow risk."""
    return DTYPE_LIMITS[dtype][0] * OVERFLOW_MARGIN_FRACTION


def smallest_normal(dtype: str) -> float:
    """The smallest positive normal value of ``dtype``."""
    return DTYPE_LIMITS[dtype][1]


class FormatError(ValueError):
    """A record or its metadata cannot be read by this version."""


# How a writer ends the description of a weight the forward pass updates
# (``TensorInfo.forward_state``).
FORWARD_STATE = "updated by the forward pass"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What the metadata says about one logged tensor (one tag)."""

    dtype: str = "float32"
    shape: tuple[int | None, ...] | None = None
    role: str = "other"
    order: int = 0
    op_type: str = ""
    description: str = ""
    version: int = RECORD_VERSION
    # -Inf is intended in this tensor (an attention mask): the writer was
    # told so, and every reader applies it without the user repeating it.
    neginf_ok: bool = False
    # The activation function of the layer that made it ("exponential"), or
    # the loss function's name for a loss; "" where unknown.
    activation: str = ""
    # The dtype the tensor was computed in where it differs from ``dtype``
    # (a float16 layer's output recorded after a cast), for headroom.
    compute_dtype: str = ""
    # For a gradient: the optimizer that squares it ("Adam": its second
    # moment), so a gradient whose square overflows is a warning; "" otherwise.
    squared_by: str = ""

    @property
    def phase(self) -> str:
        return ROLE_PHASE.get(self.role, "forward")

    @property
    def forward_state(self) -> bool:
        """Whether this is a weight the forward pass updates (BatchNorm's
        moving statistics), as the Keras callback describes one: it follows
        the data's statistics, not the optimizer's steps."""
        return self.role == "weight" and self.description.endswith(FORWARD_STATE)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
            "role": self.role,
            "phase": self.phase,
            "order": self.order,
            "op_type": self.op_type,
            "description": self.description,
            "neginf_ok": self.neginf_ok,
            "activation": self.activation,
            "compute_dtype": self.compute_dtype or self.dtype,
            "squared_by": self.squared_by,
        }


def create_summary_metadata(info: TensorInfo) -> summary_pb2.SummaryMetadata:
    """Builds the summary metadata proto that marks a numerics record."""
    content = {"version": RECORD_VERSION, "minor": FORMAT_MINOR_VERSION, **_info_fields(info)}
    return _summary_metadata(content, info.description)


def create_block_metadata(
    tensors: list[tuple[str, TensorInfo]], compact: bool = False
) -> summary_pb2.SummaryMetadata:
    """The summary metadata of a packed block: the table its rows index into.

    ``compact``: the same table zlib-compressed, for the block's later
    events. Each event carries the table so that the block stays readable
    when its first event is lost (TensorBoard and the CLI take the table from
    the first event they can read); compressed, the copy costs a fifth of
    the bytes (tags repeat their prefixes). ``parse_content`` reads both.
    """
    content = {
        "version": FORMAT_VERSION,
        "minor": FORMAT_MINOR_VERSION,
        "tensors": [
            {"tag": tag, **_info_fields(info), "description": info.description} for tag, info in tensors
        ],
    }
    md = _summary_metadata(content, "")
    if compact:
        md.plugin_data.content = zlib.compress(md.plugin_data.content, 9)
    return md


def create_later_metadata() -> summary_pb2.SummaryMetadata:
    """The metadata of a per-tensor record after a tag's first: the plugin's
    name and data class, no content. A reader that lost the tag's first
    event still knows the record for a numerics one (see ``info_from_tag``);
    the data class keeps TensorBoard's Rust data server from dropping the
    series when that event is the first it reads."""
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )


# The first component of the Keras callback's tags of the batch.
# The first component of tags that name a variable or a layer after it
# (``gradients/<variable path>``, ``update_ratio/<layer>``, ``update/<variable
# or slot>``): the dashboard files such a row under that layer.
SCOPED_TAG_HEADS = ("gradients", "update_ratio", "update")
BATCH_TAG_HEADS = ("input", "target", "sample_weight")

# The order given to a tensor whose TensorInfo was lost: after every tensor
# of its phase whose order is known.
UNKNOWN_ORDER = 2**31 - 1


def info_from_tag(tag: str) -> TensorInfo:
    """What a numerics record's tag tells of its tensor, for a record whose
    tag lost its ``TensorInfo`` with its first event: the role from the
    writers' tag names (``gradients/global_norm``, ``gradients/<variable>``,
    the Keras callback's ``input``, ``target`` and ``sample_weight`` and
    their ``input/<name>``, a last component naming a loss, else an
    activation), dtype float32 (a reader that has the values may know
    better), the order unknown."""
    parts = tag.split("/")
    if parts[0] in BATCH_TAG_HEADS and (len(parts) == 1 or parts[-1] != "output"):
        role = "input"
    elif tag == "gradients/global_norm":
        role = "global_norm"
    elif parts[0] == "gradients" and len(parts) > 1:
        role = "gradient"
    elif "loss" in parts[-1].lower():
        role = "loss"
    else:
        role = "activation"
    return TensorInfo(dtype="float32", role=role, order=UNKNOWN_ORDER)


def _info_fields(info: TensorInfo) -> dict[str, Any]:
    fields = {
        "dtype": info.dtype,
        "shape": None if info.shape is None else list(info.shape),
        "role": info.role,
        "order": int(info.order),
        "op_type": info.op_type,
    }
    # Minor-version additions, written only where set (older readers ignore them).
    if info.neginf_ok:
        fields["neginf_ok"] = True
    if info.activation:
        fields["activation"] = info.activation
    if info.compute_dtype and info.compute_dtype != info.dtype:
        fields["compute_dtype"] = info.compute_dtype
    if info.squared_by:
        fields["squared_by"] = info.squared_by
    return fields


def _summary_metadata(content: dict[str, Any], description: str) -> summary_pb2.SummaryMetadata:
    return summary_pb2.SummaryMetadata(
        summary_description=description,
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME,
            content=json.dumps(content, separators=(",", ":")).encode("utf-8"),
        ),
        # Without this the Rust data server silently drops the series.
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )


# The record that holds a replay's verdict on the first non-finite step (its
# description is the JSON of ``first_anomaly.replay``); not a tensor.
REPLAY_TAG = "replay/first_anomaly"
# The record that holds where a batch that went bad held its bad values,
# per feature (its description is JSON, see ``keras``); not a tensor.
BATCH_TAG = "batch/first_anomaly"
# The record an op-level block writes at a step where an op record is not
# finite: the op that went bad first in execution order (its description is
# ``OpRecord.to_json()``), which the tags' order cannot tell across the
# iterations of a loop; not a tensor.
OP_MARK_TAG = "oplevel/first_anomaly"
# Records that carry a verdict in their description, not a tensor's statistics.
VERDICT_TAGS = frozenset({REPLAY_TAG, BATCH_TAG, OP_MARK_TAG})

# What a training did about an anomaly (a skipped update, a rewind to a
# snapshot, a stop; see ``survive``): one event per step that acted, its JSON
# in a string tensor, under a plugin of its own so that readers that do not
# know it (every tb-numerics before it, TensorBoard's other plugins) never
# see it, rather than misread it as a tensor's record. Its content carries
# its own format version; a reader refuses a newer major one and says so.
ACTIONS_PLUGIN = "numerics_actions"
ACTIONS_TAG = "numerics/actions"
ACTIONS_FORMAT_VERSION = 1

# How deep the JSON of a log file (metadata, a verdict, an action) may nest:
# the writers' is a few levels deep. Deeper is refused where it is parsed,
# before code that recurses through it (str(), json.dumps) meets it.
MAX_JSON_DEPTH = 32
# The integers the writers write (steps, counts, orders) fit in 64 bits; a
# longer one (a 400-digit "max") would overflow float() wherever it is read.
_MAX_JSON_INT = 2**63


def parse_json(text: bytes | str, what: str) -> Any:
    """JSON read from a log file (untrusted): numerics metadata, a verdict's
    description, an action.

    Args:
      text: the JSON, as UTF-8 bytes or text.
      what: what it is, for the error's words ("numerics metadata").

    Raises:
      FormatError: not UTF-8 JSON, nested deeper than ``MAX_JSON_DEPTH``, or
        holding an integer beyond 64 bits.
    """
    try:
        raw = json.loads(bytes(text).decode("utf-8") if isinstance(text, (bytes, bytearray)) else text,
                         parse_int=_json_int)
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError("%s is not valid JSON: %s" % (what, e)) from None
    except RecursionError:
        raise FormatError("%s is JSON nested too deeply" % what) from None
    if _nests_deeper(raw, MAX_JSON_DEPTH):
        raise FormatError("%s is JSON nested more than %d deep" % (what, MAX_JSON_DEPTH))
    return raw


def _json_int(text: str) -> int:
    """A JSON integer, refused beyond 64 bits (its digits counted before any conversion)."""
    value = int(text) if len(text.lstrip("-")) <= 19 else None
    if value is None or not -_MAX_JSON_INT <= value < _MAX_JSON_INT:
        raise ValueError("an integer beyond 64 bits: %s" % (text if len(text) <= 20 else text[:20] + "..."))
    return value


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether JSON containers in ``value`` nest more than ``limit`` deep (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


# The most elements a tensor proto may make of one value. A proto may hold
# a single value for a tensor whose values are all equal (``make_ndarray``
# repeats it); the writers here write none (a numerics record's tensor holds
# its 11 values, a packed block its rows, a scalar or an action one value),
# and a shape of 2**40 over one 8-byte value would be 8 TiB to allocate.
MAX_BROADCAST = 1024


def check_tensor_size(tensor: tensor_pb2.TensorProto) -> None:
    """Refuses a tensor proto whose shape claims more elements than it holds
    values for, beyond ``MAX_BROADCAST``, before anything is allocated.

    Raises:
      ValueError: a negative dimension, or such a shape.
    """
    dims = [d.size for d in tensor.tensor_shape.dim]
    if any(d < 0 for d in dims):
        raise ValueError("a tensor of shape %s: a negative dimension" % _clip(dims))
    size = math.prod(dims)
    if tensor.tensor_content or size <= MAX_BROADCAST:
        return
    # Every *_val field is repeated, one entry per element (two for a complex
    # one), but float8_val: bytes, one per element.
    held = sum(len(v) for f, v in tensor.ListFields() if f.name.endswith("_val"))
    if size > held:
        raise ValueError("a tensor of shape %s (%d elements) holding %d value(s): refused, a record repeats no "
                         "value more than %d times" % (_clip(dims), size, held, MAX_BROADCAST))


# A packed block's table: (tag, info) of each row index, in index order.
BlockTable = tuple[tuple[str, TensorInfo], ...]


def parse_plugin_metadata(content: bytes, description: str = "") -> TensorInfo:
    """Parses the plugin content of a per-tensor numerics summary.

    Raises:
      FormatError: the content is not valid, is of a newer major version,
        or is a packed block's.
    """
    parsed = parse_content(content, description)
    if not isinstance(parsed, TensorInfo):
        raise FormatError("numerics metadata is a packed block's, not a tensor's")
    return parsed


def parse_content(content: bytes, description: str = "") -> TensorInfo | BlockTable:
    """Parses the plugin content of any numerics summary: a tensor's
    ``TensorInfo``, or a packed block's table.

    The last few contents parsed are remembered (what they parse to is
    immutable): every block of a run carries the same table (500 tensors'
    compressed JSON, 63 KB, 1.9 ms to parse), which the blocks then share.

    Args:
      content: the summary metadata's plugin content.
      description: the summary's description (a per-tensor tag's).

    Raises:
      FormatError: the content is not valid, or is of a newer major version.
    """
    if not isinstance(content, (bytes, bytearray)):
        raise FormatError("numerics metadata must be bytes, got %s" % type(content).__name__)
    return _parse_content(bytes(content), description)


@functools.lru_cache(maxsize=32)
def _parse_content(content: bytes, description: str) -> TensorInfo | BlockTable:
    if content[:1] == _ZLIB_FIRST_BYTE:
        content = _inflate(bytes(content))
    raw = parse_json(content, "numerics metadata")
    if not isinstance(raw, dict):
        raise FormatError("numerics metadata must be a JSON object")
    version = raw.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FormatError("numerics metadata has no valid format version: %s" % _clip(version))
    if version > FORMAT_VERSION:
        raise FormatError(
            "numerics record format version %d is newer than this tb-numerics "
            "understands (%d); upgrade tb-numerics to read it" % (version, FORMAT_VERSION)
        )
    if version >= 2 and "tensors" in raw:
        return _parse_table(raw["tensors"], version)
    return _parse_info(raw, description, version)


# A compact block table (zlib's first byte); JSON starts with "{".
_ZLIB_FIRST_BYTE = b"\x78"
# The most bytes a compressed table may inflate to: a table of thousands of
# tensors is well below it, a compression bomb is refused.
_MAX_TABLE_BYTES = 64 << 20


def _inflate(content: bytes) -> bytes:
    d = zlib.decompressobj()
    try:
        out = d.decompress(content, _MAX_TABLE_BYTES)
    except zlib.error as e:
        raise FormatError("numerics metadata is not valid compressed JSON: %s" % e) from None
    if d.unconsumed_tail:
        raise FormatError("numerics metadata inflates to more than %d bytes" % _MAX_TABLE_BYTES)
    return out


def _parse_table(entries: Any, version: int) -> BlockTable:
    if not isinstance(entries, list) or not entries:
        raise FormatError("a packed block's table must be a non-empty list")
    table, seen = [], set()
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("tag"), str) or not entry["tag"]:
            raise FormatError("a packed block's table has an entry without a tag name")
        tag = entry["tag"]
        if tag in seen:
            raise FormatError("a packed block's table names %r twice" % tag)
        seen.add(tag)
        description = entry.get("description") or ""
        if not isinstance(description, str):
            raise FormatError("%s: non-string description in a packed block's table" % tag)
        try:
            table.append((tag, _parse_info(entry, description, version)))
        except FormatError as e:
            raise FormatError("%s: %s" % (tag, e)) from None
    return tuple(table)


def _parse_info(raw: dict[str, Any], description: str, version: int) -> TensorInfo:
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_LIMITS:
        raise FormatError("numerics metadata names an unsupported dtype: %s" % _clip(dtype))
    role = raw.get("role", "other")
    if role not in ROLES:
        role = "other"
    order = raw.get("order", 0)
    if not isinstance(order, int) or isinstance(order, bool):
        raise FormatError("numerics metadata has a non-integer order: %s" % _clip(order))
    shape = raw.get("shape")
    if shape is not None:
        if not isinstance(shape, list) or not all(
            d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in shape
        ):
            raise FormatError("numerics metadata has an invalid shape: %s" % _clip(shape))
        shape = tuple(shape)
    compute_dtype = _text_field(raw, "compute_dtype")
    if compute_dtype and compute_dtype not in DTYPE_LIMITS:
        raise FormatError("numerics metadata names an unsupported compute dtype: %s" % _clip(compute_dtype))
    return TensorInfo(
        dtype=dtype,
        shape=shape,
        role=role,
        order=order,
        op_type=_text_field(raw, "op_type"),
        description=description,
        version=version,
        neginf_ok=raw.get("neginf_ok") is True,
        activation=_text_field(raw, "activation"),
        compute_dtype=compute_dtype,
        squared_by=_text_field(raw, "squared_by"),
    )


def _text_field(raw: dict[str, Any], name: str) -> str:
    """An optional string field of the metadata ("" where absent); any other
    JSON type is refused rather than carried into the ``TensorInfo``."""
    value = raw.get(name) or ""
    if not isinstance(value, str):
        raise FormatError("numerics metadata has a non-string %s: %s" % (name, _clip(value)))
    return value


def _clip(value: Any) -> str:
    """An untrusted value's repr for a problem line, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def create_action_metadata() -> summary_pb2.SummaryMetadata:
    """The summary metadata of an action event (``ACTIONS_TAG``): on every
    event, so that each one is read on its own."""
    content = json.dumps({"version": ACTIONS_FORMAT_VERSION}, separators=(",", ":")).encode("utf-8")
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=ACTIONS_PLUGIN, content=content),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )


def check_action_content(content: bytes) -> None:
    """Checks an action event's plugin content (its format version).

    Raises:
      FormatError: not valid, or of a newer major version than this reader.
    """
    raw = parse_json(content, "action metadata") if content else {}
    version = raw.get("version") if isinstance(raw, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FormatError("action metadata has no valid format version: %s" % _clip(version))
    if version > ACTIONS_FORMAT_VERSION:
        raise FormatError("action format version %d is newer than this tb-numerics understands (%d); upgrade "
                          "tb-numerics to read it" % (version, ACTIONS_FORMAT_VERSION))
