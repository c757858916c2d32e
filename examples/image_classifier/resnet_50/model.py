"""ResNet-50 for the ``image_classifier`` handler: torchvision's ResNet with 50 layers.

The archive's ``--model-file``: it defines exactly one ``nn.Module`` subclass, which the
handler builds with no arguments before loading ``resnet50.pt`` (a state dict) into it.
"""

from torchvision.models.resnet import Bottleneck, ResNet


class ResNet50ImageClassifier(ResNet):
    def __init__(self) -> None:
        # As the ResNet-152 example: zero_init_residual keeps an untrained network's answers
        # image-dependent (trained weights overwrite those values).
        super().__init__(Bottleneck, [3, 4, 6, 3], zero_init_residual=True)
