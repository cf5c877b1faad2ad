"""The instruction budget of each hot kernel, before any GPU runs it: inner-loop SASS instructions x
trip count at the benchmark's shape / the GPU's issue rate, next to the roofline.

For the hot header kernels and the Triton attention and indexer twins (``tests/jit/test_sass.py``
builds the same), for sm_90a and sm_100a (or ``--arch``):
the instructions of its main inner loop (:func:`sparsekv.testing.sass.inner_loop`: of the loops
holding no other loop, the longest), the warp-level trips of that loop at the serving shape (the
model below: how many times some warp runs the loop body over the whole launch), and

    issue_us = loop instructions x warp trips / (SMs used x 4 schedulers x clock)

(SMs used: the launch's CTAs, at most the GPU's SMs), the time the GPU needs just to issue those
instructions at one instruction per scheduler per clock,
against ``roofline_us`` (``sparsekv.testing.roofline``). ``issue_over_roofline`` above 1 says the
kernel cannot reach its roofline as compiled, whatever the memory system does. Estimates only:
the trip model is per kernel (``TRIPS``), the clock the boost clock, latency ignored.

End to end, for the kernels whose call moves memory after the loop that the loop cannot hide
(``AFTER_LOOP``: the split-KV partials, written as every CTA ends and read back by whatever combines
them, and the output):

    end_to_end_us = issue_us + HBM bytes / HBM bandwidth + L2 bytes / L2 bandwidth

(no overlap of the terms; the loop's own gathers count as hidden under its issue), next to the same
roofline as ``end_to_end_over_roofline``. The HBM bytes are those that must reach or leave DRAM in the
call (the output); the L2 bytes those written and read back within one launch while they fit in L2
(the split partials: the header's last CTA of a row combines them with its own, kept in registers,
8.4 MB at the serving shape; the Triton twin's last program reads them all back, 16.8 MB; against
50 MB of L2 on the H200 and more on the B200).
Their write-back to DRAM when later evicted is not counted. The L2 bandwidth is an assumption, not a
measurement: 32 bytes per SM per clock (half of the 64 an SM's L1 takes from L2 per clock), 8.4 TB/s
on the H200 and 9.3 TB/s on the B200.

Launches whose phases run on different numbers of SMs (``PHASES``: the top-k, one CTA a row or a
row split over several CTAs and merged by the last) sum per phase its loop x the warp trips of one
SM (the SMs run in parallel), and add a hand allowance for the launches and the code outside the
loops: ``estimate_us``.

The H200 (132 SMs, 1.98 GHz) is the model GPU for sm_90a; the B200 (148 SMs, 1.965 GHz) for
sm_100a. Nothing runs on a device: it needs nvcc and cuobjdump (triton's wheel ships it).
"""

from __future__ import annotations

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.dsv4_attention import HEAD_DIM
from sparsekv.kv_layout import INDEXER_FP4
from sparsekv.testing import roofline
from sparsekv.testing.bench import BenchResult, add_common_args, bar_plot, report
from sparsekv.testing.sass import cuda_artifact, disassemble, inner_loop

#: (SMs, clock in Hz) of the model GPU of each arch.
ISSUE = {"9.0a": ("H200", 132, 1.98e9), "10.0a": ("B200", 148, 1.965e9)}
#: Bytes an SM moves to or from L2 per clock, for the L2 term of the end-to-end estimate (an assumption).
L2_BYTES_PER_SM_CLOCK = 32

