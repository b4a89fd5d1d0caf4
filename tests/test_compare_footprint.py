"""What a comparison needs of the machine: stated before any configuration runs, a lower bound of
what it really uses, and a refusal with the figures when the machine lacks it."""
from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

from ddplab import compare
from ddplab.compare import comparison, examples, footprint

from mounts import needs_mount, on_tmpfs

REPO = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench"), os.environ.get("PYTHONPATH", "")]),
       "TQDM_DISABLE": "1"}


def test_the_footprint_counts_a_step_of_a_pass_and_refuses_with_the_figures():
    sizes = {"reference": 100, "truth": 200}
    need = footprint.footprint(sizes, [(2, False, False), (2, True, True)], alongside=True)
    # A pass: the configuration's rank 0 (100: the other rank writes only what differs from it), and
    # with its twin and float64 run alongside, their rank 0 (100 + 200). The reference runs judge where
    # they train and write nothing. One of its steps on disk, whatever the steps: the parent deletes a
    # step once it holds it.
    assert need.parent_bytes == need.scratch_bytes == 100 + (100 + 200)
    assert footprint.footprint(sizes, [(2, False, False)], alongside=True).scratch_bytes == 100
    assert need.ranks_bytes == 2 * (100 + 100 + 200) + 200      # the three launches' captures and the truth's
    apart = footprint.footprint(sizes, [(2, True, True)], alongside=False)
    assert apart.parent_bytes == max(100, 100 + 200)           # the run's pass, then the variants'
    assert apart.ranks_bytes == 2 * 200 + 200
    # A small model's reference runs are written for the parent to judge: the truth and the reference too.
    kept = footprint.footprint(sizes, [(2, False, False), (2, True, True)], alongside=True, references_on_disk=True)
    assert kept.scratch_bytes == 100 + 200 + 100 + (100 + 200)
    assert footprint.footprint(sizes, [(2, True, True)], alongside=False,
                               references_on_disk=True).parent_bytes == max(100 + 200 + 100, (100 + 200) + 200)
    footprint.check_fits(kept, memory=kept.memory_bytes, disk=kept.scratch_bytes)
    with pytest.raises(ValueError, match=r"at least 700 B of scratch disk, and 512 B are free"):
        footprint.check_fits(kept, memory=10**9, disk=512)
    with pytest.raises(ValueError, match=r"at least 1000 B of memory .* and 100 B are available"):
        footprint.check_fits(kept, memory=100, disk=10**9)


def test_what_a_comparison_needs_is_stated_and_never_more_than_it_holds(no_leftovers, monkeypatch, tmp_path):
    import collections
    import tempfile
    import threading

    from ddplab.compare import streaming

    held, files_per_rank, done, folders = [0], [0], threading.Event(), set()

    def poll():                     # the scratch folder, every 2 ms: its bytes and each rank's files in it
        while not done.wait(0.002):
            # a rank's captures, and those kept for it to write over: "s000001-r0001.pt",
            # "recycled-r0001-s000000-r0001.pt"
            files = [(base, f) for base, _, names in os.walk(tmp_path) for f in names if f.endswith(".pt")]
            try:
                held.append(sum(os.path.getsize(os.path.join(base, f)) for base, f in files))
            except FileNotFoundError:
                continue            # deleted between the listing and the size
            ranks = collections.Counter((base, f.rsplit("-", 1)[1]) for base, f in files)
            files_per_rank.append(max(ranks.values(), default=0))
            folders.update(tuple(os.path.relpath(base, tmp_path).split(os.sep)[1:]) for base, _ in files)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(comparison, "KEEP_REFERENCES_BYTES", 0)   # as for a large model: references stream too
    custom = compare.Custom(2, k=2, train_step=examples.accumulate_correctly)   # with its twin and float64 run
    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        result = compare.run(examples.digits_setup(0, steps=6), [compare.DDP(2), custom], progress=False)
    finally:
        done.set()
        watcher.join()
    need = result.footprint
    assert 0 < need.scratch_bytes <= max(held)
    # Flat in steps: no rank ever had more than LAG files of its 6 steps on disk -- a rank writes the next
    # step once every reader took this one, over this one's file.
    assert max(files_per_rank) == streaming.LAG, files_per_rank
    # The reference runs wrote nothing, not even the first step the figures are measured on: they judge
    # where they train. Only the configurations' runs (and their twins and float64 runs) reach the disk.
    assert folders and all(run.startswith("config") for _, run in folders), folders
    stated = result.records[result.records["metric"] == "expected_scratch_bytes"]
    assert stated["value"].tolist() == [need.scratch_bytes]


