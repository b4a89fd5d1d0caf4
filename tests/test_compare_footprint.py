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


def test_the_footprint_counts_every_run_and_step_and_refuses_with_the_figures():
    sizes = {"reference": 100, "truth": 200, "promise W=2": 200}
    need = footprint.footprint(sizes, 3, [(2, False, False), (2, True, True)], alongside=True)
    # Scratch: 3 steps of the reference runs (500) and of each configuration's ranks: 2 x 100, then
    # 2 x (100 + 100 twin + 200 float64).
    assert need.scratch_bytes == 3 * (500 + 200 + 800) and need.written_bytes == 3 * 500
    assert need.parent_bytes == 500 + 2 * 200 + 200             # a step of what one configuration reads
    assert need.ranks_bytes == 2 * (100 + 100 + 200)            # the three launches' captures at once
    apart = footprint.footprint(sizes, 3, [(2, True, True)], alongside=False)
    assert apart.ranks_bytes == 2 * 200
    footprint.check_fits(need, memory=need.memory_bytes, disk=need.scratch_bytes - need.written_bytes)
    with pytest.raises(ValueError, match=r"at least 2\.9 KiB more of scratch disk, and 1\.0 KiB are free"):
        footprint.check_fits(need, memory=10**9, disk=1024)
    with pytest.raises(ValueError, match=r"at least 1\.1 KiB of memory .* and 100 B are available"):
        footprint.check_fits(need, memory=100, disk=10**9)


def test_what_a_comparison_needs_is_stated_and_never_more_than_it_writes(no_leftovers, monkeypatch):
    written = {}
    analyse = comparison._Session.analyse

    def measured(self, *args, **kwargs):     # the scratch once every run trained, before any is read
        written.setdefault("bytes", sum(os.path.getsize(os.path.join(base, f))
                                        for base, _, files in os.walk(self.root) for f in files))
        return analyse(self, *args, **kwargs)

    monkeypatch.setattr(comparison._Session, "analyse", measured)
    custom = compare.Custom(2, k=2, train_step=examples.accumulate_correctly)   # with its twin and float64 run
    result = compare.run(examples.digits_setup(0, steps=2), [compare.DDP(2), custom], progress=False)
    need = result.footprint
    assert 0 < need.written_bytes < need.scratch_bytes <= written["bytes"]
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


@needs_mount
def test_a_comparison_whose_scratch_cannot_fit_the_disk_is_refused_before_any_configuration(tmp_path):
    # 180K parameters, 3 steps: the reference runs write about 22 MB, the configuration at least 9 MB more.
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    disk = tmp_path / "disk"
    proc = on_tmpfs(disk, "size=26m", [sys.executable, str(driver), str(disk)], cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["refused"] and "more of scratch disk" in seen["refused"], seen
    assert not seen["configuration_ran"]
