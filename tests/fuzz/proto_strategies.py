"""Hypothesis strategies for protobuf messages, built from a message descriptor: every field of
every type (scalars over their whole range, NaN and infinities, unknown enum numbers, repeated
and map fields, oneofs, nested messages down to a depth, well-known types by their own
fields, so a Duration may be out of range and a Value may hold no kind), and wire bytes that
are not a message at all."""

from collections.abc import Mapping

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

# Strings of any Unicode a proto string can hold (protobuf refuses lone surrogates), with the
# spellings of the chat templates' control tokens and tool-call markup among them.
MARKUP = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    '{"name": "calculator", "arguments": {"expression": "1+1"}}',
)
TEXTS = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=40),
    st.sampled_from(MARKUP),
)
MAX_REPEATED = 3
# Bounds of each integer kind on the wire.
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def messages(
    descriptor: Descriptor,
    hints: Mapping[str, st.SearchStrategy] | None = None,
    max_depth: int = 4,
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type, each field set or left unset at random.

    `hints` maps a field's full name (`turnrl.v1.ExecuteRequest.tool_name`) to the strategy
    of its value (a list for a repeated field, a dict for a map; None leaves it unset): values
    that reach deeper into a service (a tool it serves) or keep a call cheap or safe (a small
    `n`, a loopback address). Nested messages below `max_depth` stay empty.
    """
    message_class = message_factory.GetMessageClass(descriptor)
    hints = dict(hints or {})
    if max_depth <= 0:
        return st.just(message_class())
    fields = {
        field.name: hints[field.full_name]
        if field.full_name in hints
        else st.one_of(st.none(), _values(field, hints, max_depth))
        for field in descriptor.fields
    }
    return st.fixed_dictionaries(fields).map(lambda values: _build(message_class, values))


def _build(message_class: type[Message], values: dict) -> Message:
    message = message_class()
    for name, value in values.items():
        if value is None:
            continue
        field = message.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name) if field.is_repeated else None
        if _is_map(field):
            for key, item in value.items():
                if isinstance(item, Message):
                    target[key].CopyFrom(item)
                else:
                    target[key] = item
        elif field.is_repeated and field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        elif field.is_repeated:
            target.extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def _values(field: FieldDescriptor, hints: Mapping, max_depth: int) -> st.SearchStrategy:
    """Values of one field: a dict for a map, a list for a repeated field."""
    if _is_map(field):
        key_field, value_field = field.message_type.fields
        return st.dictionaries(
            _scalar(key_field, hints, max_depth),
            _scalar(value_field, hints, max_depth - 1),
            max_size=MAX_REPEATED,
        )
    item = _scalar(field, hints, max_depth - 1)
    if field.is_repeated:
        return st.lists(item, max_size=MAX_REPEATED)
    return item


def _scalar(field: FieldDescriptor, hints: Mapping, max_depth: int) -> st.SearchStrategy:
    kind = field.type
    if kind == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, hints, max_depth)
    if kind == FieldDescriptor.TYPE_ENUM:
        known = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        return st.integers(low, high)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if kind == FieldDescriptor.TYPE_STRING:
        return TEXTS
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    raise AssertionError(f"unhandled field type {kind} of {field.full_name}")


def _is_map(field: FieldDescriptor) -> bool:
    return (
        field.is_repeated
        and field.type == FieldDescriptor.TYPE_MESSAGE
        and field.message_type.GetOptions().map_entry
    )


def mostly(usual: st.SearchStrategy, other: st.SearchStrategy) -> st.SearchStrategy:
    """`usual` three times in four, else `other`: a request gets past one check to the next
    often enough that the next is tested too."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda ok: usual if ok else other)


def damaged(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Bytes that may not parse: a valid encoding cut short, one with bytes overwritten, or
    random bytes."""

    @st.composite
    def cut_or_overwritten(draw) -> bytes:
        data = draw(valid)
        if not data:
            return draw(st.binary(min_size=1, max_size=40))
        if draw(st.booleans()):
            return data[: draw(st.integers(0, len(data) - 1))]
        position = draw(st.integers(0, len(data) - 1))
        patch = draw(st.binary(min_size=1, max_size=4))
        return data[:position] + patch + data[position + len(patch) :]

    return st.one_of(cut_or_overwritten(), st.binary(max_size=64))
