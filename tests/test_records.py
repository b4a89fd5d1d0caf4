"""The tidy record shape, sinks, results directories and verdicts."""
from __future__ import annotations

import json

import pytest

import ddplab
from ddplab import records
from ddplab.artifacts import load_results, read_jsonl, save_results, write_jsonl
from ddplab.verdict import VERDICT_MIME, Finding, Verdict, verdicts_from_notebook


def test_record_shape_and_labels():
    rec = records.record("loss", 0.5, step=2, rank=1, order="gloo", world_size=4)
    assert list(rec)[:5] == list(records.RECORD_COLUMNS)
    assert rec["order"] == "gloo" and rec["value"] == 0.5


@pytest.mark.parametrize("bad, exc", [
    (dict(metric="", value=1.0), ValueError),
    (dict(metric="x", value="high"), TypeError),
    (dict(metric="x", value=1.0, step=1.5), TypeError),
    (dict(metric="x", value=1.0, metric_label=[1, 2]), TypeError),
    (dict(metric="x", value=1.0, value_label=1, **{"bad name": 1}), ValueError),
])
def test_bad_records_are_rejected(bad, exc):
    metric, value = bad.pop("metric"), bad.pop("value")
    with pytest.raises(exc):
        records.record(metric, value, **bad)


def test_tensor_scalars_become_floats():
    import torch
    assert records.record("x", torch.tensor(2.5))["value"] == 2.5


def test_emit_sinks_collect_and_buffer():
    with records.collect() as recs:
        with records.labels(order="nccl_ring"):
            ddplab.emit("loss", 1.0, step=0)
        ddplab.emit("loss", 2.0, step=1)
    assert [r["order"] if "order" in r else None for r in recs] == ["nccl_ring", None]
    records.drain()
    ddplab.emit("orphan", 3.0)  # no sink: kept, not lost
    assert [r["metric"] for r in records.drain()] == ["orphan"]


def test_to_frame_is_tidy_with_nullable_indices():
    frame = ddplab.to_frame([records.record("a", 1, step=0), records.record("b", 2.0, bucket=3, param="w")])
    assert list(frame.columns) == ["step", "rank", "bucket", "metric", "value", "param"]
    assert str(frame["step"].dtype) == "Int64" and frame["value"].dtype == float
    assert frame["step"].isna().tolist() == [False, True]


def test_results_directory_round_trip(tmp_path):
    recs = [records.record("loss", 0.25, step=s, rank=r, order="gloo") for s in range(3) for r in range(2)]
    verdict = Verdict("demo", "rounding", "all within the bound",
                      [Finding("bound", "errors within the bound", True, "max ratio {ratio}",
                               {"ratio": 0.4})], scope="the reduction", key_numbers={"ratio": "ratio"},
                      values={"ratio": 0.4})
    save_results(tmp_path, records=ddplab.to_frame(recs), verdict=verdict,
                 params={"world_sizes": [2, 4]}, environment={"torch": "x"})
    back = load_results(tmp_path)
    assert back.records.equals(ddplab.to_frame(recs))
    assert back.verdict.holds("bound") and back.params == {"world_sizes": [2, 4]}
    assert back.verdict.to_dict() == verdict.to_dict()
    assert back.verdict.finding("bound").values == {"ratio": 0.4}
    with pytest.raises(FileNotFoundError, match="not a ddplab results directory"):
        load_results(tmp_path / "missing")


def test_jsonl_survives_a_truncated_last_line(tmp_path):
    path = tmp_path / "rank0.jsonl"
    write_jsonl(path, [records.record("x", i) for i in range(3)])
    with open(path, "a") as fh:
        fh.write('{"step": null, "rank": 0, "metr')
    assert [r["value"] for r in read_jsonl(path)] == [0.0, 1.0, 2.0]


def test_verdict_rendering_and_notebook_extraction():
    v = Verdict("c", "bug", "a | b", [Finding("k", "claim | x", False, "ratio {r}", {"r": 1e6})])
    bundle = v._repr_mimebundle_()
    markdown = bundle["text/markdown"]
    assert "✘ does not hold" in markdown
    # A "|" in the text cannot split a table cell: every row keeps its 3 cells.
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    assert len(rows) == 3 and all(row.count("|") == 4 for row in rows)
    assert bundle["text/plain"].splitlines()[0] == "Verdict (bug): a | b"
    cells = [{"outputs": [{"data": {VERDICT_MIME: bundle[VERDICT_MIME]}}]}]
    assert verdicts_from_notebook(cells)[0].finding("k").evidence == "ratio 1e6"
    assert verdicts_from_notebook(cells)[0].finding("k").values == {"r": 1e6}
    assert json.loads(v.to_json())["kind"] == "bug"
    with pytest.raises(KeyError, match="no finding 'nope'"):
        v.finding("nope")


def test_canonical_order_ignores_arrival_order():
    recs = [records.record("m", float(i % 3), step=i % 2, rank=i % 2, bucket=i) for i in range(6)]
    a, b = ddplab.to_frame(recs), ddplab.to_frame(list(reversed(recs)))
    assert not a.equals(b)
    assert records.canonical(a).equals(records.canonical(b))


def test_findings_render_their_numbers_from_one_template():
    f = Finding("k", "reproduces the report's {norm:r}", True,
                "K = {lanes}: {norms:r}; ratio {ratio}, {missing}", 
                {"norm": 5.65625, "lanes": [4, 8], "norms": [4.0, 5.65625], "ratio": 0.52973,
                 "missing": float("nan")})
    assert f.claim_text == "reproduces the report's 5.65625"
    assert f.evidence == "K = 4, 8: 4.0, 5.65625; ratio 0.5297, n/a"
    with pytest.raises(KeyError, match="'absent' has no value"):
        Finding("k", "c", True, "{absent}", {})
    v = Verdict("c", "rounding", "within {r}", [f], values={"r": 0.5, "n": 3}, scope="s",
                key_numbers={"bound ratio": "r", "steps": "n:d"})
    assert v.headline == "within 0.5" and v.key_table() == [("bound ratio", "0.5"), ("steps", "3")]
    with pytest.raises(KeyError, match="key_numbers name values it lacks"):
        Verdict("c", "rounding", "x", [f], key_numbers={"a": "absent"})
