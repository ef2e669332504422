"""ResNet-50 without torchvision: moved into the package as :mod:`tritonbn.resnet50` (``tritonbn bench`` builds it).

The benchmark scripts keep importing it from here.
"""

from tritonbn.resnet50 import Bottleneck, ResNet50, bn_input_shapes, distinct_bn_shapes, resnet50

__all__ = ["Bottleneck", "ResNet50", "bn_input_shapes", "distinct_bn_shapes", "resnet50"]
