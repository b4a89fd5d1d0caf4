"""A capture stores each distinct large tensor's bytes once: clones of equal bits (DDP's bucket, its
hook's result, the all-reduce's output) are written once, and everything reads back bit for bit."""
import os
import pathlib

import pytest
import torch

from ddplab.compare.captures import PACKED_NUMEL, read_capture, save_capture

N = 200_000                                  # large: beyond PACKED_NUMEL, so not packed
assert N > PACKED_NUMEL
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    # compared as integers: -0.0 == 0.0 and NaN != NaN as floats
    return t.view(_INT[t.element_size()])


def _same_bits(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_bits, a, b))
    return a == b


def _round_trip(tmp_path, data, name="capture.pt"):
    path = str(tmp_path / name)
    save_capture(data, path)
    assert not os.path.exists(path + ".tmp")
    return read_capture(path), os.path.getsize(path)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_clones_of_equal_bits_are_stored_once_and_read_back_bit_for_bit(tmp_path):
    t, other = torch.randn(N), torch.randn(N)
    data = {"result": t, "hook": t.clone(), "out": t.clone(), "local": other}
    back, size = _round_trip(tmp_path, data)
    distinct = _nbytes(t, other)
    assert distinct < size < distinct + 64 * 1024
    for key in data:
        assert torch.equal(back[key].view(torch.int32), data[key].view(torch.int32))


def test_minus_zero_and_nan_payloads_are_not_merged_with_their_equal_values(tmp_path):
    zero = torch.zeros(N)
    minus = torch.zeros(N)
    minus[1] = -0.0                          # equal as values, not as bits; away from the probed elements
    nan = torch.full((N,), float("nan"))
    payload = nan.clone()
    payload.view(torch.int32)[1] = 0x7FC00001   # another quiet NaN
    data = {"zero": zero, "minus": minus, "nan": nan, "payload": payload, "nan_again": nan.clone()}
    back, size = _round_trip(tmp_path, data)
    assert _same_bits(data, back)
    distinct = _nbytes(zero, minus, nan, payload)    # a NaN equals itself when its bits do
    assert distinct < size < distinct + 64 * 1024


