"""``ts.torch_handler.text_classifier``: TorchServe's TextClassifier.

For its text-classification model shape, ``model(tokens, offsets) -> [1, classes]`` (an
``nn.EmbeddingBag`` over token ids and their bigrams, then a linear layer). As TorchServe's,
it reads the first request of a batch only ("DOES NOT SUPPORT BATCH"): give the model
``batch_size`` 1 (batchserve's built-in ``text_classifier``, by name, takes whole batches).
The answer is ``{label: probability}`` for every class, labels from ``index_to_name.json``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..handler_utils.text_utils import ngrams_iterator
from ..utils.util import map_class_to_label
from .text_handler import TextHandler

__all__ = ["TextClassifier", "TextHandler", "map_class_to_label", "ngrams_iterator"]

logger = logging.getLogger(__name__)


class TextClassifier(TextHandler):
    """Class probabilities of the first request's text."""

    ngrams = 2

    def preprocess(self, data: list[Any]) -> tuple[torch.Tensor, list[str]]:
        """The first request's text cleaned (HTML tags, case, contractions, accents,
        punctuation), tokenised, and its tokens and bigrams as vocabulary indices; returns
        the index tensor and the tokens."""
        row = data[0]
        text = row.get("data") or row.get("body") if isinstance(row, dict) else row
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8")
        text = self._remove_html_tags(str(text))
        text = self._remove_punctuation(self._remove_accented_characters(
            self._expand_contractions(text.lower())))
        tokens = self._tokenize(text)
        indices = [self.source_vocab[token] for token in ngrams_iterator(tokens, self.ngrams)]
        return torch.as_tensor(indices, device=self.device), tokens

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The model on the token indices, as one bag (offset 0)."""
        text_tensor, _ = data
        return super().inference(text_tensor, torch.as_tensor([0], device=self.device))

    def postprocess(self, data: Any) -> list[Any]:
        return map_class_to_label(torch.softmax(data, dim=1).tolist(), self.mapping)

    def get_insights(self, text_preprocess: Any, _: Any, target: Any = 0) -> list[Any]:
        """Per token, its importance (LayerIntegratedGradients over the embedding) for class
        ``target``: ``[{"importances": [...], "words": [...]}]``."""
        lig = self._require_lig()
        from captum.attr import TokenReferenceBase

        text_tensor, tokens = text_preprocess
        reference = TokenReferenceBase().generate_reference(
            text_tensor.shape[0], device=self.device).squeeze(0)
        attributions = lig.attribute(
            text_tensor, reference, additional_forward_args=(torch.tensor([0]).to(self.device)),
            return_convergence_delta=False, target=target)
        return [{"importances": self.summarize_attributions(attributions).tolist(),
                 "words": self.get_word_token(tokens)}]
