"""The offline SASS tool: the kernel's Triton IR lowered on the CPU, the loop counter, and the
Mosaic GPU kernels' inline PTX assembled for sm_90 (where a ``ptxas`` is at hand)."""

import subprocess

import pytest

from experiments.bench import offline_sass
from pallas_kernels import fp4_decode_attention_triton as fda

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD.SHL.U32 R2, R3, 0x10, RZ ;
        /*0020*/              @!P0 BRA 0x0080 ;
        /*0030*/                   LOP3.LUT R4, R2, 0x81c081c0, RZ, 0xc0, !PT ;
        /*0040*/                   HMUL2.BF16_V2 R5, R4, R6 ;
        /*0050*/                   HMMA.16816.F32.BF16 R8, R12, R14, R8 ;
        /*0060*/               @P0 BRA 0x0030 ;
        /*0070*/                   BRA 0x0010 ;
        /*0080*/                   EXIT ;
"""


def test_loop_stats_counts_the_largest_backward_branch_span():
    n, ops = offline_sass.loop_stats(LISTING)
    assert n == 7  # 0x0010 .. 0x0070: the outer span is the larger one
    assert ops["BRA"] == 3 and ops["IMAD"] == 1 and ops["HMMA"] == 1 and "MOV" not in ops


def test_triton_ir_of_the_default_nvfp4_kernel():
    text, opts = offline_sass.triton_ir("nvfp4", {"block_k": 32})
    assert text.startswith("module") and "tt.func public @decode_attention_nvfp4" in text
    assert "scf.for" in text and "tt.dot" in text and "mul.rn.bf16x2" in text
    assert "tensor<32x32xi16" in text  # the override reached the kernel: 32-slot code tiles
    cfg = fda.default_config(*offline_sass.BENCH_SHAPE, "nvfp4")
    assert opts == {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def test_inline_ptx_entries_wire_every_operand():
    for name, (asm, n_out, n_in) in offline_sass.inline_ptx_blocks().items():
        ptx = offline_sass.ptx_entry(name, asm, n_out, n_in)
        assert "$" not in ptx and ".target sm_90" in ptx
        assert ptx.count("ld.param.u32") == n_in and ptx.count("st.global.u32") == n_out


def _assembled_blocks():
    ptxas = offline_sass.find_ptxas()
    if ptxas is None:
        pytest.skip("no ptxas ($PTXAS, PyPI triton or PATH)")
    return {  # ptxas errors raise here
        name: offline_sass.assemble(offline_sass.ptx_entry(name, asm, n_out, n_in), ptxas)
        for name, (asm, n_out, n_in) in offline_sass.inline_ptx_blocks().items()
    }


def test_inline_ptx_assembles_for_sm90():
    # ptxas accepts every block for the H200: the PTX errors a GPU run would otherwise be the
    # first to see.
    assert set(_assembled_blocks()) == set(offline_sass.inline_ptx_blocks())
    bad = offline_sass.ptx_entry("bad", "max.u16x3 $0, $1, $1;", 1, 1)  # no such instruction
    with pytest.raises(subprocess.CalledProcessError):
        offline_sass.assemble(bad, offline_sass.find_ptxas())


def test_inline_ptx_decodes_keep_their_multiplies():
    blocks = _assembled_blocks()
    if not all(blocks.values()):
        pytest.skip("no cuobjdump beside ptxas or on the PATH to read the SASS")
    for name, sass in blocks.items():
        ops = offline_sass.block_ops(sass)
        assert sum(ops.values()) > 4, (name, ops)
        if "word" in name:  # four bf16 pairs scaled
            assert ops["HMUL2"] >= 1, (name, ops)


def test_plan_ir_and_loopless_sass_count():
    # the grouped matmul's plan kernel lowers to one Triton module with its prefix sums; a
    # listing without a backward branch has no loop for loop_stats
    text, opts = offline_sass.plan_ir(rows=64, experts=16, block_m=8)
    assert "tt.func" in text and "tt.scan" in text and opts["num_stages"] == 1
    with pytest.raises(ValueError, match="no backward branch"):
        offline_sass.loop_stats(
            LISTING.replace("@P0 BRA 0x0030", "NOP").replace("BRA 0x0010", "NOP")
        )
    assert offline_sass._opcode("@!P1 IMAD.SHL.U32 R2, R3, 0x10, RZ") == "IMAD"
