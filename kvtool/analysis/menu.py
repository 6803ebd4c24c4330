"""The uniform menu: every budget-filling uniform family, named in one place (no torch here).

A budget-filling baseline of a plan at ``f`` of the float16 bytes is one setting applied to every
layer and KV head whose parameter is searched so that it stores as close to ``f`` as it can without
exceeding it (:mod:`kvtool.analysis.fill`). The menu composes them:

- **eviction x storage**: each eviction (:data:`EVICTIONS`: kvtool's SnapKV and StreamingLLM, and
  each kvpress press, :data:`PRESSES`) keeps a share of the tokens, stored in each storage
  (:data:`STORAGES`: float16, KIVI 4 / 2 bits at groups of 32 / 128, ...). The kept share is what
  is searched: a storage at ratio ``r`` of float16 lets the eviction keep about ``f / r`` of the
  tokens. Family names are ``EVICTION`` (float16) or ``EVICTION+STORAGE`` (``streaming+kivi4g128``);
  presses are methods ``press:NAME`` / ``press:NAME+STORAGE``.
- **storage alone**: ``kivi`` (:data:`KIVI_SEARCH`: the most bits, then the smallest group that
  fit, then full-precision recent tokens grown to fill the rest) and any storage marked ``alone``
  (its recent tokens grown the same way), plus the per-element families ``bitmap``, ``bitmapq``
  and ``signvq``.

Adding a storage is one line in :data:`STORAGES`: every eviction and every press gets it, and
``kvtool tasks``, ``kvtool recommend`` and the report pick it up; rotated KIVI (``rkivi``,
``rotate=hadamard``) is three such lines.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.core.errors import UsageError


@dataclass(frozen=True)
class Storage:
    """How an eviction's kept tokens are stored: ``spec`` a kvtool format spec (None: float16);
    ``alone``: also a family of its own (every token kept in this storage, the most recent ones in
    full precision to fill the budget)."""

    spec: str | None
    alone: bool = False
    servable: bool = True  # a paged cache holds it as it is


KIVI = "quant:bits={bits},group={group},residual=0,partial=true"

# suffix of the family name -> storage ("" = float16). One line adds a storage to every eviction.
STORAGES: dict[str, Storage] = {
    "": Storage(None),
    "kivi4": Storage(KIVI.format(bits=4, group=32)),
    "kivi2": Storage(KIVI.format(bits=2, group=32)),
    "kivi4g128": Storage(KIVI.format(bits=4, group=128)),
    "kivi2g128": Storage(KIVI.format(bits=2, group=128)),
    # rotated KIVI (``rotate=hadamard``: a Walsh-Hadamard rotation of each head vector first)
    "rkivi4g128": Storage(KIVI.format(bits=4, group=128) + ",rotate=hadamard"),
    "rkivi2g128": Storage(KIVI.format(bits=2, group=128) + ",rotate=hadamard"),
}

# KIVI searched alone (the most bits, then the smallest group that fit, then the residual grown):
# family -> extra quant parameters (rkivi: the same search with the Hadamard rotation)
KIVI_SEARCH: dict[str, str] = {"kivi": "", "rkivi": ",rotate=hadamard"}

# kvtool's own evictions: name -> (float16 spec of a kept share, eviction step in front of a storage)
EVICTIONS: dict[str, tuple[str, str]] = {
    "snapkv": ("snapstream:share={share}", "snapkv:share={share}"),
    "streaming": ("snapstream:share={share},policy=streaming", "streaming:share={share}"),
}

# families that are not an eviction: the storage searched alone, and per-element pruning / coding
STANDALONE = (*KIVI_SEARCH, "bitmap", "bitmapq", "signvq")
SERVABLE_STANDALONE = tuple(KIVI_SEARCH)

# the kvpress presses of the menu (kvtool.hf.presses names; adakv-NAME wraps a scorer in AdaKV)
PRESSES = ("snapkv", "expected_attention", "tova", "knorm", "streaming_llm", "adakv-expected_attention")


def family_name(eviction: str, storage: str) -> str:
    return eviction + (f"+{storage}" if storage else "")


def eviction_families() -> tuple[str, ...]:
    """``snapkv``, ``snapkv+kivi4``, ..., ``streaming+kivi2g128``: each eviction x each storage."""
    return tuple(family_name(e, s) for e in EVICTIONS for s in STORAGES)


def alone_families() -> tuple[str, ...]:
    """The storages marked ``alone``, as families of their own (named by their suffix)."""
    return tuple(s for s, st in STORAGES.items() if st.alone and s)


FAMILIES: tuple[str, ...] = tuple(KIVI_SEARCH) + eviction_families() + alone_families() + ("bitmap", "bitmapq", "signvq")


def servable_families() -> tuple[str, ...]:
    """The families a paged cache holds (whole tokens, no per-element selection)."""
    return tuple(f for f in FAMILIES if f in SERVABLE_STANDALONE or (f not in STANDALONE and storage_of(f).servable))


def split_family(family: str) -> tuple[str | None, str]:
    """``"streaming+kivi4g128"`` -> ``("streaming", "kivi4g128")``; a storage-alone family ->
    ``(None, suffix)``; UsageError for a name that is not a family."""
    if family in STANDALONE:
        return None, family
    evict, _, store = family.partition("+")
    if evict in EVICTIONS and store in STORAGES:
        return evict, store
    if not store and evict in STORAGES and STORAGES[evict].alone:
        return None, evict
    raise UsageError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")


def storage_of(family: str) -> Storage:
    return STORAGES[split_family(family)[1]]


def press_storage_spec(suffix: str) -> str:
    """The storage spec of ``press:NAME+SUFFIX`` (``dense`` for float16); UsageError otherwise."""
    if suffix not in STORAGES:
        names = ", ".join("+" + s for s in STORAGES if s)
        raise UsageError(f"a press's tokens are stored as float16 (press:NAME) or {names}, not +{suffix}")
    return STORAGES[suffix].spec or "dense"


def press_suffix(storage_spec: str) -> str:
    """The suffix of a press method storing its tokens with ``storage_spec`` ("" for float16)."""
    return next((s for s, st in STORAGES.items() if (st.spec or "dense") == storage_spec), "")


def press_methods(presses: tuple[str, ...] = PRESSES) -> tuple[str, ...]:
    """``press:NAME`` and ``press:NAME+STORAGE`` for every press and storage."""
    return tuple(f"press:{family_name(p, s)}" for p in presses for s in STORAGES)


# method aliases of `kvtool tasks --methods` (and scripts/tasks_gpu.sh): the whole uniform menu
ALIASES = {"families": FAMILIES, "presses": press_methods(), "menu": FAMILIES + press_methods()}


def kvpress_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("kvpress") is not None