def test_equal_bits_of_another_shape_dtype_or_kind_are_not_merged(tmp_path):
    t = torch.randn(N)
    data = {"flat": t, "square": t.clone().view(400, N // 400), "ints": t.clone().view(torch.int32),
            "param": torch.nn.Parameter(t.clone()), "grad": t.clone().requires_grad_()}
    back, _ = _round_trip(tmp_path, data)
    assert _same_bits(data, back)
    assert back["square"].shape == (400, N // 400) and back["ints"].dtype == torch.int32
    assert back["grad"].requires_grad and not back["flat"].requires_grad


def test_a_non_contiguous_large_tensor_reads_back_equal(tmp_path):
    t = torch.randn(500, N // 500).t()
    data = {"t": t, "strided": t.clone(), "contiguous": t.contiguous(), "other": torch.randn(N // 500, 500).t()}
    assert not t.is_contiguous()
    back, size = _round_trip(tmp_path, data)
    assert _same_bits(data, back)
    assert size < _nbytes(t, data["other"]) + 64 * 1024


def test_tensors_in_lists_tuples_and_nested_dicts_and_objects_met_twice(tmp_path):
    t, small = torch.randn(N), torch.randn(10)
    data = {"collectives": [{"op": "allreduce", "tensors": {"inputs": [t, small], "outputs": (t.clone(), small)}},
                            {"op": "broadcast", "tensors": {"inputs": [t.clone().double()]}}],
            "buckets": ({"result": t.clone(), "grads": [small.clone(), t]},), "step": 3, "loss": None}
    back, size = _round_trip(tmp_path, data)
    assert _same_bits(data, back)
    assert size < _nbytes(t, t.double()) + 64 * 1024
    inputs = back["collectives"][0]["tensors"]["inputs"]
    again = back["collectives"][0]["tensors"]["outputs"][1]
    assert inputs[1].data_ptr() == again.data_ptr()     # one small object met twice: one packed slice


def test_ddp_gradients_that_are_their_buckets_result_are_written_once(tmp_path):
    from ddplab.compare.runners import _views_of_buckets

    result = torch.randn(300_000)
    w, b = result[:200_000].view(400, 500).clone(), result[200_000:].clone()
    b[7] = b[7].nextafter(torch.tensor(1.0))          # one ulp off the reduced result: kept as it is
    grads = _views_of_buckets({"w": w, "b": b}, [dict(result=result, names=["w", "b"])])
    assert grads["w"].untyped_storage().data_ptr() == result.untyped_storage().data_ptr()
    assert grads["b"] is b
    path = str(tmp_path / "cap.pt")
    save_capture({"grads": grads, "buckets": [dict(result=result, names=["w", "b"])]}, path)
    assert os.path.getsize(path) < (300_000 + 100_000) * 4 + 65536   # the bucket and the one gradient apart
    back = read_capture(path)
    assert torch.equal(back["grads"]["w"].view(torch.int32), w.view(torch.int32))
    assert torch.equal(back["grads"]["b"].view(torch.int32), b.view(torch.int32))


def test_ddp_all_reduce_inputs_that_are_their_bucket_times_one_over_w_cost_no_bytes(tmp_path):
    """The capture hook's stand-in (what the recording keeps of an all-reduce input instead of a copy)
    is the contribution times 1/W exactly where those are the input's bits, and costs no bytes."""
    import types

    from ddplab.compare.captures import Scaled
    from ddplab.compare.runners import _contribution_times

    local = torch.randn(300_000)
    w3 = types.SimpleNamespace(group_ranks=(0, 1, 2))
    first = local.mul(1.0 / 3)                                       # W = 3: 1/3 is not exact, bits matter
    second = first.clone()
    second[5] = second[5].nextafter(torch.tensor(9.0))               # one ulp off: copied as it is
    stand_in = _contribution_times(local)
    kept = stand_in(first, w3)
    assert isinstance(kept, Scaled) and kept.base is local
    assert stand_in(second, w3) is None
    assert stand_in(first, types.SimpleNamespace(group_ranks=(0, 1))) is None        # times 1/2: other bits
    assert stand_in(first.double(), w3) is None and stand_in(first, types.SimpleNamespace(group_ranks=None)) is None
    buckets = [dict(index=0, local=local, result=torch.randn(300_000))]
    collectives = [dict(bucket=0, group_ranks=(0, 1, 2), tensors=dict(inputs=[kept])),
                   dict(bucket=0, group_ranks=(0, 1, 2), tensors=dict(inputs=[second]))]
    back, size = _round_trip(tmp_path, dict(buckets=buckets, collectives=collectives))
    assert size < _nbytes(local, buckets[0]["result"], second) + 65536   # the first input is free
    assert _same_bits(back["collectives"][0]["tensors"]["inputs"][0].value(), first)
    assert _same_bits(back["collectives"][1]["tensors"]["inputs"][0], second)


def _wide_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))


def test_a_ddp_rank_writes_what_it_shares_with_rank_0_once(tmp_path):
    """Real DDP ranks: rank 1 writes its parameters and reduced buckets as references to rank 0's capture,
    its own contribution in full, and the cache reads rank 0's tensors back in their place."""
    import torch.nn.functional as F

    from ddplab import launch
    from ddplab.compare import DDP, Setup
    from ddplab.compare.captures import CaptureCache, SameAs, Scaled
    from ddplab.compare.runners import capture_path, configuration_worker
    from ddplab.compare.setup import model_digest

    g = torch.Generator().manual_seed(0)
    setup = Setup(model=_wide_model, batches=[(torch.randn(8, 300, generator=g), torch.randn(8, 4, generator=g))],
                  loss=F.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="wide")
    root = str(tmp_path)
    launch(configuration_worker, world_size=2,
           args=(setup, DDP(2), 1, root, "run", model_digest(setup.build_model()), "run", None))
    raw = torch.load(capture_path(root, "run", 0, 1), weights_only=False)["data"]
    assert raw["params"]["0.weight"] == SameAs(("params", "0.weight"))
    assert all(isinstance(b["result"], SameAs) and not isinstance(b["local"], SameAs) for b in raw["buckets"])
    # On every rank each all-reduce input is its bucket times 1/W, written as that product (no bytes).
    for rank in range(2):
        data = torch.load(capture_path(root, "run", 0, rank), weights_only=False)["data"]
        reductions = [c for c in data["collectives"] if c.get("op") == "allreduce" and c.get("bucket") is not None]
        assert reductions and all(isinstance(c["tensors"]["inputs"][0], Scaled) for c in reductions)
    cache = CaptureCache(4)
    zero, one = cache.get(root, "run", 0, 0), cache.get(root, "run", 1, 0)
    assert one["params"]["0.weight"] is zero["params"]["0.weight"]
    assert not _same_bits(one["buckets"][0]["local"], zero["buckets"][0]["local"])   # each rank's own share


SAVE_ON_A_FULL_DISK = """
import json, os, sys, torch
from ddplab.compare.captures import save_capture
try:
    save_capture({"x": torch.randn(2_000_000)}, os.path.join(sys.argv[1], "cap.pt"))
    print(json.dumps({"raised": None}))
except OSError as exc:
    print(json.dumps({"raised": type(exc).__name__, "errno": exc.errno, "text": str(exc),
                      "left": sorted(os.listdir(sys.argv[1]))}))
"""


def test_a_capture_that_does_not_fit_the_disk_says_so_and_leaves_nothing(tmp_path):
    """torch.save reports a full disk as "unexpected pos": a capture raises ENOSPC with the sizes instead,
    which a comparison tells apart (compare.streaming.disk_full), and removes its partial file."""
    import json
    import sys

    from mounts import can_mount, on_tmpfs

    if not sys.platform.startswith("linux") or not can_mount():
        pytest.skip("needs a mount namespace (unshare --user --mount) for a small tmpfs")
    script = tmp_path / "save.py"
    script.write_text(SAVE_ON_A_FULL_DISK)
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent.parent)}
    proc = on_tmpfs(tmp_path / "disk", "size=1m", [sys.executable, str(script), str(tmp_path / "disk")],
                    cwd=tmp_path, env=env)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["raised"] == "OSError" and seen["errno"] == 28, seen
    assert "No space left on device for a capture of 8000" in seen["text"] and seen["left"] == [], seen


def test_a_steps_gradient_norm_is_within_1e_7_of_the_exact_one_where_one_float32_sum_is_not():
    import math

    from ddplab.compare.runners import gradient_norm

    torch.manual_seed(0)
    grads = [torch.randn(4_000_000), torch.randn(300, 7).t(), torch.randn(9, dtype=torch.bfloat16),
             torch.randn(5, dtype=torch.complex64)]
    exact = math.sqrt(sum(float(torch.linalg.vector_norm(g.to(torch.complex128 if g.is_complex() else torch.float64)))
                          ** 2 for g in grads))
    assert abs(gradient_norm(grads) - exact) / exact < 1e-7
    # What it replaces: one float32 sum over the large tensor drifts further.
    one_sum = float(torch.linalg.vector_norm(grads[0]))
    assert abs(one_sum - float(grads[0].double().norm())) / one_sum > 1e-6
    # Squares beyond float32's range, of finite elements: measured in float64.
    huge = torch.full((4,), 1e30)
    assert gradient_norm([huge]) == pytest.approx(float(huge.double().norm()), rel=1e-12)
    assert math.isnan(gradient_norm([torch.tensor([1.0, float("nan")])]))
    assert gradient_norm([]) == 0.0


def _torch_optimizers():
    import inspect

    for name, cls in sorted(vars(torch.optim).items()):
        if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer \
                and name not in ("LBFGS", "SparseAdam"):   # a closure's loop; sparse gradients only
            yield cls


@pytest.mark.parametrize("cls", list(_torch_optimizers()), ids=lambda c: c.__name__)
def test_torch_optimizers_leave_the_gradients_they_read_alone(cls):
    """What lets a capture borrow a reference's gradients instead of copying them (runners.leaves_gradients_alone)."""
    import inspect

    from ddplab.compare.runners import leaves_gradients_alone

    accepted = inspect.signature(cls.__init__).parameters
    options = [dict()]
    for extra in (dict(weight_decay=0.1), dict(maximize=True, weight_decay=0.1), dict(foreach=True, weight_decay=0.1),
                  dict(foreach=True, maximize=True, weight_decay=0.1), dict(momentum=0.9, nesterov=True)):
        if all(key in accepted for key in extra):
            options.append(extra)
    torch.manual_seed(0)
    for extra in options:
        params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3, 4))]
        optimizer = cls(params, lr=0.1, **extra)
        assert leaves_gradients_alone(optimizer)
        for _ in range(3):   # a momentum buffer exists from the second step on
            for p in params:
                p.grad = torch.randn_like(p)
            seen = [p.grad.clone() for p in params]
            optimizer.step()
            for p, before in zip(params, seen):
                assert torch.equal(p.grad.view(torch.int32), before.view(torch.int32)), (cls.__name__, extra)
    assert not leaves_gradients_alone(type("Mine", (torch.optim.SGD,), {})(params, lr=0.1))


