"""The state manifest: what each side holds, agreed on before any byte is written.

The decode side announces, per component (``kv`` first, then each state component in order),
every region it registered: label, item bytes, region bytes, memory kind and address; plus its
layers, page size and attention TP. The prefill side checks its own manifest against it
(:func:`check_manifests`) and refuses the connection on any difference that would make a write
land in the wrong place: another component order or type, a region it has that the decode side
lacks, another item size, another page size, or TP sizes the state cannot be split across.
The refusal reaches both sides (:mod:`.bootstrap`), so nobody waits for a transfer that will
never come.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparsekv.srt.disaggregation.kv_args import KVArgs, StateType

KV_COMPONENT = "kv"
#: State types whose regions are sharded by attention TP head for non-MLA models: prefill and
#: decode must then use the same TP size (no re-sharding on the wire).
TP_SHARDED_STATES = (StateType.SWA, StateType.DSA)


class ManifestMismatchError(RuntimeError):
    """The two sides' manifests disagree; nothing was written."""


@dataclass(frozen=True)
class Region:
    """One registered region: what it holds, its geometry and where it is."""

    label: str
    item_len: int
    nbytes: int
    mem_kind: str
    ptr: int


@dataclass
class Manifest:
    """One side's announced layout (see the module docstring)."""

    components: list[tuple[str, list[Region]]] = field(default_factory=list)
    layers: tuple[int, int] = (0, 0)
    page_size: int = 1
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    is_mla: bool = True

    @classmethod
    def of(cls, kv_args: KVArgs) -> Manifest:
        """The manifest of ``kv_args``."""
        def regions(ptrs, lens, items, labels, kinds):
            return [Region(lb, it, ln, k, p) for p, ln, it, lb, k in zip(ptrs, lens, items, labels, kinds)]

        comps = [(KV_COMPONENT, regions(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens,
                                        kv_args.kv_labels, kv_args.kv_mem_kinds))]
        for i, t in enumerate(kv_args.state_types):
            comps.append((StateType(t).value, regions(kv_args.state_data_ptrs[i], kv_args.state_data_lens[i],
                                                       kv_args.state_item_lens[i], kv_args.state_labels[i],
                                                       kv_args.state_mem_kinds[i])))
        return cls(comps, tuple(kv_args.layers), kv_args.page_size, kv_args.attn_tp_size, kv_args.attn_tp_rank,
                   kv_args.is_mla)

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return {"components": [[name, [vars(r) for r in regions]] for name, regions in self.components],
                "layers": list(self.layers), "page_size": self.page_size, "attn_tp_size": self.attn_tp_size,
                "attn_tp_rank": self.attn_tp_rank, "is_mla": self.is_mla}

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        ManifestMismatchError
            A malformed manifest (missing or mistyped fields).
        """
        try:
            comps = [(str(name), [Region(**r) for r in regions]) for name, regions in d["components"]]
            return cls(comps, tuple(d["layers"]), int(d["page_size"]), int(d["attn_tp_size"]),
                       int(d["attn_tp_rank"]), bool(d["is_mla"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestMismatchError(f"sparsekv: malformed state manifest: {e!r}") from e

    @property
    def state_types(self) -> list[str]:
        """The state components' types, in order."""
        return [name for name, _ in self.components[1:]]

    def region_map(self, component: int) -> dict[str, Region]:
        """Label -> region of component ``component`` (0 = KV)."""
        return {r.label: r for r in self.components[component][1]}


def check_manifests(prefill: Manifest, decode: Manifest) -> None:
    """Check that every prefill region has a decode region to go to, and that the TP split works.

    Raises
    ------
    ManifestMismatchError
        Listing every difference found.
    """
    problems = []
    if prefill.state_types != decode.state_types:
        problems.append(f"state components differ: prefill {prefill.state_types}, decode {decode.state_types}")
    if prefill.page_size != decode.page_size:
        problems.append(f"page sizes differ: prefill {prefill.page_size}, decode {decode.page_size}")
    if prefill.attn_tp_size != decode.attn_tp_size:
        sharded = [t for t in prefill.state_types if t in {s.value for s in TP_SHARDED_STATES}]
        if (not prefill.is_mla or not decode.is_mla) and sharded:
            problems.append(f"PD transfer does not support different attention TP sizes (prefill "
                            f"{prefill.attn_tp_size}, decode {decode.attn_tp_size}) for non-MLA "
                            f"{'/'.join(sorted(set(sharded))).upper()} hybrid models")
        if StateType.MAMBA.value in prefill.state_types:
            problems.append(f"PD transfer does not split MAMBA state across different attention TP sizes "
                            f"(prefill {prefill.attn_tp_size}, decode {decode.attn_tp_size})")
    if not problems:
        for c, (name, regions) in enumerate(prefill.components):
            remote = decode.region_map(c)
            missing = [r.label for r in regions if r.label not in remote]
            if missing:
                problems.append(f"{name}: decode has no region for {missing[:6]}{'...' if len(missing) > 6 else ''} "
                                f"(decode layers {list(decode.layers)}, prefill layers {list(prefill.layers)})")
            for r in regions:
                other = remote.get(r.label)
                if other is not None and other.item_len != r.item_len:
                    problems.append(f"{name}: region {r.label!r} items are {r.item_len} B on prefill and "
                                    f"{other.item_len} B on decode")
    if problems:
        raise ManifestMismatchError("sparsekv: state manifest mismatch: " + "; ".join(problems))
