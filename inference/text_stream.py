"""Incremental detokenization with stop strings.

Tokens arrive one at a time; text must be emitted as soon as it is final. Two things make text not
yet final: a trailing incomplete UTF-8 sequence (decoded as U+FFFD) and a tail that could still
grow into a stop string. Both are held back; everything before them is released.

Decoding is incremental, in constant work per token, the way ``tokenizers.decoders.DecodeStream``
does it (whose own API cannot flush a held-back tail at the end of a generation, hence this copy):
only a short window of ids is decoded each time, ``decode(window + pending)`` minus
``decode(window)``, where the window is the group of tokens committed last (a few ids) and
``pending`` the tokens since. The text of the pending tokens is committed once it no longer ends in
U+FFFD; the window then moves up. Because the window always starts on a character boundary, and
decoders' one-off edits (SentencePiece's leading-space strip) apply to both decodes alike, the
pieces add up to ``tokenizer.decode(all ids)``. Stop strings are searched for only in the last
few characters, where the new token could have completed one.
"""

from __future__ import annotations

from collections.abc import Sequence

from elesium.inference.weights.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class TextStream:
    """Accumulates generated tokens, reports newly final text, and detects stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of ``text`` already released
        self.stopped = False
        self._keep = max((len(s) for s in self.stop), default=0)  # committed chars kept for stop checks
        self._pieces: list[str] = []  # committed text, in pieces (joined lazily)
        self._committed = 0  # len of the committed text
        self._tail = ""  # its last ``_keep`` characters
        self._pending = ""  # text of the tokens since the last commit (may end in U+FFFD)
        self._window_start = 0  # index into token_ids where the decode window starts
        self._pending_start = 0  # index into token_ids of the first uncommitted token
        self._window_text = ""  # decode(token_ids[_window_start:_pending_start])
        self._stopped_text: str | None = None

    @property
    def text(self) -> str:
        """Everything decoded so far (cut before the stop string once one matched)."""
        if self._stopped_text is not None:
            return self._stopped_text
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return (self._pieces[0] if self._pieces else "") + self._pending

    def push(self, token: int) -> str:
        """Add one token; return the text that became final. Sets ``stopped`` on a stop string."""
        self.token_ids.append(token)
        new = self._decode_pending()
        # ``view`` is the end of the full text: the kept committed tail, then the pending text.
        view = self._tail + new
        offset = self._committed - len(self._tail)  # position of view[0] in the full text
        for s in self.stop:
            # Only search where the new text could have completed a stop string.
            at = view.find(s, max(0, self._committed - len(s) + 1) - offset)
            if at != -1:
                self.stopped = True
                self._stopped_text = self._committed_text()[:offset] + view[:at]
                return self.flush()
        self._pending = new
        final = len(view)
        if view.endswith(_REPLACEMENT):
            final = len(view.rstrip(_REPLACEMENT))
        for s in self.stop:
            for k in range(min(len(s) - 1, final), 0, -1):
                if view[:final].endswith(s[:k]):
                    final = min(final, final - k)
                    break
        out = ""
        if offset + final > self.emitted:
            if self.emitted >= offset:
                out = view[self.emitted - offset:final]
            else:  # released text ends before the kept tail (cannot happen with the tail kept above)
                out = (self._committed_text()[:offset] + view)[self.emitted:offset + final]
            self.emitted = offset + final
        if not new.endswith(_REPLACEMENT):
            self._commit(new)
        return out

    def flush(self) -> str:
        """Release everything held back (the generation is over)."""
        text = self.text
        out = text[self.emitted:]
        self.emitted = len(text)
        return out

    def _decode_pending(self) -> str:
        """Text of the tokens since the last commit, decoded in the context of the window before them."""
        decoded = self.tokenizer.decode(self.token_ids[self._window_start:])
        if decoded.startswith(self._window_text):
            return decoded[len(self._window_text):]
        # A decoder whose output for the window changes with what follows (none of ours): fall back to
        # the full decode, which is always right.
        full = self.tokenizer.decode(self.token_ids)
        committed = self._committed_text()
        if not full.startswith(committed):
            raise RuntimeError("the tokenizer's decoding of earlier tokens changed as more arrived")
        return full[len(committed):]

    def _commit(self, new: str) -> None:
        if new:
            self._pieces.append(new)
            self._committed += len(new)
            self._tail = (self._tail + new)[-self._keep:] if self._keep else ""
        self._pending = ""
        end = len(self.token_ids)
        self._window_start, self._pending_start = self._pending_start, end
        self._window_text = self.tokenizer.decode(self.token_ids[self._window_start:end])

    def _committed_text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""
