"""The image data sets the backend-divergence case trains on, as torch Datasets.

``digits`` (the default, no download): scikit-learn's copy of the UCI
Optical Recognition of Handwritten Digits test set -- 1797 images of 8×8
pixels, integers 0..16, labels 0..9 (provenance in data/README.md). Each
image becomes a ``[1, 8, 8]`` tensor ``(x/16 − m)/s``, where ``m`` and ``s``
are the mean and standard deviation of all pixels of the set divided by 16
(so the inputs have mean 0 and variance 1, as normalized CIFAR images
roughly do). Order: scikit-learn's file order, never shuffled.

``cifar10``: the standard CIFAR-10 python batches in ``data_root`` (or in
``data_root/cifar-10-batches-py``): ``data_batch_1`` .. ``data_batch_5``
for training, ``test_batch`` for testing, each a pickled dict with
``b"data"`` (N×3072 uint8, the red, green and blue planes of a 32×32 image
in turn) and ``b"labels"``. The files are unpickled with a restricted
unpickler that admits only plain data and numpy arrays: a planted batch
file cannot run code. Each image becomes ``[3, 32, 32]``,
``(x/255 − mean)/std`` with the report's mean (0.4914, 0.4822, 0.4465) and
std (0.2023, 0.1994, 0.2010). The report's ``CenterCrop(32)`` is the
identity at 32×32 and is therefore not applied. The report ran with float64
as torch's default dtype, so its ``ToTensor``/``Normalize`` computed in
float64; so does this module, casting to the requested dtype at the end.

Example::

    >>> ds = load_dataset("digits", dtype=torch.float64)
    >>> len(ds), ds[0][0].shape, ds.num_classes
    (1797, torch.Size([1, 8, 8]), 10)
"""
from __future__ import annotations

import functools
import os
import pathlib
import pickle

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["DATASETS", "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR10_TRAIN_FILES", "CIFAR10_TEST_FILE",
           "CIFAR10_PICKLE_GLOBALS", "ImageDataset", "digits", "cifar10", "check_cifar10", "load_dataset"]

#: Data set names :func:`load_dataset` accepts.
DATASETS = ("digits", "cifar10")
#: Per-channel mean and std of the report's ``transforms.Normalize``.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
#: The folder the official CIFAR-10 python archive unpacks to.
CIFAR10_FOLDER = "cifar-10-batches-py"
#: The only globals a CIFAR-10 batch may name: numpy's array and dtype
#: rebuilders (under numpy 1's and numpy 2's module names) and the codec that
#: protocol-2 pickles written by Python 3 use for bytes. Anything else -- a
#: function the pickle would call while loading -- is refused.
CIFAR10_PICKLE_GLOBALS = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),
})


class ImageDataset(Dataset):
    """Images ``[N, C, H, W]`` and int64 labels ``[N]`` held in memory.

    ``num_classes``, ``in_channels`` and ``name`` tell a model builder what to build.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int, name: str):
        if images.ndim != 4:
            raise ValueError(f"images must be [N, C, H, W], got shape {tuple(images.shape)}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"labels must be [N] with N={images.shape[0]}, got {tuple(labels.shape)}")
        self.images = images
        self.labels = labels.to(torch.int64)
        self.num_classes = int(num_classes)
        self.in_channels = int(images.shape[1])
        self.name = name

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __repr__(self) -> str:
        return (f"ImageDataset({self.name!r}, n={len(self)}, shape={tuple(self.images.shape[1:])}, "
                f"dtype={self.images.dtype}, classes={self.num_classes})")


def _digits_file() -> pathlib.Path | None:
    """scikit-learn's digits.csv.gz, located without importing scikit-learn.

    ``import sklearn`` pulls in scipy and costs seconds per process; a case
    loads the digits in every rank of every launch, so it reads the file
    scikit-learn ships (the one ``load_digits`` parses) directly.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels and labels, parsed once per process (read-only: callers copy)."""
    arrays = _parse_digits()
    for array in arrays:
        array.setflags(write=False)
    return arrays


def _parse_digits() -> tuple[np.ndarray, np.ndarray]:
    path = _digits_file()
    if path is not None:
        # What load_digits does: 64 pixel columns, then the label.
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def digits(dtype: torch.dtype = torch.float32) -> ImageDataset:
    """scikit-learn's handwritten digits as ``[1797, 1, 8, 8]`` standardized images."""
    raw, target = _digits_arrays()
    pixels = raw.astype(np.float64) / 16.0
    pixels = (pixels - pixels.mean()) / pixels.std()
    images = torch.from_numpy(pixels).unsqueeze(1).to(dtype)
    labels = torch.from_numpy(target.copy())
    return ImageDataset(images, labels, num_classes=10, name="digits")


