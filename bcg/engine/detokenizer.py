"""Output text grown token by token, cut at the first stop string.

The Rust `tokenizers` DecodeStream does the incremental decoding: it keeps the window of
recent tokens needed to get merged spaces and multi-token characters right, and yields
nothing while a character is still incomplete. It costs a few microseconds a token, about
a quarter of decoding the window again in Python, which matters at hundreds of sequences
a step.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, backend: Tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop_str: bool = False) -> None:
        """`backend`: the tokenizer's Rust `tokenizers.Tokenizer` (see `fast_backend`);
        `include_stop_str`: the text keeps the stop string that ended it."""
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Tokens whose bytes do not yet end a character (the stream holds them back).
        self.undecoded: list[int] = []
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self.stop_string: str | None = None  # the stop string found, once one is

    def add(self, token_id: int, may_stop: bool = True) -> bool:
        """Append a token; return True if the text now contains a stop string (then cut).
        With `may_stop` False (before min_tokens) stop strings are not looked for."""
        new_text = self.stream.step(self.backend, token_id)
        if not new_text:
            self.undecoded.append(token_id)
            return False
        self.undecoded.clear()
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += new_text
        return may_stop and self._cut_at_stop(search_from)

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, a tail that may start a stop string is held back;
        once finished, the whole text, bytes that never made a whole character decoded as
        U+FFFD (as a full decode gives them), not dropped."""
        if finished and self.undecoded:
            self.text += self.backend.decode(self.undecoded,
                                             skip_special_tokens=self.skip_special_tokens)
            self.undecoded.clear()
        if finished or not self.max_stop_len:
            return self.text
        return self.text[: max(0, len(self.text) - self.max_stop_len + 1)]

    def _cut_at_stop(self, search_from: int) -> bool:
        """Cut the text at the stop string that starts first (the first listed, of those
        starting there)."""
        found = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not found:
            return False
        start, self.stop_string = min(found, key=lambda match: match[0])
        end = start + len(self.stop_string) if self.include_stop_str else start
        self.text = self.text[:end]
        return True


def fast_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind `tokenizer`, or a ValueError saying what to do."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no fast (Rust) backend, which text output needs: "
            "pass a tokenizer with a tokenizer.json (tokenizer=... / --tokenizer)"
        )
    return backend
