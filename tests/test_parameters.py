"""Case parameters: parsing papermill's strings, rejecting bad values by name."""
from __future__ import annotations

import pytest

from ddplab.cases import get_case
from ddplab.parameters import ROLES, Parameter, ParameterSet

PS = ParameterSet([
    Parameter("world_sizes", [2, 4], "ranks per run", kind="list[int]", minimum=1, role="world_size"),
    Parameter("orders", ["gloo", "exact"], "orders", kind="list[str]", choices=("gloo", "exact", "nccl_ring")),
    Parameter("dtype", "float64", "dtype", choices=("float32", "float64")),
    Parameter("steps", 20, "steps", kind="int", minimum=1, role="steps"),
    Parameter("lr", 0.1, "learning rate", kind="float", minimum=0),
    Parameter("same_init", True, "same init", kind="bool"),
    Parameter("data_root", None, "where CIFAR-10 lies", kind="path", nullable=True),
])


def test_defaults_validate():
    assert PS.validate() == PS.defaults()


@pytest.mark.parametrize("given, expected", [
    ({"world_sizes": "[2, 3]"}, [2, 3]),          # papermill -p passes lists as strings
    ({"world_sizes": "2,3"}, [2, 3]),
    ({"world_sizes": 3}, [3]),
    ({"world_sizes": (4,)}, [4]),
])
def test_list_parameters_from_strings(given, expected):
    assert PS.validate(given)["world_sizes"] == expected


def test_scalars_from_strings():
    got = PS.validate(steps="5", lr="1e-3", same_init="false", data_root="None")
    assert (got["steps"], got["lr"], got["same_init"], got["data_root"]) == (5, 1e-3, False, None)


@pytest.mark.parametrize("given, match", [
    ({"world_sizes": [0]}, r"parameter 'world_sizes': got \[0\].*>= 1"),
    ({"world_sizes": "[2, x"}, "parameter 'world_sizes'.*not a list"),
    ({"world_sizes": [2, 2]}, "duplicate"),
    ({"orders": ["gloo", "mpi"]}, "parameter 'orders'.*from gloo, exact, nccl_ring"),
    ({"dtype": "float16"}, "parameter 'dtype'.*from float32, float64"),
    ({"steps": 2.5}, "parameter 'steps'.*an integer"),
    ({"steps": True}, "parameter 'steps'"),
    ({"same_init": "maybe"}, "parameter 'same_init'.*true or false"),
    ({"wrold_sizes": [2]}, "unknown parameter.*'wrold_sizes'.*accepts: world_sizes"),
])
def test_bad_values_name_the_parameter(given, match):
    with pytest.raises(ValueError, match=match):
        PS.validate(given)


def test_unknown_case_is_named():
    with pytest.raises(ValueError, match="unknown case 'nope'; built-in cases: backend_divergence"):
        get_case("nope")


def test_roles_name_the_parameter_generic_code_reads():
    assert PS.with_role("world_size").name == "world_sizes" and PS.with_role("backend") is None
    params = PS.validate(steps=3)
    assert PS.role_value(params, "steps") == 3 and PS.role_value(params, "backend", "gloo") == "gloo"
    with pytest.raises(ValueError, match="unknown role 'ranks'"):
        PS.with_role("ranks")


@pytest.mark.parametrize("make, match", [
    (lambda: Parameter("w", 2, "ranks", kind="int", role="ranks"), "parameter 'w': role must be one of"),
    (lambda: Parameter("w", "2", "ranks", role="world_size"), "role 'world_size' needs kind int or list"),
    (lambda: ParameterSet([Parameter("a", 1, "a", kind="int", role="steps"),
                           Parameter("b", 1, "b", kind="int", role="steps")]), "'a' and 'b' both have the role"),
])
def test_bad_roles_are_refused_when_declared(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_every_builtin_case_names_the_parameter_that_sets_its_ranks():
    """torchrun's job size and the default launches find it by its role."""
    from ddplab.cases import builtin_cases

    for case in builtin_cases():
        assert case.parameters.with_role("world_size").kind in ROLES["world_size"], case.name


def test_roles_drive_the_default_launches_and_a_torchrun_jobs_size():
    from ddplab.cases import Case

    class Sizes(Case):
        name = "sizes"
        parameters = PS

    case = Sizes()
    params = case.check_params({"world_sizes": [2, 3], "steps": 7})
    assert [(p.world_size, p.steps, p.backend) for p in case.launches(params)] == [(2, 7, "gloo"), (3, 7, "gloo")]
    assert case.for_world_size(params, 4)["world_sizes"] == [4]
    with pytest.raises(ValueError, match="parameter 'world_sizes'.*this job has 4 ranks"):
        case.for_world_size(params, 4, overridden={"world_sizes": [2, 3]})
