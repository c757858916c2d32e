"""``ts.handler_utils.text_utils``: torchtext's ``ngrams_iterator`` and ``get_tokenizer``
(``None`` and ``"basic_english"``), without torchtext."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

#: torchtext's basic_english normalisation, in order: quotes spaced or dropped, sentence
#: punctuation spaced, HTML line breaks and ;: turned into spaces, spaces collapsed.
_BASIC_ENGLISH = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"\'", " '  "), (r"\"", ""), (r"\.", " . "), (r"<br \/>", " "), (r",", " , "),
    (r"\(", " ( "), (r"\)", " ) "), (r"\!", " ! "), (r"\?", " ? "), (r"\;", " "),
    (r"\:", " "), (r"\s+", " "))]


def ngrams_iterator(token_list: Sequence[str], ngrams: int) -> Iterator[str]:
    """The tokens, then every run of 2..``ngrams`` consecutive tokens joined by a space
    (all bigrams before any trigram)."""
    yield from token_list
    for size in range(2, ngrams + 1):
        for start in range(len(token_list) - size + 1):
            yield " ".join(token_list[start:start + size])


def _basic_english_normalize(line: str) -> list[str]:
    line = line.lower()
    for pattern, replacement in _BASIC_ENGLISH:
        line = pattern.sub(replacement, line)
    return line.split()


def _split_tokenizer(line: str) -> list[str]:
    return line.split()


def get_tokenizer(tokenizer: str | Callable[[str], list[str]] | None,
                  language: str = "en") -> Callable[[str], list[str]]:
    """A function from a sentence to its tokens: ``None`` splits on white space;
    ``"basic_english"`` lower-cases and separates punctuation first (English only); a
    callable is returned as it is. Other torchtext tokenizers (spacy, moses, ...) are not
    provided (ValueError)."""
    if tokenizer is None:
        return _split_tokenizer
    if callable(tokenizer):
        return tokenizer
    if tokenizer == "basic_english":
        if language != "en":
            raise ValueError("Basic normalization is only available for English (en)")
        return _basic_english_normalize
    raise ValueError(f"tokenizer {tokenizer!r} is not provided here: use None, "
                     f"'basic_english' or a function")
