"""A configuration's twin and float64 run start alongside its run when memory allows, and the
parent reads each capture once while a small comparison fits its spare bytes: the verdicts are
the same either way."""
from __future__ import annotations

import torch

from ddplab import compare
from ddplab.compare import comparison, examples, faults
from ddplab.compare.captures import PACKED_NUMEL, CaptureCache, Captures, read_capture, save_capture
from ddplab.compare.runners import capture_path


def _evidence(result, label):
    v = result.verdict(label)
    # To 12 digits: the parent's least-squares fit of the float64 factor may differ in the last bit
    # on a process's first comparison (its BLAS warming up); the ranks' values are bitwise the same.
    own = {key: {name: f"{value:.12g}" if isinstance(value, float) else value
                 for name, value in v.finding(key).values.items()} for key in ("twin", "float64")}
    return v.kind, v.evidence, v.difference, own


def test_alongside_or_one_after_another_the_verdict_is_the_same(no_leftovers, monkeypatch):
    fault = faults.plant_custom("loss_term", 1e-6, steps=2)   # a loss term on rank 1: the twin's to find
    setup = fault.setup
    configs = [compare.Custom(2, k=2, train_step=examples.accumulate_correctly), fault.config]
    together = compare.run(setup, configs, progress=False)
    # A model above the size whose launches start together: one launch at a time.
    monkeypatch.setattr(comparison, "ALONGSIDE_NUMEL", 0)
    apart = compare.run(setup, configs, progress=False)
    for config in configs:
        assert _evidence(together, config.label) == _evidence(apart, config.label)
    assert together.verdict(configs[0]).kind == "rounding"
    assert fault.placed(together.verdict(configs[1]))


def _write(root, run_id: str, steps: int, numel: int) -> None:
    for step in range(steps):
        path = capture_path(str(root), run_id, step, 0)
        (root / run_id).mkdir(exist_ok=True)
        save_capture({"params": {"w": torch.full((numel,), float(step))}}, path)


def test_a_capture_reads_back_as_written_its_small_tensors_views_of_one_buffer_per_dtype(tmp_path):
    data = {"params": {"w": torch.randn(3, 4), "b": torch.randn(4).t()}, "step": 2, "loss": None,
            "big": torch.randn(PACKED_NUMEL + 1), "mask": torch.tensor([True, False]),
            "collectives": [{"op": "allreduce", "tensors": {"inputs": [torch.arange(6).reshape(2, 3)]},
                             "shapes": ((2, 3),)}], "strided": torch.randn(5, 4)[:, 1],
            "half": torch.randn(3).bfloat16(), "empty": torch.empty(0, 2)}
    path = str(tmp_path / "capture.pt")
    save_capture(data, path)
    back = read_capture(path)

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
        return a == b

    assert same(data, back)
    w, b = back["params"]["w"], back["params"]["b"]
    assert w.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()   # one float32 buffer
    assert back["big"].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_the_cache_keeps_its_last_captures_and_older_ones_within_its_spare_bytes(tmp_path):
    _write(tmp_path, "run", steps=4, numel=1000)     # about 4 KB a capture
    small = CaptureCache(2, spare_bytes=0)
    caps = Captures(small, str(tmp_path), "run", 0, 4)
    for _ in range(2):
        assert [float(c["params"]["w"][0]) for c in caps] == [0.0, 1.0, 2.0, 3.0]
    assert small.reads == 8                          # two kept of four: every pass reads them all again
    roomy = CaptureCache(2, spare_bytes=10**6)
    caps = Captures(roomy, str(tmp_path), "run", 0, 4)
    for _ in range(2):
        assert [float(c["params"]["w"][0]) for c in caps] == [0.0, 1.0, 2.0, 3.0]
    assert roomy.reads == 4                          # all four fit the spare bytes: read once
    tight = CaptureCache(1, spare_bytes=5000)        # one capture and a bit: the last one, or two
    caps = Captures(tight, str(tmp_path), "run", 0, 4)
    list(caps)
    assert 1 <= len(tight._items) <= 2 and (str(tmp_path), "run", 0, 3) in tight._items


def _slow_accumulation(ctx):
    """Correct accumulation, a fifth of a second a step: a stop or a crash lands while every launch runs."""
    import time

    time.sleep(0.2)
    return examples.accumulate_correctly(ctx)


def _crash_in_float32_on_rank_1_at_step_1(ctx):
    """Raises where the configuration runs in float32 (the run and its twin), not in its float64 run."""
    if ctx.rank == 1 and ctx.step == 1 and ctx.shard[0].dtype == torch.float32:
        raise RuntimeError("rank 1 crashed at step 1")
    return _slow_accumulation(ctx)


def _variant_steps(launch_and_run):
    """The steps the twin's and the float64 run's ranks finished (the launches that stream to no callback)."""
    from ddplab import launcher

    steps = []

    def seen(run, rec):
        if run.on_record is None and rec.get("metric") == "grad_norm":
            steps.append(rec["step"])

    with launcher.observe(seen):
        result = launch_and_run()
    return result, steps


def test_a_stop_during_the_run_ends_its_twin_and_float64_run_too(no_leftovers):
    from ddplab import launcher

    config = compare.Custom(2, k=2, train_step=_slow_accumulation)

    def progress(label, step, steps):
        if label == config.label:
            launcher.stop_all()  # what the explorer's Stop button does, at the run's first step

    result, steps = _variant_steps(lambda: compare.run(examples.digits_setup(0, steps=6), config, progress=progress))
    v = result.verdict(config)
    assert result.stopped and v.kind == "stopped" and 1 <= v.steps_completed < 6
    assert max(steps, default=-1) < 5                # stopped with the run, not trained to the end
    frame = result.records
    assert not frame["metric"].isin(["twin_differing", "float64_distance", "evidence_unavailable"]).any()


def test_a_run_that_crashes_stops_its_float64_run_and_the_comparison_goes_on(no_leftovers):
    crashing = compare.Custom(2, k=2, train_step=_crash_in_float32_on_rank_1_at_step_1)
    after = compare.DDP(2)
    result, steps = _variant_steps(lambda: compare.run(examples.digits_setup(0, steps=6), [crashing, after],
                                                       progress=False))
    assert result.verdict(crashing).kind == "crashed" and not result.stopped
    assert max(steps, default=-1) < 5                # the float64 run did not train on for nothing
    assert result.verdict(after).kind == "exact"     # the next configuration still ran
