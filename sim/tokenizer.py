"""Deterministic text <-> token ids for the simulated server.

Why this shape: the real e2e server (docs/real-vllm.md) serves a tiny model
whose tokenizer is a WordLevel vocabulary ``t3 .. t<vocab-1>`` over
whitespace-split words. We reproduce it exactly for such words, so text
prompts give the same ids on the simulator and on the real server, and extend
it to any other word with a stable hash:

- a prompt is split on whitespace;
- a word ``t<N>`` with ``FIRST_REGULAR_TOKEN_ID <= N < vocab_size`` is id N;
- any other word is ``FIRST_REGULAR_TOKEN_ID + crc32(utf-8 word) % (vocab_size - FIRST_REGULAR_TOKEN_ID)``
  (zlib.crc32: stable across runs and machines, unlike ``hash(str)``);
- no special tokens are added (the real tiny tokenizer adds no BOS either);
- decoding maps id N to the word ``t<N>`` and joins with single spaces, so
  ``decode(encode(text)) == text`` for text made of ``t<N>`` words. Special ids
  (below ``FIRST_REGULAR_TOKEN_ID``, EOS included) decode to nothing, as with
  ``skip_special_tokens``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from misat_sim.request import FIRST_REGULAR_TOKEN_ID


class WordTokenizer:
    """Whitespace word tokenizer with a fixed vocabulary size (see module docstring)."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None) -> None:
        if vocab_size <= FIRST_REGULAR_TOKEN_ID:
            raise ValueError("vocab_size must exceed the special ids")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._span = vocab_size - FIRST_REGULAR_TOKEN_ID

    def word_id(self, word: str) -> int:
        """Id of one word."""
        if word.startswith("t") and word[1:].isdigit():
            n = int(word[1:])
            if FIRST_REGULAR_TOKEN_ID <= n < self.vocab_size:
                return n
        return FIRST_REGULAR_TOKEN_ID + zlib.crc32(word.encode("utf-8")) % self._span

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return [self.word_id(w) for w in text.split()]

    def token_str(self, token_id: int) -> str:
        """The word for one id (empty for special ids)."""
        if token_id < FIRST_REGULAR_TOKEN_ID or token_id == self.eos_token_id:
            return ""
        return f"t{token_id}"

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ids: words joined by spaces, special ids skipped."""
        eos = self.eos_token_id
        return " ".join(f"t{t}" for t in token_ids if t >= FIRST_REGULAR_TOKEN_ID and t != eos)

    def decode_delta(self, token_ids: Sequence[int], is_first: bool) -> str:
        """Text of ids appended to earlier output (a leading space unless first)."""
        text = self.decode(token_ids)
        if text and not is_first:
            return " " + text
        return text


def render_chat(messages: Sequence[dict[str, object]]) -> str:
    """The trivial chat template: ``role: content`` lines, then ``assistant:``.

    Content given as a list of parts keeps the text parts. Stands in for a
    model's chat template; only its determinism and growth with the
    conversation matter to the simulator.
    """
    lines: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            text = " ".join(
                str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        else:
            text = "" if content is None else str(content)
        lines.append(f"{m.get('role', 'user')}: {text}")
    lines.append("assistant:")
    return "\n".join(lines)