# Serving shapes (the benchmarks'): attention batch 64, top-k 512, 64 heads (and the Triton attention at
# prefill: 4k tokens, 128 heads, top-k 2048); indexer one row of 64k
# entries; top-k 512 of 64k; (fused) compress + store 4k C4 and C128 tokens; store / quantize 4096 rows; gather
# 16k rows of 584 B; swap-in batch 64, top-k 512.
#: kernel -> (how the SASS is built, the roofline cost, the warp trips of the inner loop, the CTAs of
#: the launch, the model).
TRIPS = {
    "cuda dsv4_attention partial_kernel": (("cuda", "dsv4_attention", {"q_dtype": "bfloat16"}, "partial_kernel"),
                                           roofline.attention(64, 512, out_bytes=4), 128 * 8 * 8, 128,
                                           "64 heads per 256-thread CTA, 2 splits per row (128 CTAs), each "
                                           "over 256 rows in 8 tiles of 32 with 8 warps (the tile loop)"),
    "cuda dsv4_attention partial_kernel, bf16 out": (("cuda", "dsv4_attention", {"q_dtype": "bfloat16"},
                                                     "partial_kernel"), roofline.attention(64, 512), 128 * 8 * 8, 128,
                                                    "as above; the combine writes bf16"),
    "cuda dsv4_indexer scores_kernel": (("cuda", "dsv4_indexer", {"layout": "fp8", "q_dtype": "bfloat16"},
                                         "scores_kernel"), roofline.indexer_scores(1, 65536), 65536 // 16,
                                        65536 // 256, "one warp per 16-entry MMA tile, 256 entries per CTA"),
    "cuda dsv4_indexer scores_kernel fp4": (("cuda", "dsv4_indexer", {"layout": "fp4", "q_dtype": "bfloat16"},
                                             "scores_kernel"),
                                            roofline.indexer_scores(1, 65536, key_bytes=INDEXER_FP4.bytes_per_token),
                                            65536 // 16, 65536 // 256, "as the FP8 row, over 68 B FP4 records"),
    "cuda dsv4_store NormRopeStore": (("cuda", "dsv4_store", {"cache_kind": "V4"}, "NormRopeStore"),
                                      roofline.store(4096), 4096, 4096 // 8,
                                      "one warp per entry, its 584 B record staged in shared memory and "
                                      "written as 36 16-byte words and one 8-byte word (no byte stores), "
                                      "e4m3 pairs from the hardware convert"),
    "cuda dsv4_quant QuantizeRows<V4, bf16>": (("cuda", "dsv4_quant", {}, "QuantizeRowsINS_9kv_layout2V4EtE"),
                                               roofline.quantize(4096), 4096, 4096 // 8,
                                               "one warp per row, its 584 B record staged in shared memory and "
                                               "written as 36 16-byte words and one 8-byte word, e4m3 pairs "
                                               "from the hardware convert"),
    "triton dsv4_attention.partial[bf16]": (("triton", "dsv4_attention.partial[bf16]", {}, ""),
                                            roofline.attention(64, 512 + 128), 64 * 2 * ((512 + 128) // 2 // 32) * 8,
                                            64 * 2, "64 heads per program, 2 splits per row (128 programs), "
                                                    "each looping over its 320 rows in tiles of 32, with 8 warps"),
    "triton dsv4_attention.partial[bf16] top-k 512": (("triton", "dsv4_attention.partial[bf16]", {}, ""),
                                                      roofline.attention(64, 512), 64 * 2 * (512 // 2 // 32) * 8,
                                                      64 * 2, "as above without the window: each program "
                                                              "over its 256 rows in 8 tiles of 32"),
    "triton dsv4_attention.partial[fp32,16 heads] batch 1": (
        ("triton", "dsv4_attention.partial[fp32,16 heads]", {}, ""),
        roofline.attention(1, 512 + 128, q_bytes=4, out_bytes=4), 40 * 4 * 1 * 4, 40 * 4,
        "batch 1, float32 q and output: 16 heads per program, 40 splits of one 16-row tile (160 programs, "
        "2 per SM), with 4 warps; launch-bound on a GPU"),
    "triton dsv4_attention.partial[bf16] prefill": (("triton", "dsv4_attention.partial[bf16]", {}, ""),
                                                    roofline.attention(4096, 2048, 128), 4096 * 2 * (2048 // 32) * 8,
                                                    4096 * 2, "prefill, each of 4k query tokens a row: 128 heads as "
                                                              "two programs of 64 (8k programs), each looping over "
                                                              "its 2048 rows in tiles of 32, with 8 warps"),
    "triton dsv4_indexer.scores[fp8,bf16]": (("triton", "dsv4_indexer.scores[fp8,bf16]", {}, ""),
                                             roofline.indexer_scores(1, 65536), (65536 // 256) * (256 // 64) * 4,
                                             65536 // 256, "256 chunks of 256 entries, a persistent grid of 2 programs "
                                                           "per SM, each chunk 4 tiles of 64 keys, with 4 warps"),
    "triton dsv4_indexer.scores[fp4,bf16]": (("triton", "dsv4_indexer.scores[fp4,bf16]", {}, ""),
                                             roofline.indexer_scores(1, 65536, key_bytes=INDEXER_FP4.bytes_per_token),
                                             (65536 // 256) * (256 // 64) * 4, 65536 // 256,
                                             "as the FP8 row, over 68 B FP4 records: each key's 64 bytes of e2m1 "
                                             "pairs by 16-byte cp.async, its 4 scale bytes as one word"),
    "cuda gather_rows GatherRows": (("cuda", "gather_rows", {"index_dtype": "int64"}, "GatherRows"),
                                    roofline.gather_rows(16384, 584), 16384 * 3, 16384 // 8,
                                    "one warp per row, 8 B per lane: 3 trips per 584 B row"),
    "cuda dsv4_compress CompressEvents 4k C4": (
        ("cuda", "dsv4_compress", {}, "PoolEventsILl4ELb0ELb1E"), roofline.compress(4096, 4), 1024 * 4, 1024 * 4 // 8,
        "the C4 compressor alone (no store), 4k tokens from the fp32 input, 16-byte aligned rows: a warp "
        "per (event, 128-channel chunk), 4 channels a lane, 1,024 events x 4 chunks = 4k warps in 512 CTAs "
        "of 8; the kernel's one loop is a warp's whole chunk (the item loop: its 8 window slots unrolled, "
        "24 16-byte loads a lane, the code of all three step kinds counted though one runs), one trip a "
        "warp; the float32 ring's kernel"),
    "cuda dsv4_compress CompressEvents 4k C128": (
        ("cuda", "dsv4_compress", {}, "PoolEventsILl128ELb0ELb1E"), roofline.compress(4096, 128), 32 * 4 * 8, 32 * 4,
        "the C128 compressor alone, 4k tokens from the fp32 input through a planned source table "
        "(compress_extend), 16-byte aligned rows: a CTA of 8 warps per (event, 128-channel chunk), 32 events x 4 "
        "chunks = 128 CTAs, 4 channels a lane, the 128 window slots split 16 a warp (logits held, 16-byte "
        "loads), the weights and products staged 16 slots a round and added up in slot order a channel a "
        "thread; the kernel's one loop is a CTA's whole chunk (the item loop, everything in it unrolled, the "
        "code of all three step kinds counted though one runs), one trip a warp: 128 x 8 warp trips; the "
        "float32 ring's kernel"),
    "cuda dsv4_indexer scores_kernel 256k": (("cuda", "dsv4_indexer", {"layout": "fp8", "q_dtype": "bfloat16"},
                                              "scores_kernel"), roofline.indexer_scores(1, 262144), 262144 // 16,
                                             262144 // 256, "one row of 256k entries: as at 64k, 1,024 CTAs"),
    "cuda dsv4_indexer scores_kernel fp4 256k": (("cuda", "dsv4_indexer", {"layout": "fp4", "q_dtype": "bfloat16"},
                                                  "scores_kernel"),
                                                 roofline.indexer_scores(1, 262144,
                                                                         key_bytes=INDEXER_FP4.bytes_per_token),
                                                 262144 // 16, 262144 // 256,
                                                 "one row of 256k FP4 entries: as at 64k, 1,024 CTAs"),
    "triton dsv4_indexer.scores[fp8,bf16] 256k": (("triton", "dsv4_indexer.scores[fp8,bf16]", {}, ""),
                                                  roofline.indexer_scores(1, 262144), (262144 // 256) * (256 // 64) * 4,
                                                  262144 // 256, "one row of 256k entries: 1,024 chunks of 256 over "
                                                                 "the persistent grid, as at 64k"),
    "triton dsv4_indexer.scores[fp4,bf16] 256k": (("triton", "dsv4_indexer.scores[fp4,bf16]", {}, ""),
                                                  roofline.indexer_scores(1, 262144,
                                                                          key_bytes=INDEXER_FP4.bytes_per_token),
                                                  (262144 // 256) * (256 // 64) * 4, 262144 // 256,
                                                  "one row of 256k FP4 entries: 1,024 chunks of 256, as at 64k"),
}


def _split_attention_after_loop(batch: int, heads: int, splits: int, out_bf16: bool) -> tuple[int, int]:
    """(HBM, L2) bytes the header attention moves after its tile loop: the output (fp32, or bf16
    rounded by the combine) and the lse to HBM; the fp32 partials (out and lse) of every split but
    the last to finish written to L2 and read back from it by that last CTA of the row, which keeps
    its own in registers and combines in the same launch."""
    partials = batch * (splits - 1) * heads * (HEAD_DIM + 1) * 4
    return batch * heads * (HEAD_DIM * (2 if out_bf16 else 4) + 4), 2 * partials


#: kernel -> (HBM bytes, L2 bytes moved after its loop, not hidden by it, the model): see the module docstring.
AFTER_LOOP = {
    "cuda dsv4_attention partial_kernel": (*_split_attention_after_loop(64, 64, 2, out_bf16=False),
                                           "fp32 output to HBM; the first split's fp32 partial written to L2 and "
                                           "read back by the row's last CTA, which keeps its own in registers "
                                           "(no combine launch)"),
    "cuda dsv4_attention partial_kernel, bf16 out": (*_split_attention_after_loop(64, 64, 2, out_bf16=True),
                                                     "as above, the last CTA writing bf16"),
    "triton dsv4_attention.partial[bf16]": (64 * 64 * (HEAD_DIM * 2 + 4), 2 * 64 * 2 * 64 * (HEAD_DIM * 2 + 4),
                                            "bf16 output to HBM; the 2 splits' partials (bf16 out, fp32 lse) "
                                            "written to L2 and read back by the last program of each row"),
    "triton dsv4_attention.partial[bf16] top-k 512": (64 * 64 * (HEAD_DIM * 2 + 4),
                                                      2 * 64 * 2 * 64 * (HEAD_DIM * 2 + 4), "as above"),
    "triton dsv4_attention.partial[fp32,16 heads] batch 1": (
        64 * (HEAD_DIM * 4 + 4), 2 * 40 * 64 * (HEAD_DIM * 4 + 4),
        "float32 output to HBM; the 40 splits' float32 partials written to L2 and read back by the last "
        "program of each head group"),
}


#: Kernels whose launch runs in phases on different numbers of SMs (the split top-k: its CTAs over
#: their slices, then the last CTA's merge on one SM): kernel -> (build, roofline cost, phases,
#: allowance (launch us, straight-line us), model). A phase is (name, required opcodes, excluded
#: opcodes, warp trips per SM, CTAs, one an SM[, options]): its loop is the longest innermost loop holding
#: every required opcode prefix and none of the excluded (the split and the single-CTA row passes
#: compile to loops within 2% of each other; the longer is taken). Options: ``kernel``, a kernel of
#: the same library other than the row's (a call of two launches); ``outer=True``, of the loops that
#: hold another loop the shortest matching (a block-wide pass whose body holds its own short loops,
#: the scans over warp counts: the longest would be the loop around all passes). issue_us sums the phases; the
#: allowance covers what no loop holds, by hand, not counted from the SASS: the launch (3 us; 4 with
#: the clear kernel before it) and the code outside the row loops on the critical CTA (4 block
#: picks, 5 scans, 3 histogram clears, the output: about 1,000 instructions a warp, 32 warps on 4
#: schedulers, 4 us; 5 us for a slice then the merge, with the fence, arrival and gather's L2 round
#: trips); estimate_us is the two together.
_TALLY = ({"LDG.E.128", "ATOMS"}, set())  # 2 float4 a lane a trip: 256 entries a warp
_COUNT = ({"LDG.E.128", "VOTE"}, {"STS", "STG"})  # 1 float4 a lane a trip: 128 entries a warp
_COPY = ({"LDG.E.128", "VOTE", "STG"}, set())  # to the workspace segment, 128 entries a warp
_ROW_COPY = ({"LDG.E.128", "VOTE", "STS"}, {"STG"})  # to shared memory, 128 entries a warp
_GATHER_COUNT = ({"LDG.E", "VOTE"}, {"LDG.E.128", "STS", "STG"})  # 8 loads a lane: 256 entries a warp
_GATHER_COPY = ({"LDG.E", "VOTE", "STS"}, {"LDG.E.128"})
_TOPK_BUILD = ("cuda", "dsv4_indexer_topk", {}, "topk_kernel")
_SWAP_IN_BUILD = ("cuda", "hisparse", {"num_top_k": 512, "hot_buffer_size": 1024, "layout": "dsv4", "page_slots": 64},
                  "swap_in_kernel")
def _swap_in_block(rows_a_request: int) -> list:
    """The per-request launch's block-wide passes at K 512, H 1,024, 16 warps, for a CTA that serves
    ``rows_a_request`` rows (the speculative entry serves a request's rows in one CTA, one after
    another): warp trips per SM. Each pass is found by what it alone does (``outer``: the block scans
    of its ranks are short loops inside it): the LRU walk loads ``lru_slots`` (``LDG.E.U16``), the
    misses store ``miss_index`` (``STS.U16``) and the token table, the output pass reads ``hash_slot``
    (``LDS.U16``) and writes the output; the LRU rewrite, ``lru_slots`` from shared memory, holds no
    scan (of its 2-trip loop and that loop unrolled, the longer counted, one trip)."""
    r = rows_a_request
    return [
        ("per request: top-k hash insert", {"ATOMS.CAS", "ATOMS.MIN"}, set(), r * 16, 64, {"outer": True}),
        ("per request: LRU walk over H (2 trips)", {"LDG.E.U16", "VOTE", "BAR"}, set(), r * 2 * 16, 64,
         {"outer": True}),
        ("per request: misses in top-k order", {"STS.U16", "STG.E", "VOTE", "BAR"}, {"LDG.E.U16", "ATOMS"}, r * 16,
         64, {"outer": True}),
        ("per request: LRU rewrite", {"LDS.U16", "STG.E.U16"}, {"VOTE", "BAR", "LDG.E.U16"}, r * 16, 64),
        ("per request: output pass", {"LDS.U16", "STG.E", "VOTE", "BAR"}, {"STS.U16", "LDG.E.U16", "ATOMS"}, r * 16,
         64, {"outer": True})]


_SWAP_IN_COPY = ("copies: the 584 B record", {"LDG.E.128", "STG.E.128"}, set(), 2 * 4, 1, {"kernel": "MissCopies"})
PHASES = {
    "cuda dsv4_compress_store CompressStore 4k C4": (
        ("cuda", "dsv4_compress_store", {"cache_kind": "V4"}, "HeldStoreINS_10dsv4_store2V4ELb0E"),
        roofline.compress_store(4096, 4),
        [("a 128-channel chunk, the 8 slots held", {"LDG.E.128", "MUFU"}, set(), 8 * 4, 1024 // 8)], (0.0, 1.1),
        "the C4 compressor fused with the store, 4k tokens from the fp32 input, 16-byte aligned rows, a "
        "float32 ring (HeldStore): a warp per entry (1,024 in 128 CTAs of 8, one an SM), its 4 128-channel "
        "chunks a trip each of the chunk loop (4 channels a lane, the 8 window slots unrolled, each row read "
        "once with 16-byte loads), 8 x 4 trips an SM; the allowance the rest of the item loop (its store), by "
        "hand from the SASS, counted as all run: about 1,080 instructions a warp, 8 warps on 4 schedulers"),
    "cuda dsv4_compress_store StreamedStore 4k C4": (
        ("cuda", "dsv4_compress_store", {"cache_kind": "V4"}, "StreamedStore"), roofline.compress_store(4096, 4),
        [("window max", {"LDG.E.64", "LDG.E"}, {"MUFU", "LDG.E.U16", "STS"}, 8 * 16 * 8, 1024 // 8),
         ("window weighted sum", {"LDG.E.64", "MUFU"}, {"LDG.E.U16", "STS"}, 8 * 16 * 8, 1024 // 8)], (0.0, 3.0),
        "the same with rows off a 16-byte boundary (StreamedStore, a channel a lane, as C128): its 16 "
        "32-channel columns each walk the 8 window slots twice (the max, then the weights), 16 x 8 trips of "
        "each pass a warp; the allowance the code outside those loops, by hand from the sm_90a SASS, counted "
        "as all run: 16 x about 130 instructions of the column loop's own and about 980 of the store a warp"),
    "cuda dsv4_compress_store CompressStore 4k C128": (
        ("cuda", "dsv4_compress_store", {"cache_kind": "V4"}, "SplitStoreINS_10dsv4_store2V4ELb0E"),
        roofline.compress_store(4096, 128),
        [("a 128-channel chunk, the window split over 8 warps", {"LDS", "MUFU", "BAR"}, set(), 8 * 4, 32)],
        (0.0, 0.5),
        "the C128 compressor fused with the store, 4k tokens from the fp32 input, 16-byte aligned rows, a "
        "float32 ring (SplitStore): a CTA of 8 warps per entry (32 CTAs, one an SM), its 4 128-channel chunks "
        "a trip each of the chunk loop (the compressor's split form: the 128 slots 16 a warp, 4 channels a "
        "lane, the terms added up in slot order a channel a thread), 8 x 4 warp trips an SM; the allowance "
        "the rest of the item loop, by hand from the sm_90a SASS, counted as all run: about 980 instructions "
        "(warp 0's store), one warp on one scheduler"),
    "cuda dsv4_indexer_topk topk_kernel one CTA 512 of 64k": (
        _TOPK_BUILD, roofline.indexer_topk(1, 65536, 512),
        [("row: histogram", *_TALLY, 8 * 32, 1), ("row: count", *_COUNT, 16 * 32, 1),
         ("row: copy", *_ROW_COPY, 16 * 32, 1)], (3.0, 4.0),
        "no workspace: one 1024-thread CTA per row, 3 passes over the row (12-bit histogram, count and "
        "copy of the candidates), 2,048 entries a warp each; the on-chip digits and output under a trip"),
    "cuda dsv4_indexer_topk topk_kernel split 512 of 64k": (
        _TOPK_BUILD, roofline.indexer_topk(1, 65536, 512),
        [("slices: histogram", *_TALLY, 1 * 32, 16), ("slices: count", *_COUNT, 1 * 32, 16),
         ("slices: copy", *_COPY, 1 * 32, 16), ("merge: gather count", *_GATHER_COUNT, 2 * 32, 1),
         ("merge: gather copy", *_GATHER_COPY, 2 * 32, 1)], (4.0, 5.0),
        "batch 1, workspace given: 16 CTAs of 4,096 entries (a warp 128: one trip of each row loop), "
        "each publishing ~600 candidates; the last CTA gathers the 16 segments (~9,600 keys, 2 warps a "
        "segment, 2 trips of 256 a warp per pass); the on-chip digits and output are under a trip a warp"),
    "cuda dsv4_indexer_topk topk_kernel split 512 of 256k": (
        _TOPK_BUILD, roofline.indexer_topk(1, 262144, 512),
        [("slices: histogram", *_TALLY, 1 * 32, 32), ("slices: count", *_COUNT, 2 * 32, 32),
         ("slices: copy", *_COPY, 2 * 32, 32), ("merge: gather count", *_GATHER_COUNT, 3 * 32, 1),
         ("merge: gather copy", *_GATHER_COPY, 3 * 32, 1)], (4.0, 5.0),
        "batch 1, workspace given: 32 CTAs of 8,192 entries (a warp 256), each publishing ~700 "
        "candidates; the last CTA gathers the 32 segments (~22k keys, a warp a segment, 3 trips of 256)"),
    "cuda hisparse swap-in step batch 64 K 512 0.1% misses": (
        _SWAP_IN_BUILD, roofline.swap_in(64, 512, 33), _swap_in_block(1) + [_SWAP_IN_COPY], (4.0, 2.2),
        "plain entry, batch 64, top-k 512, hot 1,024, 33 misses (0.1%), given a plan: the per-request launch "
        "(64 CTAs of 512 threads, one an SM; each of its 16 warps runs each block-wide pass once per 512 "
        "entries: the hash insert, the misses and the output pass once, the LRU walk over 1,024 slots "
        "twice, the LRU rewrite once) then the copies' launch, a warp per 16 plan entries of a row (32 warps "
        "a row, 2k), a miss's warp copying its 584 B record in 2 trips of the 16-byte loop on one scheduler "
        "(trips x 4). The allowance: 2 launches back to back (3 + 1 us), one PCIe round trip for the misses, "
        "all in flight at once (2 us), and the copies' warps that find no miss (~100 instructions a warp "
        "in the sm_90a SASS, the driver, a division and the miss-count load: 2k warps, 0.2 us; a warp per "
        "plan entry, 32k warps of ~88, was 2.8 us). Not counted: the code between the passes (barriers, "
        "the hash clear)"),
    "cuda hisparse swap-in step batch 64 K 512 0.1% misses speculative": (
        _SWAP_IN_BUILD, roofline.swap_in(64, 512, 33),
        _swap_in_block(1) + [("copies: a miss's scan of the later rows, 32 a trip", {"LDG.E", "LDG.E.64"}, {"STG"},
                              2 * 4, 1, {"kernel": "MissCopies", "outer": True}),
                             ("copies: a same-request row's plan entries", {"LDG.E", "LDG.E.64"}, {"STG"}, 2 * 2 * 4, 1,
                              {"kernel": "MissCopies"}), _SWAP_IN_COPY], (4.0, 2.2),
        "as above, through the speculative entry (rows of one request served in batch order), one row a "
        "request: the copies' critical warp, a miss of row 0, first asks whether a later row of its request "
        "copies into the same slot. Its lanes take the 63 later rows 32 at a time (2 trips of the scan loop, "
        "whose body holds the inner loop's once), a lane loading its row's request id and miss count together "
        "and, for a row of the same request, that row's plan entries (the inner loop, as long as the lane "
        "whose row has the most misses: 2 more trips a scan trip, for 33 misses over 63 rows), then one vote; "
        "on one scheduler (trips x 4). About 4 rounds of dependent loads (L2 hits) in all, which the issue "
        "model does not time"),
    "cuda hisparse swap-in step batch 64 x 2 rows K 512 0.1% misses speculative": (
        _SWAP_IN_BUILD, roofline.swap_in(128, 512, 66),
        _swap_in_block(2) + [("copies: a miss's scan of the later rows, 32 a trip", {"LDG.E", "LDG.E.64"}, {"STG"},
                              4 * 4, 1, {"kernel": "MissCopies", "outer": True}),
                             ("copies: a same-request row's plan entries", {"LDG.E", "LDG.E.64"}, {"STG"}, 2 * 4, 1,
                              {"kernel": "MissCopies"}), _SWAP_IN_COPY], (4.0, 2.4),
        "the speculative entry with 2 rows a request (MTP: the token and a draft), 64 requests, 128 rows "
        "adjacent in batch order, top-k 512, hot 1,024, 66 misses (0.1%): the per-request launch's CTA of a "
        "request serves its 2 rows one after the other, so each block-wide pass runs twice an SM (64 CTAs; "
        "the later row's CTA does nothing). The copies' critical warp, a miss of row 0, scans the 127 later "
        "rows 32 at a time (4 trips) and, in the one row of its request, that row's plan entries (2 trips); "
        "on one scheduler (trips x 4). The allowance as above, the copies' empty warps twice as many (4k "
        "warps, 0.4 us; a warp per plan entry, 64k warps, was 5.5 us)"),
    "cuda hisparse_copy TransferTokens 64k x 21": (
        ("cuda", "hisparse_copy", {"page_slots": 64}, "TransferTokens"), roofline.Cost(2 * 65536 * 21 * 584),
        [("value records: 16-byte copy loop", {"LD.E.128", "ST.E.128"}, set(), 8 * 21 * 2, 8192)], (3.0, 0.0),
        "64k tokens x 21 layers device -> device (the benchmark's 64k x 21): one warp per token (8,192 CTAs of "
        "8), per layer the 576 B value record in 2 trips of the 16-byte loop (generic LD/ST: the layers' base "
        "addresses come from a table); the 8 B scale record and the per-layer addressing are not counted"),
}


def _loop(kernel, required: set[str], excluded: set[str], outer: bool = False) -> list[str]:
    """The longest innermost loop of ``kernel`` holding every required opcode prefix and no excluded one
    (``outer``: the shortest of the loops holding another loop)."""
    backward = [(target, source) for source, target in kernel.branches if target < source]
    nests = [any(a <= c and d <= b and (c, d) != (a, b) for c, d in backward) for a, b in backward]
    loops = [[op for op, at in zip(kernel.opcodes, kernel.addresses) if a <= at <= b]
             for (a, b), nested in zip(backward, nests) if nested == outer]

    def has(ops: list[str], prefix: str) -> bool:
        return any(op == prefix or op.startswith(prefix + ".") for op in ops)

    matching = [ops for ops in loops if all(has(ops, r) for r in required) and not any(has(ops, x) for x in excluded)]
    if not matching:
        raise SystemExit(f"bench_sass_budget: no loop holds {sorted(required)} without {sorted(excluded)}")
    return (min if outer else max)(matching, key=len)


def phased_budget(name: str, arch: str) -> dict:
    (build, module, values, kernel_name), cost, phases, (launch_us, straight_us), model = PHASES[name]
    allowance_us = launch_us + straight_us
    sm = "sm_" + arch.replace(".", "")
    kernels = disassemble(cuda_artifact(module, _values(values), ("9.0a", "10.0a")))
    gpu, sms, clock = ISSUE[arch]
    rows, issue_s = [], 0.0
    for phase, required, excluded, trips, ctas, *options in phases:
        option = options[0] if options else {}
        (sass,) = [k for (a, n), k in kernels.items() if a == sm and option.get("kernel", kernel_name) in n]
        loop = _loop(sass, required, excluded, option.get("outer", False))
        seconds = len(loop) * trips * -(-ctas // sms) / (4 * clock)  # the SMs run in parallel, in waves
        issue_s += seconds
        rows.append({"phase": phase, "loop_instructions": len(loop), "warp_trips_per_sm": trips, "sms": ctas,
                     "issue_us": round(seconds * 1e6, 3)})
    roof_s = cost.roofline_s(roofline.GPUS[gpu])
    estimate_s = issue_s + allowance_us * 1e-6
    (sass,) = [k for (a, n), k in kernels.items() if a == sm and kernel_name in n]
    return {"case": f"{name} {sm}", "arch": sm, "model_gpu": gpu, "kernel_instructions": len(sass.opcodes),
            "phases": rows, "trip_model": model, "issue_us": round(issue_s * 1e6, 3), "allowance_us": allowance_us,
            "estimate_us": round(estimate_s * 1e6, 3), "roofline_us": round(roof_s * 1e6, 3),
            "issue_over_roofline": round(issue_s / roof_s, 2)}


def _values(values: dict) -> dict:
    import torch

    return {k: getattr(torch, v) if isinstance(getattr(torch, str(v), None), torch.dtype) else v
            for k, v in values.items()}


def _triton_cubin(name: str, arch: str):
    """The cubin of a Triton kernel (its AOT build, as ``sparsekv jit build --triton`` makes it)."""
    from sparsekv.jit_kernel.build import cache
    from sparsekv.jit_kernel.triton import aot, interpreting

    if interpreting():
        raise SystemExit("bench_sass_budget: TRITON_INTERPRET=1 is set, under which Triton kernels do not compile; "
                         "run it without")
    root = cache.open_roots().write
    (kernel,) = [k for k in aot.aot_kernels() if k.name == name]
    return root / ".triton" / aot.build(kernel, arch, root)["key"] / "kernel.cubin"


def budget(name: str, arch: str) -> dict:
    (build, module, values, kernel), cost, trips, ctas, model = TRIPS[name]
    sm = "sm_" + arch.replace(".", "")
    if build == "triton":
        (sass,) = disassemble(_triton_cubin(module, arch)).values()
    else:
        (sass,) = [k for (a, n), k in disassemble(cuda_artifact(module, _values(values), ("9.0a", "10.0a"))).items()
                   if a == sm and kernel in n]
    gpu, sms, clock = ISSUE[arch]
    loop = inner_loop(sass)
    issue_s = len(loop) * trips / (min(ctas, sms) * 4 * clock)
    roof_s = cost.roofline_s(roofline.GPUS[gpu])
    row = {"case": f"{name} {sm}", "arch": sm, "model_gpu": gpu, "kernel_instructions": len(sass.opcodes),
           "loop_instructions": len(loop), "warp_trips": trips, "ctas": ctas, "trip_model": model,
           "issue_us": round(issue_s * 1e6, 3), "roofline_us": round(roof_s * 1e6, 3),
           "issue_over_roofline": round(issue_s / roof_s, 2)}
    if name in AFTER_LOOP:
        hbm_bytes, l2_bytes, after_model = AFTER_LOOP[name]
        l2_bytes_per_s = sms * L2_BYTES_PER_SM_CLOCK * clock
        end_s = issue_s + hbm_bytes / roofline.GPUS[gpu].hbm_bytes_per_s + l2_bytes / l2_bytes_per_s
        row.update({"after_loop_hbm_bytes": hbm_bytes, "after_loop_l2_bytes": l2_bytes, "after_loop_model": after_model,
                    "end_to_end_us": round(end_s * 1e6, 3), "end_to_end_over_roofline": round(end_s / roof_s, 2)})
    return row


def main() -> None:
    parser = CliParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="9.0a,10.0a", help="archs to read (default 9.0a,10.0a)")
    add_common_args(parser)
    args = parser.parse_args()
    result = BenchResult(name="SASS instruction budget (static, no GPU)", baseline="the roofline",
                         threads={"ours": "static", "baseline": "static"},
                         notes={"issue_rate": "SMs x 4 schedulers x boost clock, one warp instruction each per clock",
                                "gpus": {arch: {"gpu": g, "sms": n, "clock_hz": c}
                                         for arch, (g, n, c) in ISSUE.items()}})
    for name in TRIPS:
        for arch in args.arch.split(","):
            result.rows.append(budget(name, arch))
    for name in PHASES:
        for arch in args.arch.split(","):
            result.rows.append(phased_budget(name, arch))
    report(result, args, lambda r, path: bar_plot(r, path, label_key="case", value_keys=("issue_us", "roofline_us"),
                                                  ylabel="us (log)", log=True))


if __name__ == "__main__":
    main()
