"""engine/comm/hostmem.py: the huge-page advice on the engine's per-step host buffers (knob ``huge_pages``).

What is ours is the call: the right range (the 2 MiB-aligned interior of the buffer), before the first write, only
where it can help. Whether the kernel then finds free huge pages is the kernel's business, so the check is the
mapping's ``VmFlags`` (``hg``: MADV_HUGEPAGE set) in ``/proc/self/smaps``, not a page-fault count.
"""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_shard.engine.comm import hostmem

MIB = 1 << 20
needs_thp = pytest.mark.skipif(not hostmem.available(), reason=f"no transparent huge pages to advise here "
                                                                 f"(mode {hostmem.thp_mode()!r})")


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding ``addr`` in this process."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _interior(t: torch.Tensor) -> tuple[int, int]:
    p, n = t.data_ptr(), t.numel() * t.element_size()
    return (p + hostmem.HUGE_PAGE - 1) // hostmem.HUGE_PAGE * hostmem.HUGE_PAGE, (p + n) // hostmem.HUGE_PAGE * \
        hostmem.HUGE_PAGE


@needs_thp
def test_a_large_buffer_is_advised_over_its_aligned_interior():
    """40 MiB (above glibc's largest dynamic mmap threshold, so a mapping of its own): without advice its mapping
    carries no ``hg`` flag; ``hostmem.empty(huge=True)`` sets it over the whole aligned interior, first to last huge
    page, and leaves the values to the caller (``zeros`` writes zeros after advising)."""
    plain = torch.empty(40 * MIB // 4)
    lo, hi = _interior(plain)
    assert "hg" not in _vm_flags(lo) or hostmem.thp_mode() == "always"
    t = hostmem.empty(40 * MIB // 4, torch.float32, torch.device("cpu"), huge=True)
    lo, hi = _interior(t)
    assert hi - lo >= 38 * MIB
    assert "hg" in _vm_flags(lo) and "hg" in _vm_flags(hi - 1)
    z = hostmem.zeros(10 * MIB // 4, torch.float32, torch.device("cpu"), huge=True)
    assert "hg" in _vm_flags(_interior(z)[0]) and not z.any()


def test_small_non_cpu_and_unasked_buffers_are_left_alone(monkeypatch):
    """Below MIN_BYTES, ``huge=False``, or where the kernel has no THP: no system call at all."""
    calls = []
    monkeypatch.setattr(hostmem, "_madvise", lambda: (lambda *a: calls.append(a) or 0))
    assert not hostmem.advise(torch.empty(hostmem.MIN_BYTES // 4 - 1))
    hostmem.empty(hostmem.MIN_BYTES, torch.uint8, torch.device("cpu"), huge=False)
    assert calls == []
    assert hostmem.advise(torch.empty(hostmem.MIN_BYTES // 4)) and len(calls) == 1
    lo, length, advice = calls[0]
    assert lo % hostmem.HUGE_PAGE == 0 and length % hostmem.HUGE_PAGE == 0 and advice == hostmem.MADV_HUGEPAGE
    monkeypatch.setattr(hostmem, "_madvise", lambda: None)  # THP "never", or not Linux
    assert not hostmem.advise(torch.empty(8 * MIB))
    assert len(calls) == 1


def test_thp_mode_reads_the_bracketed_choice(monkeypatch, tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hostmem, "THP_ENABLED", str(f))
    assert hostmem.thp_mode() == ("madvise" if sys.platform.startswith("linux") else "")
    monkeypatch.setattr(hostmem, "THP_ENABLED", str(tmp_path / "missing"))
    assert hostmem.thp_mode() == ""
