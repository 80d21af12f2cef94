"""Response, message and call ids: ``<prefix><hex>`` from a fast non-cryptographic generator.

Ids only need to be unique in practice, not unpredictable; ``uuid.uuid4`` reads the OS entropy
pool on every call, which costs up to hundreds of microseconds on a busy VM — per request.
"""

from __future__ import annotations

import random

_random = random.Random()


def random_id(prefix: str, num_hex_digits: int = 24) -> str:
    return f"{prefix}{_random.getrandbits(4 * num_hex_digits):0{num_hex_digits}x}"
