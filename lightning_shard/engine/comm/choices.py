"""How the engine's collectives run on this machine: a choice per backend, made once per engine.

These are not training knobs (the values are the same either way, up to the order of floating-point additions in
a sum of more than two pieces): the defaults (``"auto"``) are what measured fastest on each backend, and
:class:`CommChoices` is the one override, for the benchmarks that compare the forms and the tests that pin one. An
engine holds one (``ShardEngine.comm``; ``CommChoices()`` unless told otherwise) and hands it to every bucket in its
``BucketContext`` (buckets/context.py), where the reduce-scatter's form is resolved once for the backend and each
bucket's all-gather form for its size. No global state: a choice travels with the engine that was given it.

* ``reduce_scatter``: the gradient reduce-scatter's form (comm/reduce.py :func:`~.reduce.reduce_form`): ``"auto"``
  (an all-to-all and a sum on gloo, the backend's reduce-scatter elsewhere), ``"reduce_scatter"``, ``"all_to_all"``,
  ``"all_reduce"``;
* ``all_gather``: the parameter all-gathers' form, per bucket by size (comm/gather.py
  :func:`~.gather.all_gather_form`): ``"auto"`` (N broadcasts on gloo for buckets of 1 MiB and more, the backend's
  all-gather elsewhere), ``"all_gather"``, ``"broadcast"``;
* ``huge_pages``: advise the large host buffers allocated every step as transparent huge pages (comm/hostmem.py;
  it does nothing off CPU, off Linux, where THP is ``never``, and below 4 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .collectives import Group
from .gather import ALL_GATHER_VIA, AllGatherForm, all_gather_form
from .reduce import REDUCE_SCATTER_VIA, ReduceForm, reduce_form


@dataclass(frozen=True)
class CommChoices:
    reduce_scatter: str = "auto"
    all_gather: str = "auto"
    huge_pages: bool = True

    def __post_init__(self) -> None:
        if self.reduce_scatter not in REDUCE_SCATTER_VIA:
            raise ValueError(f"CommChoices.reduce_scatter must be one of {REDUCE_SCATTER_VIA}, got "
                             f"{self.reduce_scatter!r}")
        if self.all_gather not in ALL_GATHER_VIA:
            raise ValueError(f"CommChoices.all_gather must be one of {ALL_GATHER_VIA}, got {self.all_gather!r}")
        object.__setattr__(self, "huge_pages", bool(self.huge_pages))

    def reduce_form(self, group: Group = None) -> ReduceForm:
        """The gradient reduce-scatter's form on ``group`` (once per engine)."""
        return reduce_form(self.reduce_scatter, group)

    def all_gather_form(self, group: Group = None, nbytes: Optional[int] = None) -> AllGatherForm:
        """The parameter all-gather's form on ``group`` for an output of ``nbytes`` (once per bucket)."""
        return all_gather_form(self.all_gather, group, nbytes)
