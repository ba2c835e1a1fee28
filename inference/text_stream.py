"""Incremental detokenization with stop strings.

Tokens arrive one at a time; text must be emitted as soon as it is final. Two things make text not
yet final: a trailing incomplete UTF-8 sequence (decoded as U+FFFD) and a tail that could still
grow into a stop string. Both are held back; everything before them is released.
"""

from __future__ import annotations

from collections.abc import Sequence

from elesium.inference.weights.tokenizer import Tokenizer


class TextStream:
    """Accumulates generated tokens, reports newly final text, and detects stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the text that became final. Sets ``stopped`` on a stop string."""
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids)
        for s in self.stop:
            # Only search where the new token could have completed a stop string.
            at = text.find(s, max(0, len(self.text) - len(s) + 1))
            if at != -1:
                self.stopped = True
                self.text = text[:at]
                return self.flush()
        self.text = text
        final = len(text)
        if text.endswith("\ufffd"):
            final = len(text.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, final), 0, -1):
                if text[:final].endswith(s[:k]):
                    final = min(final, len(text[:final]) - k)
                    break
        if final <= self.emitted:
            return ""
        out = text[self.emitted:final]
        self.emitted = final
        return out

    def flush(self) -> str:
        """Release everything held back (the generation is over)."""
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out
