"""The offline SASS tool: the kernel's Triton IR lowered on the CPU, the loop counter."""

from experiments.bench import offline_sass
from pallas_kernels import fp4_decode_attention as fda

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
