"""Bottleneck rings: the fastest ring through a set of devices and the speed of a given ring.

A ring collective runs at the speed of its slowest hop ("Design rules" 4; nccl-tests busbw), so the
ring bandwidth of a device set is the best, over all orders, of the minimum pair bandwidth along the
order. We test thresholds from the fastest pair down and look for a Hamiltonian cycle that uses only
pairs at least that fast (a small backtracking search: device sets here have at most a few dozen members,
and dense graphs - the common case - are answered without search).

This counts one ring; NCCL may run several rings over disjoint links, so the figure is a lower bound for
direct meshes (DGX-1, 4-GPU boards) and exact for switched fabrics and PCIe.
"""

from __future__ import annotations

from typing import Callable, Sequence

BwFn = Callable[[int, int], float]
_SEARCH_BUDGET = 200_000  # backtracking steps per threshold before we give up on that threshold


def ring_gbps(order: Sequence[int], bw: BwFn) -> float:
    """Speed of the ring that visits `order` and closes back to its start (inf for a single device)."""
    if len(order) < 2:
        return float("inf")
    if len(order) == 2:
        return bw(order[0], order[1])
    return min(bw(order[k], order[(k + 1) % len(order)]) for k in range(len(order)))


def best_ring(devices: Sequence[int], bw: BwFn) -> tuple[float, tuple[int, ...]]:
    """(bottleneck GB/s, device order) of the fastest ring through `devices`.

    `devices` is also the preferred order: when several rings tie, the one closest to it wins, so callers
    pass devices grouped by island to get island-contiguous rings.
    """
    devs = list(devices)
    if len(devs) < 3:
        return ring_gbps(devs, bw), tuple(devs)
    thresholds = sorted({bw(a, b) for i, a in enumerate(devs) for b in devs[i + 1 :]}, reverse=True)
    for t in thresholds:
        order = _hamiltonian_cycle(devs, lambda a, b, t=t: bw(a, b) >= t)
        if order is not None:
            return ring_gbps(order, bw), tuple(order)
    raise AssertionError("unreachable: the lowest threshold admits every pair")  # pragma: no cover


def _hamiltonian_cycle(devs: list[int], ok: Callable[[int, int], bool]) -> list[int] | None:
    n = len(devs)
    adj = {a: [b for b in devs if b != a and ok(a, b)] for a in devs}
    if all(len(v) == n - 1 for v in adj.values()):
        return list(devs)  # complete graph: the preferred order is a ring
    if any(len(v) < 2 for v in adj.values()) or not _connected(devs, adj):
        return None
    pos = {d: k for k, d in enumerate(devs)}
    for a in devs:  # prefer neighbours close in the preferred order
        adj[a].sort(key=lambda b: abs(pos[b] - pos[a]))
    start, path, seen, steps = devs[0], [devs[0]], {devs[0]}, 0

    def extend() -> bool:
        nonlocal steps
        steps += 1
        if steps > _SEARCH_BUDGET:
            return False
        last = path[-1]
        if len(path) == n:
            return start in adj[last]
        for nxt in adj[last]:
            if nxt not in seen:
                path.append(nxt)
                seen.add(nxt)
                if extend():
                    return True
                seen.discard(path.pop())
        return False

    return path if extend() else None


def _connected(devs: list[int], adj: dict[int, list[int]]) -> bool:
    seen, stack = {devs[0]}, [devs[0]]
    while stack:
        for b in adj[stack.pop()]:
            if b not in seen:
                seen.add(b)
                stack.append(b)
    return len(seen) == len(devs)
