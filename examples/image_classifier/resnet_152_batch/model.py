"""ResNet-152 for the ``image_classifier`` handler: torchvision's ResNet with 152 layers.

The archive's ``--model-file``: it defines exactly one ``nn.Module`` subclass, which the
handler builds with no arguments before loading ``resnet152.pt`` (a state dict) into it.
"""

from torchvision.models.resnet import Bottleneck, ResNet


class ResNet152ImageClassifier(ResNet):
    def __init__(self) -> None:
        # zero_init_residual starts every residual branch at zero (the last BatchNorm of each
        # block has weight 0): an untrained network then passes its input through the
        # shortcuts and gives image-dependent outputs (see make_weights.py). Trained weights
        # overwrite those values, so it changes nothing for them.
        super().__init__(Bottleneck, [3, 8, 36, 3], zero_init_residual=True)
