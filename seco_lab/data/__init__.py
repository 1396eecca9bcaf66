"""Training data without downloads, handed out deterministically from (seed, split, index).

* :mod:`.sources`      -- the synthetic key->value task and byte-level text corpora
* :mod:`.token_corpus` -- text tokenized with a real model's tokenizer, packed the same way
"""

__all__: list[str] = []
