"""``ts.torch_handler.unit_tests.models.base_model``: a model with no weights to test
BaseHandler with: the argmax of its input's rows."""

from __future__ import annotations

from typing import Any

import torch


class ArgmaxModel(torch.nn.Module):
    """The index of each row's largest value."""

    def forward(self, *input: Any) -> torch.Tensor:
        return torch.argmax(input[0], 1)


def save_pt_file(filepath: str = "base_model.pt") -> None:
    """Save the model's (empty) state dict to ``filepath``."""
    torch.save(ArgmaxModel().state_dict(), filepath)


if __name__ == "__main__":
    save_pt_file()
