"""Stop strings (OpenAI's `stop`): text that ends a turn once the model's output spells it.

The turn keeps every sampled id, the ones that spell the stop string included: the trainer
trains on exactly what was sampled, and only the text shown to the caller leaves the stop
string out. Text is decoded from a tail of the output only, as long as the longest stop string
can need, so a check costs the same however long the turn is.
"""

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]


def tail_length(stop_strings: Sequence[str]) -> int:
    """How many trailing ids hold every stop string the newest id can complete: a token spells
    at least one byte, so a stop string of n bytes lies within the last n ids; one more, as
    SentencePiece decoders drop the leading space of the first id they decode."""
    return max(len(text.encode()) for text in stop_strings) + 1


def find_stop(text: str, stop_strings: Sequence[str]) -> int:
    """Where the earliest stop string in `text` begins; -1 when it holds none."""
    starts = [start for start in (text.find(stop) for stop in stop_strings) if start >= 0]
    return min(starts, default=-1)


def ends_on_stop_string(decode: Decode, output_ids: list[int], stop_strings: Sequence[str]) -> bool:
    """Whether the output's tail spells a stop string. Checked after every sampled id, it is
    true first right after the id that completes one."""
    if not stop_strings:
        return False
    tail = output_ids[-tail_length(stop_strings) :]
    return find_stop(decode(tail), stop_strings) >= 0


def stop_string_token_count(
    decode: Decode, output_ids: list[int], stop_strings: Sequence[str]
) -> int:
    """How many trailing ids spell the stop string a turn ended on: the fewest whose text holds
    one (an id that spells text before it too is counted); 0 when the tail holds none."""
    if not stop_strings:
        return 0
    for count in range(1, min(tail_length(stop_strings), len(output_ids)) + 1):
        if find_stop(decode(output_ids[-count:]), stop_strings) >= 0:
            return count
    return 0
