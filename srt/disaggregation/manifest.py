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

from sparsekv.srt.disaggregation.kv_args import MEM_KINDS, KVArgs, StateType

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
        """Inverse of :meth:`to_dict`, every field checked in its exact JSON type and range (a peer's
        manifest is untrusted: ``page_size`` 64.9 or ``"256"``, ``is_mla`` ``"false"``, a negative
        TP size or region size are refused, never coerced).

        Raises
        ------
        ManifestMismatchError
            A missing, mistyped or out-of-range field, named (``manifest.page_size``,
            ``manifest.components[0][1][2].nbytes``).
        """
        d = _field(d, "manifest", dict)
        comps = []
        for c, comp in enumerate(_field(d.get("components"), "manifest.components", list)):
            where = f"manifest.components[{c}]"
            comp = _field(comp, where, list)
            if len(comp) != 2:
                raise ManifestMismatchError(f"sparsekv: malformed state manifest: `{where}` must be "
                                            f"[name, regions], got {len(comp)} entries")
            name = _field(comp[0], f"{where}[0]", str)
            regions = []
            for i, r in enumerate(_field(comp[1], f"{where}[1]", list)):
                at = f"{where}[1][{i}]"
                r = _field(r, at, dict)
                unknown = sorted(set(r) - set(_REGION_FIELDS))
                if unknown:
                    raise ManifestMismatchError(f"sparsekv: malformed state manifest: `{at}` has unknown "
                                                f"fields {unknown[:4]}")
                mem_kind = _field(r.get("mem_kind"), f"{at}.mem_kind", str)
                if mem_kind not in MEM_KINDS:
                    raise ManifestMismatchError(f"sparsekv: malformed state manifest: `{at}.mem_kind` must be one "
                                                f"of {list(MEM_KINDS)}, got {mem_kind!r:.40}")
                regions.append(Region(_field(r.get("label"), f"{at}.label", str),
                                      _count(r.get("item_len"), f"{at}.item_len", 1),
                                      _count(r.get("nbytes"), f"{at}.nbytes", 0), mem_kind,
                                      _count(r.get("ptr"), f"{at}.ptr", 0)))
            comps.append((name, regions))
        layers = _field(d.get("layers"), "manifest.layers", list)
        if len(layers) != 2:
            raise ManifestMismatchError(f"sparsekv: malformed state manifest: `manifest.layers` must be [start, end], "
                                        f"got {len(layers)} entries")
        start = _count(layers[0], "manifest.layers[0]", 0)
        end = _count(layers[1], "manifest.layers[1]", start)
        tp_size = _count(d.get("attn_tp_size"), "manifest.attn_tp_size", 1)
        tp_rank = _count(d.get("attn_tp_rank"), "manifest.attn_tp_rank", 0, tp_size - 1)
        return cls(comps, (start, end), _count(d.get("page_size"), "manifest.page_size", 1), tp_size, tp_rank,
                   _field(d.get("is_mla"), "manifest.is_mla", bool))

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


_REGION_FIELDS = ("label", "item_len", "nbytes", "mem_kind", "ptr")
_INT_LIMIT = 1 << 63


def _field(value: object, name: str, kind: type):
    """``value`` if its type is exactly ``kind`` (a bool is no int, an int no float), else a mismatch
    naming ``name``."""
    if type(value) is not kind:  # noqa: E721 - exact: bool is an int subclass
        got = "nothing" if value is None else f"{type(value).__name__} {value!r:.40}"
        raise ManifestMismatchError(f"sparsekv: malformed state manifest: `{name}` must be a JSON "
                                    f"{_JSON_NAMES[kind]}, got {got}")
    return value


def _count(value: object, name: str, lowest: int, highest: int = _INT_LIMIT - 1) -> int:
    """``value`` if it is a JSON integer in ``[lowest, highest]``, else a mismatch naming ``name``."""
    if not lowest <= _field(value, name, int) <= highest:
        raise ManifestMismatchError(f"sparsekv: malformed state manifest: `{name}` must be in [{lowest}, {highest}], "
                                    f"got {value}")
    return value


_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "integer", bool: "boolean"}
