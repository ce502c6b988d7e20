"""``--prompt-kind edit``: requests whose answers copy their prompt, the workload
speculative decoding is for (docs/speculative_decoding.md). Each asks the model to return a
short passage with its spelling corrected; the passages are cadence's own."""

from __future__ import annotations

import random
from typing import Any

PROMPT_KINDS = ("random", "edit")

INSTRUCTION = ("Return the following text in full with its spelling mistakes corrected. "
               "Change nothing else.\n\n")

PASSAGES = (
    ("The old ferry crosed the river twice a day, once at dawn and once before dark. Farmers "
     "brought their carts of cabbages and apples, and the children waved at the fish that "
     "followed the boat. In winter the river froze at the edges and the ferryman broke the "
     "ice with a long pole before every crossing."),
    ("To bake a simple loaf, mix flour, water, salt and a little yeast untill the dough is "
     "smooth. Leave it covered in a warm place for two hours, then shape it and let it rise "
     "again. Bake it in a hot oven for forty minutes, and wait for it to cool before you "
     "cut it, however hard that is."),
    ("The libary opened at nine and closed at six, except on Thursdays, when it stayed open "
     "late for the reading group. The group read one book a month and argued about the "
     "ending every time. Nobody could remember a month when they had all agreed."),
    ("A good map shows what you need and leaves out the rest. A walker needs the paths, the "
     "streams and the height of the hills; a driver needs the roads and the petrol stations. "
     "The same valley can be drawn a dozen diferent ways, and each of them is true."),
    ("The team met every morning for ten minutes to say what they had finished, what they "
     "would do next and what was in their way. The meetings were short because everyone "
     "stood up. When a problem needed more time, two or three people stayed behind and "
     "solved it together."),
    ("Tides are caused mostly by the pull of the moon, with some help from the sun. When the "
     "two line up, the tides are higher than usual; when they pull at right angles, the "
     "tides are weaker. Sailors have used tide tables for centurys to plan when to leave "
     "the harbour."),
    ("The garden was small but it was never empty. In spring there were tulips along the "
     "wall, in summer the beans climbed up their sticks, and in autum the apple tree dropped "
     "more fruit than the family could eat. The neighbours were always happy to take the "
     "rest."),
    ("Before the bridge was built, the only way to reach the island was a narrow path that "
     "flooded at high tide. Visitors who forgot to check the time had to wait for hours on "
     "the rocks. The bridge took three years to finish and the whole village came to its "
     "opening."),
)


def edit_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """``count`` prompt token ids, passages in a seeded order, through the chat template
    where the tokenizer has one."""
    if tokenizer is None:
        raise ValueError("--prompt-kind edit needs the model's tokenizer")
    rng = random.Random(seed)
    order = [rng.randrange(len(PASSAGES)) for _ in range(count)]
    template = getattr(tokenizer, "chat_template", None)
    out = []
    for i in order:
        text = INSTRUCTION + PASSAGES[i]
        if template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out
