"""Images for the ResNet recipe: scikit-learn's digits, a synthetic ImageNet-shaped stream,
and a user's own folder of images or ``.npy`` arrays; one deterministic, resumable iterator.

Every source ends as NHWC float32 images normalised per channel with the training set's mean
and std, and int32 labels. Training batches come through a Grain pipeline (shuffle, augmentation,
batching, each process's rows); ``Batches.position`` is Grain's iterator state as a small
JSON-able dict: a run that saves it with its checkpoint resumes on exactly the batch it would
have seen next.
"""

from __future__ import annotations

import dataclasses
import math
import os

import grain
import numpy as np

from ..common.loader import DataError as DataError
from ..common.loader import Loader, per_process_batches, process_share

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Images in memory (or a synthetic stream when ``train`` is None).

    Attributes:
        name: where it came from (``"digits"``, ``"folder:/path"``, ...).
        image_shape: ``(height, width, channels)``.
        num_classes: labels are ``0 .. num_classes - 1``.
        train: ``(images, labels)``, normalised float32 NHWC and int32; None for a stream.
        test: the held-out ``(images, labels)``, or None.
        class_names: label → name, where the source has names.
        shift: pixels of random shift the training iterator applies (0: none).
    """

    name: str
    image_shape: tuple[int, int, int]
    num_classes: int
    train: tuple[np.ndarray, np.ndarray] | None
    test: tuple[np.ndarray, np.ndarray] | None = None
    class_names: tuple[str, ...] = ()
    shift: int = 0

    def batches(self, batch_size: int, *, seed: int = 0, position: dict | None = None,
                process_index: int | None = None, process_count: int | None = None) -> "Batches | SyntheticBatches":
        """The training iterator over global batches of ``batch_size``, this process's rows
        (resumed at ``position`` when given)."""
        share = {"process_index": process_index, "process_count": process_count}
        if self.train is None:
            return SyntheticBatches(batch_size, self.image_shape, self.num_classes, seed=seed, position=position, **share)
        return Batches(*self.train, batch_size, seed=seed, shift=self.shift, position=position, **share)


class ImageSource:
    """A Grain data source over in-memory arrays: element ``i`` is ``{"image", "label"}``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.images[i], "label": self.labels[i]}


