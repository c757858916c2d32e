"""``ts.torch_handler.contractions``: English contractions and what they stand for, which
the text handlers expand before tokenising (``CONTRACTION_MAP``: contraction -> expansion).

Built from the words and the endings they take rather than listed one by one; the entries
are lower case, plus the capitalised forms of "I".
"""

from __future__ import annotations

#: Words and their contracted endings -> the expansion's words.
_ENDINGS = {"'d": "would", "'ll": "will", "'ve": "have", "'re": "are", "'s": "is", "'m": "am"}
_SUBJECTS = {
    "i": ("'d", "'ll", "'ve", "'m"),
    "you": ("'d", "'ll", "'ve", "'re"),
    "he": ("'d", "'ll", "'s"),
    "she": ("'d", "'ll", "'s"),
    "it": ("'d", "'ll", "'s"),
    "we": ("'d", "'ll", "'ve", "'re"),
    "they": ("'d", "'ll", "'ve", "'re"),
    "that": ("'d", "'s"),
    "there": ("'d", "'s"),
    "what": ("'ll", "'re", "'s", "'ve"),
    "who": ("'ll", "'s", "'ve"),
    "where": ("'s", "'ve"),
    "when": ("'s", "'ve"),
    "why": ("'s", "'ve"),
    "how": ("'ll", "'s"),
    "y'all": ("'d", "'re", "'ve"),
}
#: Auxiliary verbs that take "n't" regularly (could -> couldn't -> could not).
_NEGATABLE = ("are", "could", "did", "does", "do", "had", "has", "have", "is", "might",
              "must", "need", "ought", "should", "was", "were", "would", "may")
#: Contractions no rule makes.
_IRREGULAR = {
    "ain't": "is not", "can't": "cannot", "won't": "will not", "shan't": "shall not",
    "sha'n't": "shall not", "let's": "let us", "ma'am": "madam", "o'clock": "of the clock",
    "'cause": "because", "y'all": "you all", "how'd": "how did", "how'd'y": "how do you",
    "where'd": "where did", "so's": "so as", "so've": "so have", "to've": "to have",
    "will've": "will have", "could've": "could have", "should've": "should have",
    "would've": "would have", "might've": "might have", "must've": "must have",
}


def _build() -> dict[str, str]:
    table = dict(_IRREGULAR)
    for word in _NEGATABLE:
        negated = "mayn't" if word == "may" else f"{word}n't"
        table[negated] = f"{word} not"
        if word in ("could", "had", "might", "must", "need", "ought", "should", "would"):
            table[f"{negated}'ve"] = f"{word} not have"
    for negated, expansion in (("can't", "cannot"), ("won't", "will not"),
                               ("shan't", "shall not")):
        table[f"{negated}'ve"] = f"{expansion} have"
    for subject, endings in _SUBJECTS.items():
        base = "you all" if subject == "y'all" else subject
        for ending in endings:
            table[f"{subject}{ending}"] = f"{base} {_ENDINGS[ending]}"
            if ending in ("'d", "'ll"):  # he'd've, she'll've: the perfect forms
                table[f"{subject}{ending}'ve"] = f"{base} {_ENDINGS[ending]} have"
    for key in [k for k in table if k == "i" or k.startswith("i'")]:
        table["I" + key[1:]] = "I" + table[key][1:]  # the pronoun keeps its capital
    return table


CONTRACTION_MAP: dict[str, str] = _build()
