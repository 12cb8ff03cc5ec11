"""A vLLM general plugin (`vllm.general_plugins` in pyproject.toml): vLLM runs it in every process it starts (the
API server, the engine core, each worker) before a model loads.

On a CPU with AMX, vLLM 0.32's CPU attention kernel runs AMX tile instructions without asking Linux for the
permission a process needs before its first one (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; torch's
oneDNN asks for itself, vLLM's kernel does not). An engine whose first AMX instruction is vLLM's dies of SIGILL
("Fatal Python error: Illegal instruction" in `cpu_attention_with_kv_cache`, the engine core gone without a
traceback): measured on a Xeon with AMX, the Qwen3-MoE miniature's extraction server at its first request. Asking is
harmless elsewhere: on a CPU without AMX the kernel refuses and nothing changes.
"""

from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx() -> bool:
    """Ask for AMX tile data in this process (and the processes it forks); whether it may use AMX now."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return amx_permitted(libc)


def amx_permitted(libc: ctypes.CDLL | None = None) -> bool:
    """Whether this process may use AMX tile data (False off Linux x86-64)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = libc or ctypes.CDLL(None, use_errno=True)
    features = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
        return False
    return bool(features.value & (1 << XFEATURE_XTILEDATA))
