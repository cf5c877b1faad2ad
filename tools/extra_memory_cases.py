"""Regenerate ``tests/golden/extra_memory_cases.json``: the planner's answers for the memory cases the
public golden plans (``tests/golden/memory_plans.json``, sglang's own) leave out.

The answers are this planner's: ``plan-memory``'s formulas (sglang 0.5.23's configurator, ported:
``DSV4PoolConfigurator``, ``compute_swa_request_cap``, ``HybridSWAPoolConfigurator``,
``DefaultPoolConfigurator`` and the consumer flow around them: profile, ``--max-total-tokens``, MIN
over PP ranks, re-size, ``resolve_max_num_reqs``, ``finalize_with_max_running_requests``) run on
each case below. They were first worked out by hand from those formulas (the comments keep the
arithmetic), and this script reproduced every one of them when it replaced the hand-written
numbers. So they are regression values, not sglang's output: a change to the planner that moves
one shows in ``git diff`` of the JSON after a rerun, and must be argued against sglang's code.
Three are the answers of golden plans; ``tests/planning/test_pool_configurator_extra_cases.py``
checks that they still are, and that the JSON is this script's output for these cases.

Flash numbers used in the comments: bytes per SWA token 585*43 + 8/256*10240*21 = 31875 (spec:
ring 16, 585*43 + 16/256*10240*21 = 38595, times (43+1)/43).

Usage::

    python tools/extra_memory_cases.py            # rewrite the JSON
    python tools/extra_memory_cases.py --check    # exit 1 if the JSON is not what this script writes
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sparsekv.cli import CliParser
from sparsekv.srt.model_executor.memory_case import parse_case, rank_answer

GIB = 1 << 30
OUTPUT = Path(__file__).resolve().parent.parent / "tests" / "golden" / "extra_memory_cases.json"
FLASH = {"preset": "dsv4-flash"}
PRO = {"preset": "dsv4-pro"}


def eagle(steps, drafts, topk=1):
    return {"algorithm": "EAGLE", "num_steps": steps, "eagle_topk": topk, "num_draft_tokens": drafts}


def case(model, available_bytes, pp_size=1, **server):
    return {"model": model, "available_bytes": available_bytes, "pp_size": pp_size, "server": server}


#: (name, case). The comments derive the numbers the JSON holds.
CASES = [
    # DSV4 cap mode, EAGLE with the overlap schedule (spec v2, compute_swa_request_cap):
    # per request 128 + 128*4 drafts + 256 + 2*max(3, 4) = 904; 904*256 + 2*8192 + 256 = 248064,
    # + 4*256 prefix tails * (128+256) = 641280 SWA slots, charged at 38595*44/43 B each.
    ("flash-cap-eagle-overlap", case(FLASH, 40 * GIB, swa_sizing="cap", speculative=eagle(3, 4))),
    # The same without overlap (spec v1: max(ceil_align(3, 256), ceil_align(4, 256)) = 256 per
    # request, one chunk in flight): 128+512+256+256 = 1152; 1152*256 + 8192 + 256 + 393216.
    (
        "flash-cap-eagle-no-overlap",
        case(FLASH, 40 * GIB, swa_sizing="cap", speculative=eagle(3, 4), disable_overlap_schedule=True),
    ),
    # Top-k 2 (sglang's configurator prices it; only the DSV4 launch hook forbids it). Spec v1
    # on pages: each branch gets ceil_align(3 + 256, 256) = 512 -> 1024 per request; trailing
    # 128 + 128*5 + 256 = 1024; 2048*256 + 8192 + 256 + 393216 = 925952.
    (
        "flash-cap-topk2-no-overlap",
        case(FLASH, 40 * GIB, swa_sizing="cap", speculative=eagle(3, 5, topk=2), disable_overlap_schedule=True),
    ),
    # Spec v2 top-k 2 (allocation_sizing.get_alloc_len_per_decode): ceil((255 + 3) / 256) = 2
    # pages per branch -> max(2*256*2, 5) = 1024, twice outstanding: 1024 + 2048 = 3072 per
    # request; 3072*256 + 2*8192 + 256 + 393216 = 1196288.
    ("flash-cap-topk2-overlap", case(FLASH, 80 * GIB, swa_sizing="cap", speculative=eagle(3, 5, topk=2))),
    # PD decode cap: no chunk term, (window + page) per pre-allocated slot instead, and the
    # extra slots also widen the request-scoped C128 state: (128 + 32 + 1) * 128 = 20608.
    # 768*128 + 384*32 + 4*128*384 = 307200. Cap mode needs no chunked prefill on decode.
    (
        "pro-pp2-cap-pd-decode",
        case(
            PRO,
            60 * GIB,
            2,
            swa_sizing="cap",
            max_running_requests=128,
            chunked_prefill_size=-1,
            disaggregation_mode="decode",
            disaggregation_decode_extra_slots=32,
        ),
    ),
    # Radix cache off: no prefix tails. 768*256 + 2*4096 + 256 = 205056.
    (
        "flash-cap-no-radix",
        case(FLASH, 20 * GIB, swa_sizing="cap", disable_radix_cache=True, chunked_prefill_size=4096),
    ),
    # Cap mode needs chunked prefill (or a PD decode role): without it, the DSV4 default ratio
    # 0.1 sizes SWA, which gives exactly the explicit-0.1 golden plan.
    (
        "flash-cap-without-chunked-prefill-falls-back-to-ratio",
        case(FLASH, 40 * GIB, swa_sizing="cap", chunked_prefill_size=-1),
    ),
    # Attention DP: every sizing uses the per-worker count 1024 // 4 = 256 (so the SWA cap is
    # the golden 606464), bf16 compressor states halve the state bytes.
    (
        "flash-cap-attn-dp4-bf16",
        case(FLASH, 40 * GIB, swa_sizing="cap", max_running_requests=1024, attn_dp_size=4, compress_state_dtype="bf16"),
    ),
    # Fewer requests than DP workers: the request cap counts 2 // 4 = 0 requests (16384 + 256),
    # while the per-worker count is max(1, 2 // 4) = 1 (4 prefix tails: + 1536; C128 state 2*128;
    # resolved max_running_requests 1). The max(1, ...) is the 0.5.23 notes' (§5.3, §6); the
    # GitHub copy of pool_configurator.py has a bare 2 // 4 = 0 there.
    (
        "flash-cap-fewer-requests-than-dp-workers",
        case(FLASH, 20 * GIB, swa_sizing="cap", max_running_requests=2, attn_dp_size=4),
    ),
    # max_running_requests unset with uneven PP (43 = 15 + 14 + 14): each rank budgets its
    # C128 state from its own estimate; after the MIN, min(clamp(int(3165952 / 131072 * 512),
    # 2048, 4096), 3165952 // 2) = 4096 requests -> (4096 + 1) * 128 C128 state slots.
    (
        "flash-pp3-uneven-mrr-estimated",
        case({**FLASH, "context_len": 131072}, 24 * GIB, 3, max_running_requests=None, swa_full_tokens_ratio=0.2),
    ),
    # HiSparse ratio 1 keeps every C4 entry on the device: the plain golden plan.
    ("flash-hisparse-ratio1", case(FLASH, 40 * GIB, enable_hisparse=True, hisparse_host_to_device_ratio=1)),
    ("pro-pp3-hisparse4", case(PRO, 40 * GIB, 3, enable_hisparse=True, hisparse_host_to_device_ratio=4)),
    # Overridden layers and ratios, 10 layers over 3 ranks (4 + 3 + 3), page 128: C4 pages of
    # 32 entries (19008 B), C128 pages of 1 entry (1152 B). Only ratios[0:10] are sliced.
    (
        "custom-ratios-pp3-page128",
        case(
            {**FLASH, "num_hidden_layers": 10, "compress_ratios": [0, 4, 4, 128, 0, 4, 128, 128, 4, 0, 0]},
            8 * GIB,
            3,
            page_size=128,
        ),
    ),
    # head_dim / index_head_dim only change the compressor state rows (4*256 and 4*64 values,
    # C128 2*256) and the indexer key (64 B, no scale below 128 dims); the paged KV stays the
    # fixed 584-B FlashMLA V4 layout. Page 384: C4 pages of 96, C128 pages of 3 entries.
    (
        "pro-pp2-overridden-geometry-page384",
        case(
            {**PRO, "head_dim": 256, "index_head_dim": 64, "sliding_window": 512},
            16 * GIB,
            2,
            page_size=384,
            compress_state_dtype="bf16",
        ),
    ),
    # The SWA floor is window + page: 4096 SWA slots hold one request with a 128 window on
    # page 512, not with a 4096 window (validate_swa_pool_size -> ValueError).
    ("flash-page512-near-floor", case(FLASH, 3_000_000_000, page_size=512)),
    ("flash-window4096-below-floor", case({**FLASH, "sliding_window": 4096}, 3_000_000_000, page_size=512)),
    # An explicit ratio 0 is a setting sglang accepts and then rejects as an empty SWA pool.
    ("flash-ratio-zero", case(FLASH, 40 * GIB, swa_full_tokens_ratio=0)),
    # User caps on the constraint path (calculate_pool_sizes_from_max_tokens): ratio mode floors
    # the SWA pool first (2000 -> 1792 full, 179 -> 0 SWA: ValueError); cap mode keeps its SWA
    # pool, so 200 tokens align to an empty full pool (MemoryPoolConfig: RuntimeError), and 400
    # align to 256, which caps max_running_requests at 256 // 2 = 128 (C128 state 129 * 128).
    ("flash-user-cap-swa-floor", case(FLASH, 40 * GIB, max_total_tokens=2000)),
    ("flash-cap-mode-user-cap-empty", case(FLASH, 40 * GIB, swa_sizing="cap", max_total_tokens=200)),
    ("flash-cap-mode-user-cap-halves-requests", case(FLASH, 40 * GIB, swa_sizing="cap", max_total_tokens=400)),
    # MHA Default (cell = kv_heads * 2 * head_dim * stage layers * dtype): 33 layers over 2 ranks
    # (17 + 16); the 17-layer rank binds: 10 GiB // (8*256*17*2) = 154202 -> 154192 on page 16.
    (
        "mha-default-pp2-uneven",
        case({"kind": "mha", "num_layers": 33, "kv_heads": 8, "head_dim": 128}, 10 * GIB, 2, page_size=16),
    ),
    ("mha-default-no-token", case({"kind": "mha", "num_layers": 32, "kv_heads": 8, "head_dim": 128}, 100_000)),
    # Hybrid SWA over PP (the last 6 of 8 layers are SWA; layer counts are the stage's own):
    # rank 0 holds 2 full + 2 SWA layers (cell 2*2048 + 0.5*2*2048 = 6144 -> 349504 full tokens),
    # rank 1 only SWA layers, so it sizes SWA tokens alone (all-SWA: cell 4*2048, no ratio, full
    # 0 -> 262144). The MIN over ranks compares rank 1's SWA count with rank 0's full count, as
    # sglang's does, and rank 0 is re-sized to 262144 full, 131072 SWA.
    (
        "mha-hybrid-pp2-all-swa-stage",
        case(
            {"kind": "mha", "num_layers": 8, "kv_heads": 4, "head_dim": 128, "swa_layers": 6, "swa_window": 1024},
            2 * GIB,
            2,
            page_size=64,
            swa_full_tokens_ratio=0.5,
        ),
    ),
    # swa_sizing "cap" means the operator set no ratio: an MHA model then runs at sglang's
    # default 0.8 whatever ratio the case holds (no request cap: max_running_requests is unset),
    # which is the golden gemma-like plan: 40 GiB / (4096*24 + 0.8*4096*24) -> 242688 on page 64.
    (
        "mha-hybrid-cap-sizing-keeps-default-ratio",
        case(
            {"kind": "mha", "num_layers": 48, "kv_heads": 8, "head_dim": 128, "swa_layers": 24, "swa_window": 4096},
            40 * GIB,
            page_size=64,
            swa_sizing="cap",
            swa_full_tokens_ratio=0.3,
        ),
    ),
    # Hybrid SWA floor (window 4096 + page 64): 500 MB / 176947.2 -> 2816 full, 2240 SWA.
    (
        "mha-hybrid-swa-floor",
        case(
            {"kind": "mha", "num_layers": 48, "kv_heads": 8, "head_dim": 128, "swa_layers": 24, "swa_window": 4096},
            500_000_000,
            page_size=64,
        ),
    ),
    (
        "mha-hybrid-user-cap-swa-floor",
        case(
            {"kind": "mha", "num_layers": 48, "kv_heads": 8, "head_dim": 128, "swa_layers": 24, "swa_window": 4096},
            40 * GIB,
            page_size=64,
            max_total_tokens=5000,
        ),
    ),
    # All-SWA model: no floor check, an empty pool is MemoryPoolConfig's RuntimeError.
    (
        "mha-all-swa-no-token",
        case(
            {"kind": "mha", "num_layers": 4, "kv_heads": 1, "head_dim": 64, "swa_layers": 4, "swa_window": 128},
            1000,
            page_size=16,
        ),
    ),
]


def answer(raw: dict):
    """The planner's ranks for ``raw`` (``rank_answer``), or the name of the exception it refuses it with."""
    c = parse_case(raw)
    try:
        plan = c.plan()
    except (ValueError, RuntimeError) as e:
        return type(e).__name__
    return rank_answer(plan, c.is_dsv4)


def regenerate() -> list[dict]:
    """Every case with its answer, in the JSON's form."""
    return [{"name": name, "case": raw, "expected": answer(raw)} for name, raw in CASES]


def render(entries: list[dict]) -> str:
    return json.dumps(entries, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = CliParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the checked-in JSON, write nothing")
    args = parser.parse_args(argv)
    text = render(regenerate())
    if args.check:
        same = OUTPUT.read_text() == text
        print(f"{OUTPUT.name} {'is' if same else 'is NOT'} this script's output")
        return 0 if same else 1
    OUTPUT.write_text(text)
    print(f"wrote {len(CASES)} cases to {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
