"""One sequence's generated tokens as text: where it ends, and how much of it is final while it streams."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One generated continuation.

    finish_reason is "stop" (an end-of-sequence token or a stop string) or "length" (max_new_tokens
    reached); completion_tokens counts the tokens generated, the end-of-sequence token included.
    task is the correction that applied (None: none); confidence is the router's, for routed sequences.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    task: str | None = None
    confidence: float | None = None


class SequenceText:
    """The tokens one sequence generates, decoded as they come.

    `add` takes the next token and says what text became final and whether the sequence is done: at an
    end-of-sequence token, at a stop string (cut before it, never returned), or at `max_tokens`. Text is
    final once no later token can change it: a possible beginning of a stop string and an unfinished
    UTF-8 character (decoded as U+FFFD) are held back until the next tokens decide them. Without stop
    strings and streaming, nothing is decoded until the end.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int], stop: tuple[str, ...],
                 max_tokens: int, stream: bool) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stop = stop
        self.max_tokens = max_tokens
        self.decodes = stream or bool(stop)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.count = 0  # tokens generated, an end-of-sequence token included
        self.text: str | None = None  # the whole text, once done
        self.sent = ""  # the final text handed out so far

    def add(self, token: int) -> tuple[str, str | None]:
        """The newly final text ("" if none) and the finish reason (None while the sequence goes on)."""
        self.count += 1
        if token in self.eos_ids:
            return "", "stop"
        self.tokens.append(token)
        if not self.decodes:
            return "", "length" if self.count >= self.max_tokens else None
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [text.find(s) for s in self.stop if s in text]
        if hits:
            self.text = text[: min(hits)]
            return "", "stop"
        # The last `hold` characters wait (a stop string may begin there); a text shorter than that waits whole: a
        # negative end would hand out its beginning, which a stop string may still take.
        final = text[: max(0, len(text) - self.hold)].rstrip("\ufffd")
        delta = ""
        if len(final) > len(self.sent) and final.startswith(self.sent):
            delta, self.sent = final[len(self.sent):], final
        return delta, "length" if self.count >= self.max_tokens else None

    def completion(self, prompt_tokens: int, finish_reason: str) -> Completion:
        """The finished sequence; `rest` then holds the text not yet handed out."""
        if self.text is None:
            self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return Completion(self.text, prompt_tokens, self.count, finish_reason)

    def rest(self) -> str:
        """The finished text after what was handed out, so that the pieces add up to the completion's text."""
        if not self.text.startswith(self.sent):
            # Only a tokenizer whose decoding of a prefix is not a prefix of the whole does this.
            logger.warning("streamed text %r is not a prefix of the completion %r", self.sent, self.text)
            return ""
        return self.text[len(self.sent):]
