"""A growing output's text, decoding a few tokens per step instead of the whole output.

Decoding everything on every step costs O(n) per step, O(n²) per request: at 2,000 tokens that
is milliseconds a step on a CPU. Only a window is decoded: from the last point whose text is
settled. Token boundaries inside a multi-byte character or a word piece make a window's decode
differ from the whole's at its edges, so the window starts one chunk before the tokens whose
text is new, and text is only taken once it does not end in an unfinished character. The final
text is the whole output decoded once, exactly what a full decode gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass
class IncrementalText:
    text: str = ""
    window: int = 0  # first token decoded each step (start of the last settled chunk)
    read: int = 0  # tokens whose text is in ``text``

    def update(self, tokenizer: PreTrainedTokenizerBase, ids: list[int], final: bool) -> str:
        """The text of ``ids`` (the previous call's ids plus new ones); exact when ``final``."""
        if final:
            self.text = tokenizer.decode(ids, skip_special_tokens=True)
            self.window = self.read = len(ids)
            return self.text
        settled = tokenizer.decode(ids[self.window : self.read], skip_special_tokens=True)
        current = tokenizer.decode(ids[self.window :], skip_special_tokens=True)
        if len(current) > len(settled) and not current.endswith("\ufffd"):
            self.text += current[len(settled) :]
            self.window, self.read = self.read, len(ids)
        return self.text
