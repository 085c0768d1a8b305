"""A VGG-style CNN on 32 x 32 RGB images (CIFAR-10's shape), for step-time benchmarks.

Four 3x3 convolutions (64, 128, 256, 256 channels, max-pooling after the first three) and a
4096-1024-1024-10 classifier: 6.2 M parameters, 85% of them in the fully connected layers, as
in VGG and AlexNet, where compression pays off most. The forward and backward pass of one image
is about 0.33 GFLOP (8 images: 31 ms on one core of the benchmark machine), while the 25 MB of
float32 gradients take about 0.37 s to all-reduce over a 1 Gbit/s ring of 4 ranks.
"""

import torch
from torch import nn
from torch.nn import functional as F

CLASSES = 10


class SmallVGG(nn.Module):
    def __init__(self, classes=CLASSES):
        super().__init__()
        channels = [3, 64, 128, 256, 256]
        self.convs = nn.ModuleList(nn.Conv2d(c_in, c_out, 3, padding=1) for c_in, c_out in zip(channels, channels[1:]))
        self.fc1 = nn.Linear(256 * 4 * 4, 1024)
        self.fc2 = nn.Linear(1024, 1024)
        self.head = nn.Linear(1024, classes)

    def forward(self, images):
        x = images
        for index, conv in enumerate(self.convs):
            x = F.relu(conv(x))
            if index < 3:  # 32 -> 16 -> 8 -> 4
                x = F.max_pool2d(x, 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.head(F.relu(self.fc2(x)))


def synthetic_batches(batch_size, generator):
    """Endless (images, labels) of standard-normal pixels and uniform labels: step time does not
    depend on the values, and no image data set is on the machine."""
    while True:
        yield (
            torch.randn(batch_size, 3, 32, 32, generator=generator),
            torch.randint(CLASSES, (batch_size,), generator=generator),
        )