class Batches(Loader):
    """Shuffled batches of ``{"image", "label"}`` through Grain, a fresh order each epoch.

    The pipeline: the images shuffled globally (``MapDataset.shuffle``, reseeded per epoch),
    repeated forever, each image randomly shifted (``random_map``: its generator is seeded by
    the seed and the image's index in the stream, so the augmentation is deterministic),
    batched, this process's rows of each global batch. A batch may span two epochs.

    Args:
        images: ``(N, H, W, C)`` float32.
        labels: ``(N,)`` int32.
        batch_size: global batch size (at most N).
        seed: shuffling and augmentation seed.
        shift: random shifts of up to this many pixels each way (edge-padded), per image.
        position: a ``.position`` to resume from.
        process_index, process_count: this host's share (default: JAX's).
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch_size: int, *, seed: int = 0,
                 shift: int = 0, position: dict | None = None, process_index: int | None = None,
                 process_count: int | None = None):
        if batch_size < 1 or batch_size > len(images):
            raise DataError(f"batch size {batch_size} must be between 1 and the {len(images)} training images")
        examples = grain.MapDataset.source(ImageSource(images, labels)).shuffle(seed).repeat()
        if shift:
            examples = examples.random_map(lambda ex, rng: {**ex, "image": random_shift(ex["image"][None], shift, rng)[0]},
                                           seed=seed)
        super().__init__(per_process_batches(examples, batch_size, *process_share(process_index, process_count)),
                         seed=seed, position=position)


def random_shift(images_BxHxWxC: np.ndarray, shift: int, rng: np.random.Generator) -> np.ndarray:
    """Moves each image by up to ``shift`` pixels in each direction, filling with the edge."""
    b, h, w, _ = images_BxHxWxC.shape
    padded = np.pad(images_BxHxWxC, ((0, 0), (shift, shift), (shift, shift), (0, 0)), mode="edge")
    dy, dx = rng.integers(0, 2 * shift + 1, size=(2, b))
    rows = dy[:, None] + np.arange(h)[None, :]  # (B, H)
    cols = dx[:, None] + np.arange(w)[None, :]  # (B, W)
    return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


class SyntheticBatches(Loader):
    """An endless stream of random images and labels (for throughput and memory, not
    learning), through Grain: example ``i`` is drawn from a generator seeded by
    ``(seed, i)`` (``random_map``), so any process can draw its own rows."""

    def __init__(self, batch_size: int, image_shape: tuple[int, int, int], num_classes: int, *,
                 seed: int = 0, position: dict | None = None, process_index: int | None = None,
                 process_count: int | None = None):
        def draw(_, rng):  # the element is always 0; Grain seeds rng with the example's index
            return {"image": rng.standard_normal(image_shape, dtype=np.float32),
                    "label": np.int32(rng.integers(0, num_classes))}
        examples = grain.MapDataset.range(1).repeat().random_map(draw, seed=seed)
        super().__init__(per_process_batches(examples, batch_size, *process_share(process_index, process_count)),
                         seed=seed, position=position)


# ---- sources ---------------------------------------------------------------------------------

def digits(size: int = 32, *, test_fraction: float = 0.2, shift: int | None = None) -> Dataset:
    """scikit-learn's 1,797 handwritten digits (8x8, ships with the library, no network).

    Each digit is upsampled by pixel repetition to about 3/4 of ``size`` and zero-padded to
    ``size x size`` (32: 24x24 in a 4-pixel border), so random shifts keep it in frame. The
    test split is stratified and fixed (``random_state=0``) across runs and seeds.

    Args:
        size: image side in pixels (at least 8).
        test_fraction: share of the images held out (stratified by class).
        shift: training shifts of up to this many pixels; default one original digit pixel
            (3 at 32x32). Larger shifts of an 8x8 digit slow training a lot for little gain.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if size < 8:
        raise DataError(f"digits are 8x8; image size {size} is smaller")
    d = load_digits()
    x = d.images.astype(np.float32) / 16.0  # (N, 8, 8) in [0, 1]
    factor = max(1, (3 * size // 4) // 8)
    x = np.kron(x, np.ones((factor, factor), np.float32))
    before = (size - 8 * factor) // 2
    after = size - 8 * factor - before
    x = np.pad(x, ((0, 0), (before, after), (before, after)))[..., None]
    y = d.target.astype(np.int32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, stratify=y, random_state=0)
    shift = factor if shift is None else min(shift, before)
    return _normalised("digits", xtr, ytr, xte, yte, 10, tuple(str(i) for i in range(10)), shift)


def synthetic_imagenet(size: int = 224, num_classes: int = 1000) -> Dataset:
    """A stream of ImageNet-shaped random batches (``size x size x 3``, 1000 classes)."""
    return Dataset(f"synthetic-{size}", (size, size, 3), num_classes, train=None)


def folder(path: str, size: int = 32, *, test_fraction: float = 0.1, shift: int = 0) -> Dataset:
    """Images in class subfolders: ``PATH/<class>/<image>``, or ``PATH/train/<class>/...`` and
    ``PATH/test/<class>/...`` (``val`` also works) for a given split.

    Images are converted to RGB and resized to ``size x size``. Without a given split,
    ``test_fraction`` of the images (a fixed shuffle) are held out.

    Raises:
        DataError: not a directory, no class subfolders, a class without images, or an
            image that cannot be read.
    """
    if not os.path.isdir(path):
        raise DataError(f"folder dataset {path!r} is not a directory")
    split = [os.path.join(path, s) for s in ("train", "test", "val")]
    if os.path.isdir(split[0]) and (os.path.isdir(split[1]) or os.path.isdir(split[2])):
        classes = _class_dirs(split[0])
        test_dir = split[1] if os.path.isdir(split[1]) else split[2]
        xtr, ytr = _read_classes(split[0], classes, size)
        xte, yte = _read_classes(test_dir, classes, size, allow_empty=True)
    else:
        classes = _class_dirs(path)
        x, y = _read_classes(path, classes, size)
        xtr, ytr, xte, yte = _hold_out(x, y, test_fraction)
    return _normalised(f"folder:{path}", xtr, ytr, xte, yte, len(classes), tuple(classes), shift)


def _class_dirs(path: str) -> list[str]:
    classes = sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(f"folder {path!r} has no class subfolders; lay images out as {path}/<class name>/<image>.png")
    return classes


def _read_classes(root: str, classes: list[str], size: int, allow_empty: bool = False) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image, UnidentifiedImageError

    images, labels = [], []
    for label, name in enumerate(classes):
        d = os.path.join(root, name)
        files = sorted(f for f in os.listdir(d) if f.lower().endswith(IMAGE_EXTENSIONS)) if os.path.isdir(d) else []
        if not files and not allow_empty:
            raise DataError(f"class folder {d!r} has no images (looked for {', '.join(IMAGE_EXTENSIONS)})")
        for f in files:
            file = os.path.join(d, f)
            try:
                with Image.open(file) as im:
                    im = im.convert("RGB").resize((size, size), Image.BILINEAR)
                    images.append(np.asarray(im, np.float32) / 255.0)
            except (UnidentifiedImageError, OSError, ValueError) as e:
                raise DataError(f"cannot read image {file!r}: {e}") from None
            labels.append(label)
    if not images:
        return np.zeros((0, size, size, 3), np.float32), np.zeros((0,), np.int32)
    return np.stack(images), np.asarray(labels, np.int32)


def npy(path: str, *, test_fraction: float = 0.1, shift: int = 0) -> Dataset:
    """Arrays in a directory: ``images.npy`` ``(N, H, W)`` or ``(N, H, W, C)`` (uint8 in
    0..255 or floats) and ``labels.npy`` ``(N,)`` integers; optionally ``test_images.npy`` and
    ``test_labels.npy``, else ``test_fraction`` is held out.

    Raises:
        DataError: a missing or unreadable file, or shapes and dtypes that do not fit together.
    """
    if not os.path.isdir(path):
        raise DataError(f"npy dataset {path!r} is not a directory (expected images.npy and labels.npy in it)")
    x, y = _read_npy_pair(path, "images.npy", "labels.npy")
    if os.path.exists(os.path.join(path, "test_images.npy")):
        xte, yte = _read_npy_pair(path, "test_images.npy", "test_labels.npy")
        if xte.shape[1:] != x.shape[1:]:
            raise DataError(f"test_images.npy has images of shape {xte.shape[1:]} but images.npy has {x.shape[1:]}")
        xtr, ytr = x, y
    else:
        xtr, ytr, xte, yte = _hold_out(x, y, test_fraction)
    num_classes = int(max(ytr.max(initial=0), yte.max(initial=0))) + 1
    return _normalised(f"npy:{path}", xtr, ytr, xte, yte, num_classes, (), shift)


def _read_npy_pair(path: str, x_name: str, y_name: str) -> tuple[np.ndarray, np.ndarray]:
    arrays = []
    for name in (x_name, y_name):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise DataError(f"{file!r} is missing; an npy dataset holds images.npy (N, H, W[, C]) and labels.npy (N,)")
        try:
            arrays.append(np.load(file, allow_pickle=False))
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {file!r}: {e}") from None
    x, y = arrays
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or not 1 <= x.shape[-1] <= 4:
        raise DataError(f"{x_name} has shape {x.shape}; expected (N, H, W) or (N, H, W, C) with 1 to 4 channels")
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{y_name} has shape {y.shape} but {x_name} holds {len(x)} images; expected labels of shape ({len(x)},)")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{y_name} has dtype {y.dtype}; labels must be integers 0 .. classes-1")
    if len(y) and y.min() < 0:
        raise DataError(f"{y_name} has negative label {int(y.min())}; labels must be integers 0 .. classes-1")
    if np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.float32) / 255.0
    elif np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
    else:
        raise DataError(f"{x_name} has dtype {x.dtype}; images must be uint8 (0..255) or floats")
    return x, y.astype(np.int32)