DRIVER = """
import json, sys, tempfile
import bench_compare_scale as scale
from ddplab import compare, launcher
launcher.launch(lambda: 1, world_size=1)   # the forkserver's socket stays in the usual (short) temp folder
tempfile.tempdir = sys.argv[1]
seen = []
with launcher.observe(lambda run, rec: seen.append(rec)):
    try:
        compare.run(scale.setup_for(300, 3), compare.DDP(2), progress=False)
        print(json.dumps({"refused": None}))
    except ValueError as exc:
        print(json.dumps({"refused": str(exc), "configuration_ran": any(r.get("config") == "ddp W=2" for r in seen)}))
"""


def _on_tmpfs(tmp_path, script: str, size: str) -> dict:
    """``script`` run with a ``size`` tmpfs as its scratch folder: what it printed last, as JSON."""
    driver = tmp_path / "driver.py"
    driver.write_text(script)
    disk = tmp_path / "disk"
    proc = on_tmpfs(disk, f"size={size}", [sys.executable, str(driver), str(disk)], cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]   # nothing escaped compare.run
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_mount
def test_a_comparison_whose_scratch_cannot_fit_the_disk_is_refused_before_any_configuration(tmp_path):
    # 180K parameters (0.7 MB): a pass of DDP(2) holds a step of the truth (2.9 MB), the reference and
    # rank 0 (1.4 MB each) at least: 5.7 MB, and 5 MiB are free (the first launch's 4.3 MB fit).
    seen = _on_tmpfs(tmp_path, DRIVER, "5m")
    assert seen["refused"] and "of scratch disk" in seen["refused"], seen
    assert not seen["configuration_ran"]


FILLS = """
import json, sys, tempfile
import bench_compare_scale as scale
from ddplab import compare, launcher
launcher.launch(lambda: 1, world_size=1)   # the forkserver's socket stays in the usual (short) temp folder
tempfile.tempdir = sys.argv[1]
configs = [compare.DDP(2), compare.DDP(2, name="again")]
result = compare.run(scale.setup_for(300, 4), configs, progress=False)
status = result.records[result.records["metric"] == "steps_completed"].set_index("config")
print(json.dumps({"kinds": result.kinds, "stopped": result.stopped,
                  "errors": {k: str(e) for k, e in result.errors.items()},
                  "error_labels": status["error"].dropna().to_dict()}))
"""


@needs_mount
def test_a_scratch_disk_that_fills_during_a_comparison_ends_it_with_the_reason_and_keeps_what_was_judged(tmp_path):
    # The same 180K-parameter DDP(2) on 6 MiB: the stated 5.7 MB fits, a step and the next being written do not.
    seen = _on_tmpfs(tmp_path, FILLS, "6m")
    kinds = list(seen["kinds"].values())
    assert seen["stopped"] and "crashed" in kinds, seen
    full = kinds.index("crashed")
    assert all(kind == "exact" for kind in kinds[:full]) and all(kind == "not run" for kind in kinds[full + 1:]), seen
    label = list(seen["kinds"])[full]
    assert "disk filled" in seen["errors"][label] and seen["error_labels"][label].startswith("ScratchFull"), seen
