"""A streamed turn's content while the engine samples it: the text the gateway may send before
the turn ends, which must be where the recorded message's content begins (`sessions.py` makes
that message from the whole turn, its tool calls parsed out).

The text is made as the recorded message's is (`ConversationTokens.model_turn_text` of the ids
so far, so no stop token is text), and streamed up to what may still change or leave the
content:
- a trailing U+FFFD: an incomplete UTF-8 character or token piece, which the next id completes;
- trailing whitespace: the parser strips it before a call, and a tokenizer that cleans up
  spaces (" ." to ".", " 's" to "'s": transformers' `clean_up_tokenization_spaces`, which it
  applies to WordPiece tokenizers only) drops a space once the next token comes, so with such
  a tokenizer everything from the last space on waits;
- the start of a stop string, or, when the request has tools, of a call's opening
  (`parsers.CALL_OPENINGS`); once one is written whole nothing more streams, as what follows
  may be a call;
- with tools, all text that begins with whitespace: the parser strips it when the turn holds a
  call and keeps it when not, which only the end tells. So does a parser with no openings
  listed: it streams no content.
The content's rest follows once the turn is recorded (`replies.turn_deltas`).
"""

from collections.abc import Callable
from typing import Any

from rollout_svc.gateway.requests import ChatCompletionRequest
from rollout_svc.parsers import CALL_OPENINGS, ParsedTurn
from turnrl.chat_tokens import ConversationTokens

REPLACEMENT_CHARACTER = "\ufffd"


class StreamedContent:
    """The content of one turn as its ids arrive (`extend`), handed out in deltas (`delta`)
    that join into `sent`."""

    def __init__(
        self,
        tokens: ConversationTokens,
        request: ChatCompletionRequest,
        parser: Callable[[str], ParsedTurn],
        tokenizer: Any,
    ) -> None:
        """The content of a turn of the conversation `tokens` for `request`, whose calls
        `parser` reads; `tokenizer` is the one `tokens` decodes with."""
        self._tokens = tokens
        self._ids: list[int] = []
        self._calls_tools = request.calls_tools
        openings = CALL_OPENINGS.get(parser) if request.calls_tools else ()
        self._streams = openings is not None
        self._markers = (*(openings or ()), *request.stop_strings)
        self._cleans_up_spaces = _cleans_up_spaces(tokenizer)
        self._marker_written = False
        self.sent = ""

    def extend(self, ids: list[int]) -> None:
        """Adds ids the engine sampled."""
        self._ids += ids

    def delta(self) -> str:
        """The content written since the last delta that is sure to stay; "" when none. Costs
        a decode of the whole turn so far; the stream asks once per wake-up, for all the ids
        that came meanwhile."""
        if not self._streams or self._marker_written or not self._ids:
            return ""
        sure = self._sure_text(self._tokens.model_turn_text(self._ids))
        if len(sure) <= len(self.sent):  # a space cleaned up can end the sure text earlier
            return ""
        assert sure.startswith(self.sent), (self.sent, sure)
        delta, self.sent = sure[len(self.sent) :], sure
        return delta

    def _sure_text(self, text: str) -> str:
        text = text.rstrip(REPLACEMENT_CHARACTER)
        if self._calls_tools and text[:1].isspace():
            return ""
        for marker in self._markers:
            if (at := text.find(marker)) >= 0:
                text, self._marker_written = text[:at], True
        text = text[: len(text) - max((_opened(text, m) for m in self._markers), default=0)]
        text = text.rstrip()
        if self._cleans_up_spaces and (space := text.rfind(" ")) >= 0:
            text = text[:space].rstrip()  # the last word may yet take the space before it
        return text


def _opened(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (without being all of it)."""
    return next(
        (n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0
    )


def _cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether decoding drops a space before punctuation, asked of the tokenizer itself (a
    flag set on it is ignored for BPE tokenizers)."""
    return tokenizer.decode(tokenizer.encode("a .", add_special_tokens=False)) == "a."
