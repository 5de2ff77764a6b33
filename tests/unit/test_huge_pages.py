"""backends/huge_pages.py: packed weights carved out of huge-page mappings, each tensor holding its mapping."""

import gc
import mmap

import pytest
import torch

from vla_node.backends import huge_pages

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def test_tensors_start_on_their_own_pages_from_a_2mb_boundary_and_keep_their_mapping():
    arena = huge_pages.HugePageArena(chunk=4 << 20)
    first = arena.empty(1000, torch.bfloat16)  # 2000 bytes: a page of its own
    second = arena.empty(3, torch.int8)
    assert first.shape == (1000,) and first.dtype == torch.bfloat16 and second.dtype == torch.int8
    assert first.data_ptr() % huge_pages.HUGE_PAGE == 0 and second.data_ptr() - first.data_ptr() == 4096
    big = arena.empty(5 << 20, torch.int8)  # more than a chunk: a mapping of its own, from its 2 MB boundary
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0 and big.numel() == 5 << 20
    third = arena.empty(1, torch.int8)  # the arena goes on in the big tensor's mapping
    assert third.data_ptr() - big.data_ptr() == 5 << 20
    first.fill_(1.5)
    second.fill_(-7)
    big.fill_(3)
    del arena
    gc.collect()  # the arena and its mappings' names are gone: the tensors still hold them
    assert bool((first == 1.5).all()) and bool((second == -7).all()) and int(big.sum()) == 3 * (5 << 20)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason=f"transparent huge pages are {_thp_mode()!r} here (madvise or always backs them)")
def test_a_written_mapping_is_backed_by_huge_pages():
    tensor = huge_pages.HugePageArena(chunk=8 << 20).empty(4 << 20, torch.int8)
    tensor.fill_(1)  # faulted in now
    # its own mapping's huge pages (the process's total moves with whatever else is freed meanwhile)
    assert _huge_kb_of_mapping(tensor.data_ptr()) >= 2048  # at least one 2 MB page (the rest may come later or not)


def _huge_kb_of_mapping(address: int) -> int:
    """AnonHugePages of the /proc/self/smaps mapping holding `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")