def _cifar_dir(data_root) -> pathlib.Path:
    if data_root is None:
        raise ValueError("data='cifar10' needs data_root: the folder holding the CIFAR-10 python "
                         "batches (data_batch_1..5, test_batch)")
    root = pathlib.Path(os.path.expanduser(str(data_root)))
    for candidate in (root, root / CIFAR10_FOLDER):
        if (candidate / CIFAR10_TEST_FILE).exists() or (candidate / CIFAR10_TRAIN_FILES[0]).exists():
            return candidate
    return root


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, bytes, strings, numbers and numpy arrays; nothing that runs code."""

    def find_class(self, module: str, name: str):
        if (module, name) not in CIFAR10_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: a CIFAR-10 batch holds only dicts, lists, "
                f"bytes, strings, numbers and numpy arrays")
        try:
            return super().find_class(module, name)
        except ImportError:  # numpy 1 reading numpy 2's module names, or the reverse
            swapped = (module.replace("numpy._core", "numpy.core") if "numpy._core" in module
                       else module.replace("numpy.core", "numpy._core"))
            return super().find_class(swapped, name)


def _read_batch(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as fh:
            batch = _BatchUnpickler(fh, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise ValueError(f"{path} is not a CIFAR-10 python batch: {exc}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{path} is not a CIFAR-10 python batch (a pickled dict with b'data' "
                         f"and b'labels')")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (data.shape[0],):
        raise ValueError(f"{path}: expected b'data' of shape N×3072 and N labels, got "
                         f"{data.shape} and {labels.shape}")
    return data, labels


def check_cifar10(data_root, train: bool = True) -> pathlib.Path:
    """The folder holding the CIFAR-10 batches under ``data_root``, without reading them.

    Raises ValueError without ``data_root`` and FileNotFoundError naming the
    missing files and where to get them -- cheap enough to call before any
    rank starts.
    """
    folder = _cifar_dir(data_root)
    names = CIFAR10_TRAIN_FILES if train else (CIFAR10_TEST_FILE,)
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 python batches missing in {folder}: {', '.join(missing)}. Download "
            f"cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, unpack it "
            f"and pass data_root=<the folder holding {CIFAR10_FOLDER}/ or its files>")
    return folder


def cifar10(data_root, train: bool = True, dtype: torch.dtype = torch.float32) -> ImageDataset:
    """CIFAR-10 from the python batches in ``data_root``, normalized as in the report.

    Raises FileNotFoundError naming the missing files and where to get them.
    """
    folder = check_cifar10(data_root, train)
    names = CIFAR10_TRAIN_FILES if train else (CIFAR10_TEST_FILE,)
    parts = [_read_batch(folder / n) for n in names]
    data = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"CIFAR-10 labels must lie in 0..9, found {labels.min()}..{labels.max()}")
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).astype(np.float64) / 255.0)
    mean = torch.tensor(CIFAR10_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, dtype=torch.float64).view(1, 3, 1, 1)
    images = ((images - mean) / std).to(dtype)
    return ImageDataset(images, torch.from_numpy(labels), num_classes=10, name="cifar10")


def load_dataset(name: str, data_root=None, *, train: bool = True,
                 dtype: torch.dtype = torch.float32) -> ImageDataset:
    """The data set ``name`` ("digits" or "cifar10" with ``data_root``) in ``dtype``."""
    if name == "digits":
        return digits(dtype)
    if name == "cifar10":
        return cifar10(data_root, train=train, dtype=dtype)
    raise ValueError(f"data must be one of {', '.join(DATASETS)}, got {name!r}")
