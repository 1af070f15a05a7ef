"""One huge-page-backed buffer for the weights a decode step streams.

A decode step reads every weight once, so it is bound by memory bandwidth, and with 4 KiB pages it also
walks a page table entry for every 4 KiB it reads. Copying the weights into one buffer that the kernel is
asked to back with 2 MiB pages (madvise(MADV_HUGEPAGE), honoured when transparent huge pages are in
"madvise" or "always" mode) gave decode GEMVs up to ~20% more bandwidth on an AVX2 Zen 3 VM
(docs/performance.md). Where madvise is unavailable the buffer is an ordinary one: same numbers, no gain.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 * 1024 * 1024
MADV_HUGEPAGE = 14
ALIGN_BYTES = 64


def pack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors` (all of one dtype) laid out in one huge-page-advised buffer. Tensors
    off the CPU (a GPU's weights) come back as they are: the buffer is a host-memory concern."""
    if not tensors:
        return []
    if tensors[0].device.type != "cpu":
        return [t.contiguous() for t in tensors]
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
        raise ValueError("arena.pack takes tensors of one dtype")
    align = ALIGN_BYTES // tensors[0].element_size()
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() // align) * align
    extra = HUGE_PAGE // tensors[0].element_size()
    buffer = torch.empty(total + extra, dtype=dtype)  # [elements], untouched: no page is mapped yet
    _advise_huge_pages(buffer)
    start = (-buffer.data_ptr() % HUGE_PAGE) // buffer.element_size()  # first 2 MiB boundary
    views = []
    for t, offset in zip(tensors, offsets, strict=True):
        view = buffer[start + offset : start + offset + t.numel()].view(t.shape)  # same shape as t
        view.copy_(t)
        views.append(view)
    return views


def _advise_huge_pages(buffer: torch.Tensor) -> None:
    if not sys.platform.startswith("linux"):
        return
    begin = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= begin:
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(begin, end - begin, MADV_HUGEPAGE) != 0:
            log.info("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        log.info("no madvise: %s", exc)
