"""The one factor that maps the paper's production trace onto simulated engines.

Token lengths from the paper's trace (``docs/misa-t.md``) and real engines' KV
capacities are both multiplied by ``DEFAULT_LENGTH_SCALE``, so the ratio of
session size to KV capacity, which is what admission is about, is preserved,
while a 128K-token RLVR rollout becomes 8K tokens and simulates quickly.
"""

DEFAULT_LENGTH_SCALE: float = 1.0 / 16.0
"""Tokens are scaled by 1/16 (as in the reference model in misa-t.md)."""
