"""The record schema (labkit.core.schema): the byte sums every reader of a census uses."""

from labkit.core import schema

CENSUS = {"param_bytes": 100, "grad_bytes": 40, "optim_bytes": 800, "master_bytes": 400,
          "host_optim_bytes": 1200, "host_grad_bytes": 40, "buffer_bytes": 7}


def test_state_host_and_device_bytes_of_an_offloaded_census():
    assert schema.state_bytes(CENSUS) == 1340  # buffers are not model states
    assert schema.host_bytes(CENSUS) == 1240
    assert schema.device_bytes(CENSUS) == 100  # the parameters only: everything else offloaded
    assert schema.device_bytes(CENSUS, activation_bytes=25) == 125


def test_absent_and_none_count_as_zero():
    assert schema.device_bytes({"param_bytes": 10, "grad_bytes": None}, None) == 10  # type: ignore[arg-type]
    assert schema.state_bytes({}) == 0


def test_the_census_keys_are_the_typed_census():
    assert set(schema.CENSUS_KEYS) == set(schema.Census.__annotations__)
    assert set(schema.CENSUS_KEYS) <= set(schema.StepRecord.__annotations__) & set(schema.DoneRecord.__annotations__)
