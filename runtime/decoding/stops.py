"""Stop strings on streamed text: the text never includes them, even when one spans
pieces, tokens or rounds."""
from __future__ import annotations


class StopMatcher:
    """Feed text pieces; get back what is safe to emit and whether a stop string hit.

    Text that could be the start of a stop string is held back until it is decided.
    >>> m = StopMatcher(["###"])
    >>> m.feed("ab#"), m.feed("#"), m.feed("#c")
    (('ab', False), ('', False), ('', True))
    """

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