def test_a_capture_is_written_without_crc32_and_the_process_keeps_its_setting(tmp_path):
    """The CRC-32 of every record cost a rank a third of its writing; torch.load never checks it. The
    user's own torch.save in the rank still computes it."""
    import zipfile

    from ddplab.compare.captures import read_capture, save_capture

    path = str(tmp_path / "cap.pt")
    w = torch.randn(300_000)
    save_capture({"grads": {"w": w}}, path)
    assert torch.serialization.get_crc32_options() is True
    with zipfile.ZipFile(path) as archive:
        stored = [info for info in archive.infolist() if info.file_size > 1_000_000]
    assert stored and all(info.CRC == 0 for info in stored)
    assert torch.equal(read_capture(path, mmap=False)["grads"]["w"], w)


def test_digests_hash_the_tensors_bytes_in_place_whatever_their_shape():
    """A digest reads a tensor's own buffer (no copy of a model size); a 0-dim output hashes too."""
    import hashlib

    from ddplab.compare.runners import tensor_digest
    from ddplab.compare.setup import model_digest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 3))
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        h.update(bytes(p.detach().view(torch.uint8).reshape(-1).tolist()))
    assert model_digest(model) == h.hexdigest()
    assert tensor_digest(torch.tensor(3.0)) == tensor_digest(torch.tensor(3.0)) != tensor_digest(torch.tensor(3.5))
    x = torch.randn(4, 6)
    assert tensor_digest(x) == tensor_digest(x.clone()) != tensor_digest(x.t().contiguous())