def _hold_out(x, y, fraction):
    n_test = int(math.ceil(len(x) * fraction)) if len(x) > 1 else 0
    perm = np.random.default_rng(0).permutation(len(x))
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


def _normalised(name, xtr, ytr, xte, yte, num_classes, class_names, shift) -> Dataset:
    if len(xtr) == 0:
        raise DataError(f"dataset {name!r} has no training images")
    mean = xtr.mean(axis=(0, 1, 2))
    std = xtr.std(axis=(0, 1, 2)) + 1e-6
    norm = lambda a: ((a - mean) / std).astype(np.float32)  # noqa: E731
    test = (norm(xte), yte.astype(np.int32)) if len(xte) else None
    return Dataset(name, tuple(xtr.shape[1:]), num_classes, (norm(xtr), ytr.astype(np.int32)), test,
                   tuple(class_names), shift)


def load(spec: str, *, image_size: int | None = None, shift: int | None = None) -> Dataset:
    """A dataset by name: ``digits``, ``synthetic``, ``folder:PATH`` or ``npy:PATH``.

    Raises:
        DataError: an unknown name or unusable data (the message says which and why).
    """
    kind, _, path = spec.partition(":")
    if kind == "digits" and not path:
        return digits(image_size or 32, shift=shift)
    if kind == "synthetic" and not path:
        return synthetic_imagenet(image_size or 224)
    if kind == "folder" and path:
        return folder(path, image_size or 32, shift=shift or 0)
    if kind == "npy" and path:
        return npy(path, shift=shift or 0)
    raise DataError(f"unknown dataset {spec!r}; use digits, synthetic, folder:PATH or npy:PATH")
