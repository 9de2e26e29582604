"""Flax Linen ResNets that reproduce torchvision's exactly (NHWC inputs)."""
from ._batchnorm import BatchNorm as BatchNorm
from ._resnet import ARCHS as ARCHS
from ._resnet import BasicBlock as BasicBlock
from ._resnet import Bottleneck as Bottleneck
from ._resnet import ResNet as ResNet
from ._resnet import ResNetSpec as ResNetSpec
from ._resnet import build as build
from ._resnet import resnet18 as resnet18
from ._resnet import resnet34 as resnet34
from ._resnet import resnet50 as resnet50
from ._resnet import resnet101 as resnet101
from ._resnet import resnet152 as resnet152
from ._resnet import resnext50_32x4d as resnext50_32x4d
from ._resnet import resnext101_32x8d as resnext101_32x8d
from ._resnet import resnext101_64x4d as resnext101_64x4d
from ._resnet import wide_resnet50_2 as wide_resnet50_2
from ._resnet import wide_resnet101_2 as wide_resnet101_2
