"""One sequence's generated tokens as text: where it ends, and how much of it is final while it streams."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def _backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The tokenizers library's tokenizer behind a fast tokenizer whose decoding of a text's tokens is the
    concatenation of its tokens' pieces (no clean-up of spaces around punctuation afterwards), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    return None


@dataclass(frozen=True)
class Completion:
    """One generated continuation.

    finish_reason is "stop" (an end-of-sequence token or a stop string) or "length" (max_new_tokens
    reached); completion_tokens counts the tokens generated, the end-of-sequence token included.
    task is the correction that applied (None: none); confidence is the router's, for routed sequences.
    token_ids: the tokens generated, an end-of-sequence token left out (a stop string's kept).
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    task: str | None = None
    confidence: float | None = None
    token_ids: tuple[int, ...] = ()


class SequenceText:
    """The tokens one sequence generates, decoded as they come.

    `add` takes the next token and says what text became final and whether the sequence is done: at an
    end-of-sequence token, at a stop string (cut before it, never returned), or at `max_tokens`. Text is
    final once no later token can change it: a possible beginning of a stop string and an unfinished
    UTF-8 character (decoded as U+FFFD) are held back until the next tokens decide them. Without stop
    strings and streaming, nothing is decoded until the end. A fast tokenizer decodes each token once, by the
    tokenizers library's streaming decoder, and stop strings are looked for in the text's new end only: a token
    costs the same at the answer's end as at its start (re-decoding the whole text each token made a long answer's
    decoding quadratic). Others re-decode the whole text each token.
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
        self.backend = _backend(tokenizer)
        self.stream = DecodeStream(skip_special_tokens=True) if self.backend is not None else None
        self.decoded = ""  # with the streaming decoder: the text of the tokens so far
        self.searched = 0  # characters of the text already searched for stop strings

    def add(self, token: int) -> tuple[str, str | None]:
        """The newly final text ("" if none) and the finish reason (None while the sequence goes on)."""
        self.count += 1
        if token in self.eos_ids:
            return "", "stop"
        self.tokens.append(token)
        if not self.decodes:
            return "", "length" if self.count >= self.max_tokens else None
        if self.stream is not None:
            # None while the token ends inside a character: the next tokens finish it.
            self.decoded += self.stream.step(self.backend, token) or ""
            text = self.decoded
        else:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        # A stop string ends in the new text: search from where one could start that ends there.
        start = max(0, self.searched - self.hold)
        hits = [found for s in self.stop if (found := text.find(s, start)) >= 0]
        self.searched = len(text)
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
        return Completion(self.text, prompt_tokens, self.count, finish_reason, token_ids=tuple(self.tokens))

    def rest(self) -> str:
        """The finished text after what was handed out, so that the pieces add up to the completion's text."""
        if not self.text.startswith(self.sent):
            # Only a tokenizer whose decoding of a prefix is not a prefix of the whole does this.
            logger.warning("streamed text %r is not a prefix of the completion %r", self.sent, self.text)
            return ""
        return self.text[len(self.sent):]
