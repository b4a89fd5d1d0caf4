"""The case's models and data sets: shapes, determinism, the CIFAR-10 file format, errors."""
from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

from ddplab.datasets import (CIFAR10_MEAN, CIFAR10_STD, CIFAR10_TRAIN_FILES, cifar10, digits,
                             load_dataset)
from ddplab.models import Bottleneck, SmallResNet, build_model, resnet50


# --------------------------------------------------------------------------- models


def test_small_resnet_shapes_and_dtype():
    model = build_model("resnet", num_classes=10, in_channels=1, dtype=torch.float64, seed=0)
    assert isinstance(model, SmallResNet)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    out = model(torch.randn(4, 1, 8, 8, dtype=torch.float64))
    assert out.shape == (4, 10) and out.dtype == torch.float64
    # A 32×32, 3-channel input works too (global average pooling).
    rgb = build_model("resnet", 10, 3, torch.float32, seed=0)
    assert rgb(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_seeded_builds_are_bitwise_identical():
    a = build_model("resnet", 10, 1, torch.float64, seed=3)
    b = build_model("resnet", 10, 1, torch.float64, seed=3)
    c = build_model("resnet", 10, 1, torch.float64, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_resnet50_is_the_bottleneck_network_of_the_report():
    model = resnet50(num_classes=10, in_channels=3)
    blocks = [m for m in model.modules() if isinstance(m, Bottleneck)]
    assert len(blocks) == 3 + 4 + 6 + 3
    # kuangliu/pytorch-cifar's ResNet50 (the report's models.resnet) has 23,520,842 weights.
    assert sum(p.numel() for p in model.parameters()) == 23_520_842
    assert build_model("resnet50", 10, 3, torch.float32).linear.in_features == 2048


def test_group_norm_has_no_buffers_batch_norm_has():
    batch = build_model("resnet", 10, 1, torch.float32, norm="batch")
    group = build_model("resnet", 10, 1, torch.float32, norm="group")
    assert any(isinstance(m, nn.BatchNorm2d) for m in batch.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in group.modules())
    assert len(list(group.buffers())) == 0 and len(list(batch.buffers())) > 0


@pytest.mark.parametrize("kwargs, word", [
    (dict(name="vgg"), "model"), (dict(norm="layer"), "norm"), (dict(dtype=torch.int64), "dtype")])
def test_build_model_rejects_bad_input(kwargs, word):
    args = dict(name="resnet", num_classes=10, in_channels=1, dtype=torch.float32)
    norm = kwargs.pop("norm", "batch")
    args.update(kwargs)
    with pytest.raises(ValueError, match=word):
        build_model(**args, norm=norm)


def test_small_resnet_trains_a_step_fast_in_float64():
    model = build_model("resnet", 10, 1, torch.float64, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 1, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 10, (32,))
    times, losses = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what each of 2 ranks gets on 2 cores
    try:
        _train(model, opt, x, y, times, losses)
    finally:
        torch.set_num_threads(threads)
    print(f"SmallResNet float64 batch 32, one thread: median step {sorted(times)[2] * 1e3:.1f} ms")
    assert losses[-1] < losses[0]  # it learns (the batch is memorized)


def _train(model, opt, x, y, times, losses):
    for _ in range(4):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())


# --------------------------------------------------------------------------- digits


def test_digits_shape_normalization_and_order():
    ds = digits(torch.float64)
    assert len(ds) == 1797 and ds.num_classes == 10 and ds.in_channels == 1
    assert ds.images.shape == (1797, 1, 8, 8) and ds.images.dtype == torch.float64
    assert abs(ds.images.mean().item()) < 1e-12
    assert abs(ds.images.std(unbiased=False).item() - 1.0) < 1e-12
    from sklearn.datasets import load_digits
    raw = load_digits()
    assert torch.equal(ds.labels, torch.from_numpy(raw.target).long())
    # The file read directly is the one load_digits parses: same pixels, same order.
    expected = (raw.images / 16.0 - (raw.images / 16.0).mean()) / (raw.images / 16.0).std()
    assert np.array_equal(ds.images[:, 0].numpy(), expected)
    # The map is affine and increasing: pixel ranks are kept.
    flat = ds.images[0].flatten().numpy()
    assert np.array_equal(np.argsort(flat, kind="stable"), np.argsort(raw.images[0].flatten(), kind="stable"))
    assert ds.images.float().dtype == torch.float32 and digits(torch.float32).images.dtype == torch.float32


# --------------------------------------------------------------------------- CIFAR-10


def _write_cifar(folder, per_batch=3, seed=0):
    """Write the standard CIFAR-10 python batches with ``per_batch`` random images each."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in list(CIFAR10_TRAIN_FILES) + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=per_batch).tolist()
        with open(folder / name, "wb") as fh:
            pickle.dump({b"batch_label": name.encode(), b"data": data, b"labels": labels,
                         b"filenames": [b"x.png"] * per_batch}, fh)
        written[name] = (data, labels)
    return written


def test_cifar10_reads_the_python_batches(tmp_path):
    written = _write_cifar(tmp_path / "cifar-10-batches-py")
    ds = load_dataset("cifar10", tmp_path, dtype=torch.float64)  # finds the sub-folder
    assert len(ds) == 15 and ds.images.shape == (15, 3, 32, 32) and ds.in_channels == 3
    data, labels = written["data_batch_2"]
    image, label = ds[3]  # the first image of the second batch
    assert label.item() == labels[0]
    # Channel planes: red = bytes 0..1023, green 1024..2047, blue 2048..3071, row-major.
    for c in range(3):
        expected = (data[0, c * 1024:(c + 1) * 1024].reshape(32, 32) / 255.0 - CIFAR10_MEAN[c]) / CIFAR10_STD[c]
        assert np.allclose(image[c].numpy(), expected, rtol=0, atol=1e-15)
    test = cifar10(tmp_path / "cifar-10-batches-py", train=False, dtype=torch.float32)
    assert len(test) == 3 and test.images.dtype == torch.float32
    assert test.labels.tolist() == written["test_batch"][1]


def test_cifar10_missing_files_say_which_and_where(tmp_path):
    with pytest.raises(ValueError, match="data_root"):
        load_dataset("cifar10", None)
    with pytest.raises(FileNotFoundError, match="data_batch_1.*cifar-10-python.tar.gz"):
        load_dataset("cifar10", tmp_path)
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_4") as info:
        load_dataset("cifar10", tmp_path)
    assert "data_batch_1" not in str(info.value)


def test_cifar10_rejects_a_file_in_another_format(tmp_path):
    _write_cifar(tmp_path)
    with open(tmp_path / "data_batch_1", "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 100), dtype=np.uint8), b"labels": [0, 1]}, fh)
    with pytest.raises(ValueError, match="3072"):
        load_dataset("cifar10", tmp_path)


class _RunsCode:
    """Unpickling this calls ``exec``: what a planted batch file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_cifar10_refuses_a_pickle_that_would_run_code(tmp_path):
    _write_cifar(tmp_path)
    marker = tmp_path / "code-ran"
    with open(tmp_path / "data_batch_3", "wb") as fh:
        pickle.dump({b"data": _RunsCode(marker), b"labels": [0]}, fh)
    pickle.loads(pickle.dumps(_RunsCode(marker)))  # the plant works on a plain unpickler ...
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ValueError, match=r"data_batch_3 is not a CIFAR-10 python batch: "
                                         r"refusing to load builtins\.exec"):
        load_dataset("cifar10", tmp_path)
    assert not marker.exists()  # ... and did not run here


