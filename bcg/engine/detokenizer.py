"""Output text grown token by token, cut at the first stop string.

Decoding a growing window (not single tokens) keeps multi-token characters and merged
spaces right; a window that ends inside a character (U+FFFD) waits for the next token.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: decoded for context, not emitted again
        self._read_offset = 0  # tokens before this are already in `text`

    def add(self, token_id: int) -> bool:
        """Append a token; return True if the text now contains a stop string (then cut)."""
        self.token_ids.append(token_id)
        known = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset :])
        if len(window) <= len(known) or window.endswith("\ufffd"):
            return False
        new_text = window[len(known) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += new_text
        return self._cut_at_stop(search_from)

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, a tail that may start a stop string is held back."""
        if finished or not self.max_stop_len:
            return self.text
        return self.text[: max(0, len(self.text) - self.max_stop_len + 1)]

    def _cut_at_stop(self, search_from: int) -> bool:
        found = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
        return bool(found)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
