"""The matmul benchmark's tiling arguments: each ``--variants`` form parsed into the tuples the
benchmark times, and a malformed one refused with the expected form named."""

import pytest

from experiments.bench import fp4_matmul


def test_grouped_variants():
    got = fp4_matmul._grouped_variants("256,3,8,1;256,3,8,1,kernel;128,4,8,2,t2,xla;256,3,8,1,t4")
    assert got == [
        (256, 3, 8, 1, "kernel", 1),
        (256, 3, 8, 1, "kernel", 1),
        (128, 4, 8, 2, "xla", 2),
        (256, 3, 8, 1, "kernel", 4),
    ]
    assert fp4_matmul._grouped_variants("") == []
    for bad in (
        "256,3,8",
        "256,3,8,1,fast",
        "a,b,c,d",
        "256,3,8,1,2",
        "256,3,8,1,t2,t3",
        "256,3,8,1,tx",
    ):
        with pytest.raises(SystemExit, match="block_k,stages,block_m,warpgroups"):
            fp4_matmul._grouped_variants(bad)


def test_mgpu_variants():
    got = fp4_matmul._mgpu_variants("256,3,2,1;128,4,2,1,wk;256,3,2,1,none")
    assert got == [
        (256, 3, 2, 1, "asm", "grid"),
        (128, 4, 2, 1, "asm", "warpgroups"),
        (256, 3, 2, 1, "none", "grid"),
    ]
    with pytest.raises(SystemExit, match="block_k,stages,split_k,warpgroups"):
        fp4_matmul._mgpu_variants("256,3,2,1,fast")
