"""FSDP placement rules (the forward on a (data=2, fsdp=2, expert=2) mesh of 8 fake CPU devices
equals one device's: ``sharded_forward_check.py``, run by tests/rl/test_multiprocess.py in the
process of its other 8-device checks)."""

from jax.sharding import PartitionSpec

from trace_jax.model.sharding import logical_to_spec, param_spec


def test_logical_axes_map_to_mesh_axes():
    assert logical_to_spec(("expert", "embed", "mlp")) == PartitionSpec("expert", None, None)
    assert logical_to_spec(("batch", None)) == PartitionSpec(("data", "fsdp"), None)
    assert logical_to_spec(None) == PartitionSpec()


def test_fsdp_splits_the_largest_dimension_it_divides_that_no_other_axis_splits():
    sizes = {"data": 2, "fsdp": 4, "expert": 2}
    # experts [E, H, I]: E over expert; of H=64 and I=96, fsdp takes the larger
    assert param_spec((8, 64, 96), ("expert", "embed", "mlp"), sizes) == PartitionSpec(
        "expert", None, "fsdp"
    )
    assert param_spec((8, 96, 64), ("expert", "mlp", "embed"), sizes) == PartitionSpec(
        "expert", "fsdp", None
    )
    # the largest dimension that fsdp does not divide is passed over; ties go to the first
    assert param_spec((6, 34, 8), ("vocab", "embed", None), sizes) == PartitionSpec(
        None, None, "fsdp"
    )
    assert param_spec((32, 32), ("embed", "mlp"), sizes) == PartitionSpec("fsdp", None)
    # nothing divides: replicated; no fsdp axis: only the rules
    assert param_spec((3, 5), ("embed", "mlp"), sizes) == PartitionSpec(None, None)
    assert param_spec((8, 64), ("expert", "embed"), {"expert": 2}) == PartitionSpec("expert", None)
