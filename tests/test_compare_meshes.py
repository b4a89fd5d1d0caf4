"""Data parallel on device meshes: HSDP, TP and FSDP2 × TP on real gloo ranks, judged per axis.

The default suite runs the README's two mesh examples verbatim (real
``DeviceMesh``, ``fully_shard`` and ``parallelize_module`` at W=4: HSDP with
micro-batches, FSDP2 over tensor parallelism with the sequence-parallel plan)
as one module-scoped pair of comparisons and asserts on their records and
verdicts, plus the loss divided by local token counts; the pure parts (the
layout, the plans, the checks, the evidence on records written by hand) run
without a process. ``-m slow`` runs every correct mesh configuration and
every planted fault over 5 seeds, and the sized faults at one ulp.
"""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
from readme import README, python_blocks, readme_section
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ddplab import compare
from ddplab.compare import evidence, mesh_evidence, mesh_examples, mesh_faults
from ddplab.compare.meshes import FSDP2TP, HSDP, TP, MeshLayout, resolve_plan

SECTION = "Meshes: HSDP and tensor parallel"


# --------------------------------------------------------------------------- without a process


def test_the_layout_names_coordinates_axes_and_partners():
    layout = MeshLayout(("dp", "tp"), (2, 2))
    assert [layout.coordinate(r) for r in range(4)] == [dict(dp=0, tp=0), dict(dp=0, tp=1),
                                                        dict(dp=1, tp=0), dict(dp=1, tp=1)]
    assert (layout.axis_of((0, 2)), layout.axis_of("2,3"), layout.axis_of((0, 1, 2, 3))) == ("dp", "tp", "dp+tp")
    assert layout.peers(3, "dp") == [1, 3] and MeshLayout.parse(layout.text) == layout
    tp = FSDP2TP()
    assert (tp.shares, [tp.share_of(r, 4) for r in range(4)]) == (2, [0, 0, 1, 1])
    assert [tp.twin_partner(r) for r in range(4)] == [0, 1, 0, 1]
    hsdp = HSDP()
    assert (hsdp.shares, [hsdp.share_of(r, 4) for r in range(4)]) == (4, [0, 1, 2, 3])
    # A replicate all-reduce reduces the rank's own shard: its partner holds the same shard.
    assert [hsdp.twin_partner(r, (r % 2, r % 2 + 2)) for r in range(4)] == [0, 1, 0, 1]
    assert [hsdp.twin_partner(r, (2 * (r // 2), 2 * (r // 2) + 1)) for r in range(4)] == [0, 0, 0, 0]
    assert (TP(2).shares, TP(2).pieces, TP(2, k=2).pieces) == (1, 1, 2)


def test_plans_resolve_by_default_and_bad_ones_are_refused_before_any_rank():
    digits = compare.examples.digits_setup().build_model()
    plan = resolve_plan(None, digits)
    assert {n: type(s) for n, s in plan.items()} == {"1": ColwiseParallel, "3": RowwiseParallel}
    lm = mesh_examples.token_setup().build_model()
    assert set(resolve_plan(None, lm)) == {"attn.q", "attn.k", "attn.v", "attn.o", "ffn.up", "ffn.down"}
    with pytest.raises(ValueError, match="attn.nope"):
        resolve_plan({"attn.nope": ColwiseParallel()}, lm)
    with pytest.raises(ValueError, match="no default tensor-parallel plan"):
        resolve_plan(None, torch.nn.Linear(2, 2))
    # compare.run refuses it before the reference launches.
    with pytest.raises(ValueError, match="attn.nope"):
        compare.run(mesh_examples.token_setup(), [TP(2, plan={"attn.nope": ColwiseParallel()})], progress=False)


@pytest.mark.parametrize("bad", [lambda: HSDP(replicate=0), lambda: HSDP(no_sync="never"),
                                 lambda: FSDP2TP(dp=2, tp="2"), lambda: TP(2, plan={"1": "colwise"}),
                                 lambda: TP(2, mp_policy=MixedPrecisionPolicy()),
                                 lambda: HSDP(mp_policy=torch.bfloat16)])
def test_bad_mesh_configurations_are_refused(bad):
    with pytest.raises(ValueError):
        bad().validate()


def _state(op, group, dtype, grad_of="", unit="", inputs=None, outputs=None):
    return dict(type="CollectiveRecord", op=op, group_ranks=group, dtype=dtype, extra=dict(grad_of=grad_of, unit=unit),
                tensors=dict(inputs=inputs or [], outputs=outputs or []), error=None)


def test_precision_names_the_axis_op_and_parameter_of_a_reduction_off_its_declared_dtype():
    config = FSDP2TP(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    caps = [dict(collectives=[_state("allreduce", (r - r % 2, r - r % 2 + 1), "bfloat16"),
                              _state("allreduce", (r - r % 2, r - r % 2 + 1), "bfloat16", "attn.norm.weight", "attn.norm"),
                              _state("reduce_scatter_single", (r % 2, r % 2 + 2), "float32", "a,b", "attn.norm")])
            for r in range(4)]
    rows = mesh_evidence.precision_records(config, 0, caps, torch.float32)
    wrong = [(r["axis"], r["op"], r["kind"], r["param"]) for r in rows if r["dtype"] != r["declared"]]
    assert wrong == [("tp", "allreduce", "gradient", "attn.norm.weight")]
    assert {(r["axis"], r["kind"], r["declared"]) for r in rows} == {
        ("tp", "activation", "bfloat16"), ("tp", "gradient", "float32"), ("dp", "gradient", "float32")}


def test_partial_sums_held_in_the_reduce_dtype_differ_from_the_gradients_dtype_sum():
    config = HSDP(k=3, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randn(64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    held = pieces[0]
    for piece in pieces[1:]:
        held = piece + held                                     # what torch 2.13 does: bfloat16 partial sums
    exact = (pieces[0].float() + pieces[1].float() + pieces[2].float()).to(torch.bfloat16)
    scatters = [_state("reduce_scatter_single", (0, 1), "bfloat16", "w", "u", outputs=[p]) for p in pieces]
    for live, differs in ((held, True), (exact, False)):
        caps = [dict(collectives=scatters + [_state("allreduce", (0, 2), "bfloat16", "w", "u", inputs=[live])])]
        rows = mesh_evidence.partial_sum_records(config, 0, caps, torch.float32)
        assert [(r["metric"], r["unit"], r["value"] > 0) for r in rows] == [("partial_sum_differing", "u", differs)]


def test_the_mesh_sources_are_in_the_registry_and_the_readme_table():
    names = [source.name for source in evidence.EVIDENCE]
    assert names.index("mesh_replicas") < names.index("replicas")
    assert names.index("collectives") < names.index("mesh_precision") < names.index("partial_sums") < names.index("twin")
    table = evidence.verdict_table()
    assert all(f"`{name}`" in table for name in ("mesh_replicas", "mesh_precision", "partial_sums"))
    assert table in README.read_text()


def test_case_05_accepts_the_mesh_configuration_names():
    from ddplab.cases.your_training import CASE, resolve_configurations

    params = CASE.check_params({"configurations": ["hsdp", "hsdp_bf16", "tp", "fsdp2_tp", "fsdp2_tp_bf16"]})
    built = resolve_configurations(params)
    assert [type(c) for c in built] == [HSDP, HSDP, TP, FSDP2TP, FSDP2TP]
    assert (built[0].k, built[1].dtypes(), built[4].dtypes()) == (params["k"], (torch.bfloat16,) * 2,
                                                                   (torch.bfloat16,) * 2)


# --------------------------------------------------------------------------- on real meshes


@pytest.fixture(scope="module")
def readme_meshes(warm_launcher):
    """The README's two examples, run verbatim in one namespace: ``hsdp`` and ``tp``, and what they print."""
    namespace = {"__name__": "readme_meshes"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for block in python_blocks(readme_section(SECTION)):
            exec(compile(block, "README.md", "exec"), namespace)
    return namespace["hsdp"], namespace["tp"], printed.getvalue()


def _verdicts(result):
    return {label: v for label, v in result.verdicts.items()}


@pytest.mark.slow  # the README's mesh examples (~30 s); the default suite runs a planted mesh fault
def test_hsdp_with_micro_batches_reads_rounding_and_bf16_partial_sums_a_bug_on_the_replicate_axis(readme_meshes):
    hsdp, _, printed = readme_meshes
    correct, partial = _verdicts(hsdp).values()
    assert correct.kind == "rounding", correct.headline
    assert correct.finding("mesh_replicas").holds and correct.finding("mesh_precision").holds
    assert correct.finding("partial_sums").holds and correct.finding("twin").holds
    assert (partial.kind, partial.evidence, partial.values["axis"]) == ("bug", "partial_sums", "replicate")
    assert (partial.values["partial_step"], partial.values["partial_dtype"],
            partial.values["partial_accumulated_in"]) == (0, "bfloat16", "float32")
    assert partial.values["first_coordinate"] == "replicate=0, shard=0"
    assert str(hsdp.kinds) in printed


@pytest.mark.slow
def test_fsdp2_over_tp_names_the_tp_all_reduce_that_ignores_reduce_dtype_and_the_drifting_norm(readme_meshes):
    _, tp, printed = readme_meshes
    correct, precision, unsynchronized = _verdicts(tp).values()
    assert correct.kind == "rounding", correct.headline
    # Backward reaches the feed-forward's norm first: its gradient's all-reduce is the first off the policy.
    assert (precision.kind, precision.evidence, precision.values["axis"], precision.values["precision_op"],
            precision.values["first_param"], precision.values["precision_dtype"],
            precision.values["precision_declared"]) == ("bug", "mesh_precision", "tp", "allreduce",
                                                        "ffn.norm.weight", "bfloat16", "float32")
    records = tp.records
    wrong = records[(records["metric"] == "mesh_reduction_dtype") & (records["config"] == "bf16/fp32")
                    & (records["dtype"] != records["declared"])]
    assert set(wrong["param"]) == {f"{block}.norm.{p}" for block in ("attn", "ffn") for p in ("weight", "bias")}
    assert set(wrong["axis"]) == {"tp"} and set(wrong["kind"]) == {"gradient"}
    assert precision.finding("mesh_replicas").holds  # all-reduced in bf16, but alike on every rank
    assert (unsynchronized.kind, unsynchronized.evidence, unsynchronized.values["axis"],
            unsynchronized.values["first_param"], unsynchronized.values["replica_step"],
            unsynchronized.values["first_coordinate"]) == ("bug", "mesh_replicas", "tp", "attn.norm.weight", 0,
                                                           "dp=0, tp=1")
    assert str(tp.kinds) in printed
    for label, v in tp.verdicts.items():
        assert (f"{label} | {v.evidence} {v.values.get('axis')} {v.values['first_param']}" in printed) == (v.kind == "bug")


@pytest.mark.slow
def test_every_collective_on_every_sub_group_is_verified_and_carries_its_axis(readme_meshes):
    _, tp, _ = readme_meshes
    records = tp.records
    checked = records[(records["metric"] == "collective_elements_differing")]
    assert not checked.empty and (checked["value"] == 0).all()
    assert set(checked["axis"]) == {"dp", "tp"}
    assert {"reduce_scatter_single", "all_gather_single", "allreduce",
            "reduce_scatter_single_coalesced"} <= set(checked["op"])
    assert records[records["metric"] == "collective_unverified"].empty


@pytest.mark.slow
def test_shards_are_reassembled_under_the_references_names_and_twins_pair_by_tensor_parallel_coordinate(
        readme_meshes):
    _, tp, _ = readme_meshes
    records, label = tp.records, next(iter(tp.verdicts))
    names = set(mesh_examples.token_setup().build_model().state_dict())
    deviation = records[(records["metric"] == "deviation") & (records["config"] == label)]
    assert set(deviation["param"]) - {"(model)"} == names
    twin = records[(records["metric"] == "twin_differing") & (records["config"] == label)]
    assert dict(zip(twin["rank"], twin["partner"])) == {2: 0, 3: 1} and (twin["value"] == 0).all()
    replicas = records[(records["metric"] == "mesh_replica_differing") & (records["config"] == label)]
    # Along tp: the norms (SequenceParallel), the biases of the row-wise layers, everything outside the plan.
    assert set(replicas["axis"]) == {"tp"} and "attn.norm.weight" in set(replicas["param"])


@pytest.fixture(scope="module")
def local_token_mean(warm_launcher):
    example = mesh_examples.planted_example("local_token_mean", steps=2)
    return example, compare.run(example.setup, example.configurations, progress=False)


def test_a_loss_divided_by_local_token_counts_is_a_bug_along_the_data_axis(local_token_mean):
    example, result = local_token_mean
    config = example.configurations[0]
    v = result.verdict(config)
    assert (v.kind, v.evidence, v.values["axis"]) == ("bug", "float64", "dp"), v.headline
    assert v.finding("twin").holds  # every data-parallel rank divides alike: only float64 sees it


# --------------------------------------------------------------------------- slow: seeds and sizes


def _as_expected(verdict, expected) -> bool:
    if expected.verdict == "rounding":
        return verdict.kind in ("rounding", "exact")
    values = verdict.values
    return (verdict.kind == expected.verdict and (expected.evidence is None or verdict.evidence == expected.evidence)
            and (expected.axis is None or values.get("axis") == expected.axis)
            and (expected.param is None or values.get("first_param") == expected.param)
            and (expected.op is None or expected.op in (values.get("precision_op"), "allreduce")))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_correct_mesh_configurations_read_rounding_and_planted_faults_bug_over_seeds(warm_launcher, seed):
    examples = [mesh_examples.correct(seed, steps=2)] + mesh_examples.planted(seed, steps=2)
    for example in examples:
        result = compare.run(example.setup, example.configurations, progress=False)
        for config in example.configurations:
            v = result.verdict(config)
            assert _as_expected(v, example.expected[config.label]), (seed, config.label, v.headline)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tp_replica", "replicate_replica", "loss_scale"])
def test_a_one_ulp_fault_on_one_rank_of_a_mesh_is_a_bug_on_its_axis(warm_launcher, kind):
    fault = mesh_faults.plant(kind, "ulp")
    v = compare.run(fault.setup, [fault.config], progress=False).verdict(fault.config)
    assert (v.kind, v.evidence, v.values["axis"], v.values["first_rank"]) == (
        "bug", fault.evidence, fault.axis, fault.rank), v.headline

