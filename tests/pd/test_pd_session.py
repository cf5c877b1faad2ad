"""The pd-demo session's plan: the indices it draws stay within the pools, so what it allocates
follows from the budget (``pd-demo --layers 2 --pp-size 1`` once drew from 2**30 indices per
component without a region: 19.6 GB of free lists). A HiSparse decode without a C4 layer is refused
before anything is built."""

from __future__ import annotations

import numpy as np
import pytest

from sparsekv.testing.pd_session import DemoSpec, index_spaces, item_counts, make_plan, plan_sides


def _region_sizes(kv_args, component: int) -> list[tuple[int, int]]:
    """``(nbytes, item_len)`` of each region of a component."""
    if component == 0:
        return list(zip(kv_args.kv_data_lens, kv_args.kv_item_lens))
    return list(zip(kv_args.state_data_lens[component - 1], kv_args.state_item_lens[component - 1]))


@pytest.mark.parametrize(("layers", "pp_size"), [(2, 1), (1, 1), (6, 2)])
def test_the_plan_draws_its_indices_from_within_the_pools(layers, pp_size):
    spec = DemoSpec(num_layers=layers, pp_size=pp_size, budget_mib=16)
    sides = plan_sides(spec)
    spaces = index_spaces(sides, spec.seq_lens)
    plan = make_plan(spec)
    n_states = len(sides[-1].state_types)
    for c, space in enumerate(spaces):
        regions = [r for side in sides for r in _region_sizes(side, c)]
        # Every index fits every region of the component, on every side.
        assert all(space * item <= nbytes for nbytes, item in regions)
        demand = sum(item_counts(n, n_states)[c] for n in spec.seq_lens)
        if not regions:  # no byte moves: just enough distinct indices
            assert space == demand + 1
        for key in ("src", "dst"):
            drawn = np.concatenate([room[key][c] for room in plan])
            assert drawn.size == demand and np.unique(drawn).size == demand
            assert drawn.min() >= 1 and drawn.max() < space  # 0 is reserved
    # What the plan allocates: two boolean free lists per component and, per scattered draw, an
    # int64 list of one's free indices. Within the decode's pools, hence within the budget.
    plan_bytes = sum(2 * space + 8 * space for space in spaces)
    decode_bytes = sum(sides[-1].kv_data_lens) + sum(map(sum, sides[-1].state_data_lens))
    assert plan_bytes <= decode_bytes


def test_a_hisparse_decode_without_a_c4_layer_is_refused():
    with pytest.raises(ValueError, match=r"HiSparse decode needs a C4 layer.*argument `num_layers` \(2\)"):
        make_plan(DemoSpec(num_layers=2, pp_size=1, hisparse=True))