@pytest.mark.slow  # a real case notebook whose ranks read the planted file (about 20 s)
def test_ddplab_report_refuses_a_planted_cifar10_batch(tmp_path):
    root = tmp_path / "data"
    _write_cifar(root)
    marker = tmp_path / "code-ran"
    for name in CIFAR10_TRAIN_FILES:  # whichever batch the ranks read first
        with open(root / name, "wb") as fh:
            pickle.dump({b"data": _RunsCode(marker), b"labels": [0]}, fh)
    out = tmp_path / "reports"
    repo = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "ddplab", "report", "backend_divergence", "--quick",
                           "-p", "data", "cifar10", "-p", "data_root", str(root), "--output", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not marker.exists()  # the planted pickle ran nothing, in any process
    case = json.loads((out / "index.json").read_text())["cases"][0]
    assert case["status"] == "failed"
    assert "refusing to load builtins.exec" in (out / "backend_divergence" / "notebook.ipynb").read_text()


def test_cifar10_reads_batches_of_every_pickle_protocol(tmp_path):
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    for protocol in (2, 3, 4, 5):
        folder = tmp_path / f"p{protocol}"
        folder.mkdir()
        with open(folder / "test_batch", "wb") as fh:
            pickle.dump({b"data": data, b"labels": [3, 4], b"batch_label": b"testing batch 1 of 1",
                         b"filenames": [b"a.png", b"b.png"]}, fh, protocol=protocol)
        ds = cifar10(folder, train=False)
        assert ds.labels.tolist() == [3, 4] and len(ds) == 2


def test_unknown_data_set():
    with pytest.raises(ValueError, match="data must be one of"):
        load_dataset("mnist")
