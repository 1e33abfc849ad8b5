"""Incremental detokenization and stop strings, for streams of generated token ids.

`IncrementalDetokenizer` turns token ids into text deltas whose concatenation equals decoding all
ids at once. It keeps a small window (prefix_offset..read_offset) and withholds text while the
window ends in an incomplete UTF-8 character (decoded as U+FFFD), so a multi-byte character split
across tokens is emitted whole, once.

`StopStringMatcher` finds stop strings in the accumulated text; while the text's tail could still
become a stop string, that tail is held back from the stream. As in vLLM, stop strings are not
checked while the output is shorter than `min_tokens`: a stop string that ends in the text of
those first tokens never stops the stream; one that ends in a later token's text does.
"""

from __future__ import annotations

from common.tokenizer import TextTokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Add generated tokens; return the text that became final."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of the stream: whatever is still withheld (it may hold U+FFFD)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""


class StopStringMatcher:
    def __init__(self, stop: tuple[str, ...] | list[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.text = ""
        self.emitted = 0  # characters of `text` already released to the client
        self.stopped = False

    def push(self, delta: str, check: bool = True) -> str:
        """Add text; return what can be released now. After a stop string, returns "".
        With `check` False the text is added but not searched: a match must end in text pushed
        with `check` (min_tokens)."""
        if self.stopped or not delta:
            return ""
        start = len(self.text)
        self.text += delta
        if not check:
            return self._release(len(self.text) - self._held_back())
        # a match ends in the new text: it starts at most len(stop) - 1 characters before it
        cut = min((i for i in (self.text.find(s, max(0, start - len(s) + 1)) for s in self.stop)
                   if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def finish(self) -> str:
        """At the end of the stream: release what was held back."""
        return "" if self.stopped else self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        released, self.emitted = self.text[self.emitted:upto], upto
        return released


class TextStream:
    """One generation's text: incremental detokenization, then stop strings, which count only
    from the `min_tokens`-th output token on."""

    def __init__(self, tokenizer: TextTokenizer, stop: tuple[str, ...], min_tokens: int = 0
                 ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = StopStringMatcher(stop)
        self.min_tokens = min_tokens
        self.num_tokens = 0  # output tokens pushed so far

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def push(self, token_ids: list[int], finished: bool) -> str:
        """New text to release (`token_ids`: the next output tokens); with `finished`,
        everything still held back too."""
        if self.num_tokens >= self.min_tokens:
            self.num_tokens += len(token_ids)
            text = self.stops.push(self.detokenizer.push(token_ids))
        else:  # token by token until min_tokens: the check starts with that token's text
            text = ""
            for token in token_ids:
                self.num_tokens += 1
                text += self.stops.push(self.detokenizer.push([token]),
                                        self.num_tokens >= self.min_tokens)
        if finished:
            text += self.stops.push(self.detokenizer.flush()) + self.stops.finish()
        return text