def test_a_capture_is_written_over_a_recycled_one_of_its_kind_and_only_of_its_kind(tmp_path):
    from ddplab.compare.captures import capture_size, recycle_capture, remove_recycled

    first, bigger = str(tmp_path / "s0-r0.pt"), {"x": torch.arange(3 * N, dtype=torch.float32)}
    save_capture(bigger, first, kind="r0")
    inode = os.stat(first).st_ino
    recycle_capture(first, "r0")
    assert not os.path.exists(first) and len(os.listdir(tmp_path)) == 1
    other = str(tmp_path / "s1-r1.pt")
    save_capture({"x": torch.zeros(N)}, other, kind="r1")   # another kind: a file of its own
    assert os.stat(other).st_ino != inode
    second, smaller = str(tmp_path / "s1-r0.pt"), {"x": torch.full((N,), 7.0), "y": 3}
    save_capture(smaller, second, kind="r0")
    # the same file, its pages written over, and cut to what this capture holds
    assert os.stat(second).st_ino == inode
    assert sorted(os.listdir(tmp_path)) == ["s1-r0.pt", "s1-r1.pt"]
    assert _same_bits(read_capture(second), smaller)
    assert os.path.getsize(second) == capture_size(smaller)   # written to a file object, as counted
    recycle_capture(second, "r0")
    remove_recycled(str(tmp_path))
    assert os.listdir(tmp_path) == ["s1-r1.pt"]


def _storage_ptrs(capture: dict) -> set:
    return {t.untyped_storage().data_ptr() for t in capture.values() if isinstance(t, torch.Tensor)}


def test_a_ranks_captures_are_read_into_the_storages_its_earlier_ones_no_longer_use(tmp_path):
    from ddplab.compare.captures import ReadBuffers

    big = ReadBuffers.MIN_BYTES // 4 + 1   # float32 elements beyond the size a storage is reused from
    steps = [{"a": torch.full((big,), float(s)), "b": torch.full((big,), -float(s)), "n": s} for s in range(3)]
    for s, data in enumerate(steps):
        save_capture(data, str(tmp_path / f"{s}.pt"))
    buffers = ReadBuffers()
    first = read_capture(str(tmp_path / "0.pt"), into=buffers)
    held = first["a"][10:]                       # a view keeps its storage in use
    ptrs = _storage_ptrs(first)
    del first
    second = read_capture(str(tmp_path / "1.pt"), into=buffers)
    assert _same_bits(second, steps[1]) and _same_bits(held, steps[0]["a"][10:])
    assert buffers.reused == 1 and len(buffers) == 3
    reused = _storage_ptrs(second) & ptrs
    assert len(reused) == 1 and held.untyped_storage().data_ptr() not in reused
    del second, held
    third = read_capture(str(tmp_path / "2.pt"), into=buffers)
    assert _same_bits(third, steps[2]) and buffers.reused == 3
    assert len(buffers) == 2    # the storage this read did not need is given back before it
    if os.path.exists("/proc/self/maps"):   # the file is copied, never left mapped
        with open("/proc/self/maps") as maps:
            assert str(tmp_path) not in maps.read()


_HEAP_PROBE = """
import resource, sys, torch
from ddplab.compare.memory import BACKWARD_HEAP
if sys.argv[1] == "keep":
    BACKWARD_HEAP.keep()
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with BACKWARD_HEAP():
        t = torch.empty(16 * 2**20).fill_(1.0)   # 64 MiB, as a backward pass allocates a gradient
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[-1])
"""


def test_the_reference_process_allocates_its_gradients_where_the_last_ones_were_freed():
    import subprocess
    import sys

    pages = 64 * 2**20 // os.sysconf("SC_PAGESIZE")

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert faults("default") > pages // 2      # a new mapping each time: every page faulted in again
    assert faults("keep") < pages // 20        # the heap's pages, touched already
