"""An own-data client's file, in the safetensors format `cohort client --data`
reads, for both Python clients (client.py and grpc_client.py). Its own
module, numpy and safetensors only, so that client.py imports nothing of
grpc_client.py (whose tomllib is Python 3.11's) and runs wherever the cohort
package does: CPython 3.10 and later.
"""

import numpy as np
import safetensors.numpy

import lenet5


def load_data(path):
    """The same safetensors format as `cohort client --data`: `images` uint8
    [N, 28, 28] (or [N, 1, 28, 28], or float32 in [0, 1]) and `labels` [N],
    optionally `test_images` and `test_labels`."""
    tensors = safetensors.numpy.load_file(path)

    def split(images_name, labels_name):
        images, labels = tensors[images_name], tensors[labels_name]
        if images.ndim == 3:
            images = images[:, None]
        if images.shape[1:] != (1, 28, 28) or labels.shape != (images.shape[0],):
            raise SystemExit(f"error: {path}: `{images_name}` {images.shape} and `{labels_name}` "
                             f"{labels.shape} are not [N, 28, 28] images with [N] labels")
        if images.dtype != np.uint8 and not ((images >= 0) & (images <= 1)).all():
            raise SystemExit(f"error: {path}: float `{images_name}` must hold intensities in "
                             "[0, 1] (divide uint8 pixels by 255, or save them as uint8)")
        return lenet5.normalize(images), labels.astype(np.int64)

    if "images" not in tensors or "labels" not in tensors:
        raise SystemExit(f"error: {path} needs tensors `images` and `labels`; it has {sorted(tensors)}")
    test = split("test_images", "test_labels") if "test_images" in tensors else None
    return split("images", "labels"), test
