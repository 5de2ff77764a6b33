"""What the CPU kernels will really run on this machine: oneDNN's instruction set (the CPU's flags, as limited by
`ONEDNN_MAX_CPU_ISA`) and torch's own kernels' capability (`ATEN_CPU_CAPABILITY`).

A CPU flag alone does not say which kernels run: oneDNN takes the highest instruction set the CPU has that its
environment limit allows, and a bf16 matmul runs in hardware only at AVX512_CORE_BF16 or above (below, oneDNN
emulates it, or from AVX2 down refuses the bf16 weight reorder altogether). The functions taking `cpuinfo` (Linux's
/proc/cpuinfo text) and an environment value are pure, for tests; the ones without read this machine.
"""

from __future__ import annotations

import functools
import os
import platform

# oneDNN's instruction sets, lowest first (its ONEDNN_MAX_CPU_ISA names), each with the /proc/cpuinfo flags it
# needs on top of the set it extends (AVX2_VNNI and AVX512_CORE both extend AVX2)
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16")
_ISA_NEEDS = {
    "SSE41": (None, {"sse4_1"}),
    "AVX": ("SSE41", {"avx"}),
    "AVX2": ("AVX", {"avx2"}),
    "AVX2_VNNI": ("AVX2", {"avx_vnni"}),
    "AVX2_VNNI_2": ("AVX2_VNNI", {"avx_vnni_int8", "avx_ne_convert"}),
    "AVX512_CORE": ("AVX2", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "AVX512_CORE_VNNI": ("AVX512_CORE", {"avx512_vnni"}),
    "AVX512_CORE_BF16": ("AVX512_CORE_VNNI", {"avx512_bf16"}),
    "AVX512_CORE_FP16": ("AVX512_CORE_BF16", {"avx512_fp16"}),
    "AVX512_CORE_AMX": ("AVX512_CORE_FP16", {"amx_tile", "amx_int8", "amx_bf16"}),
    "AVX512_CORE_AMX_FP16": ("AVX512_CORE_AMX", {"amx_fp16"}),
}
_ISA_ALIASES = {"AVX10_1_512": "AVX512_CORE_FP16", "AVX10_1_512_AMX": "AVX512_CORE_AMX"}
BF16_ISA = "AVX512_CORE_BF16"  # the lowest oneDNN set with bf16 multiplies in hardware


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first `flags` line of /proc/cpuinfo text (empty without one: not x86, or not Linux)."""
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def onednn_isa_limit(value: str | None) -> str | None:
    """The oneDNN instruction set an ONEDNN_MAX_CPU_ISA value names (case-insensitive, aliases resolved), or None
    for no limit (unset, empty, DEFAULT, ALL, or a name oneDNN does not know: it ignores those too)."""
    name = (value or "").upper()
    name = _ISA_ALIASES.get(name, name)
    return name if name in ONEDNN_ISAS else None


def cpu_onednn_isa(flags: frozenset[str], limit: str | None = None) -> str | None:
    """The highest oneDNN instruction set these CPU flags provide, at or below `limit` (an ONEDNN_ISAS name; None:
    any), as oneDNN picks it (None: below SSE4.1)."""
    def has(isa: str | None) -> bool:
        return isa is None or (has(_ISA_NEEDS[isa][0]) and _ISA_NEEDS[isa][1] <= flags)

    allowed = ONEDNN_ISAS if limit is None else ONEDNN_ISAS[: ONEDNN_ISAS.index(limit) + 1]
    return next((isa for isa in reversed(allowed) if has(isa)), None)


@functools.cache  # pure; the model build asks once per packed layer
def onednn_isa_for(cpuinfo: str, max_isa: str | None) -> str | None:
    """The instruction set oneDNN's kernels run at: the best the CPU has (from /proc/cpuinfo text) that the
    ONEDNN_MAX_CPU_ISA value `max_isa` allows (None: below SSE4.1)."""
    return cpu_onednn_isa(cpu_flags(cpuinfo), onednn_isa_limit(max_isa))


def onednn_runs_bf16_for(cpuinfo: str, max_isa: str | None) -> bool:
    """Whether oneDNN multiplies bf16 in hardware (AVX512-BF16 or AMX) with this CPU and ONEDNN_MAX_CPU_ISA."""
    isa = onednn_isa_for(cpuinfo, max_isa)
    return isa is not None and ONEDNN_ISAS.index(isa) >= ONEDNN_ISAS.index(BF16_ISA)


def onednn_runs_amx_for(cpuinfo: str, max_isa: str | None) -> bool:
    """Whether oneDNN multiplies bf16 on AMX tiles with this CPU and ONEDNN_MAX_CPU_ISA."""
    isa = onednn_isa_for(cpuinfo, max_isa)
    return isa is not None and ONEDNN_ISAS.index(isa) >= ONEDNN_ISAS.index("AVX512_CORE_AMX")


def aten_capability_for(cpuinfo: str, env: str | None) -> str:
    """torch's CPU capability ('DEFAULT', 'AVX2', 'AVX512') on an x86-64 CPU, as ATen picks it: the
    ATEN_CPU_CAPABILITY value `env` when it is one of 'default', 'avx2', 'avx512' (exactly; torch ignores any other),
    else the best the CPU's flags allow. An x86-64 build of torch with both kernel sets is assumed."""
    if env in ("default", "avx2", "avx512"):
        return env.upper()
    flags = cpu_flags(cpuinfo)
    if {"avx512vl", "avx512bw", "avx512dq", "fma"} <= flags:
        return "AVX512"
    return "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT"


def cpu_model_in(cpuinfo: str, fallback: str = "") -> str:
    """The CPU model /proc/cpuinfo text names: its first processor's model name, with its x86 family, model and
    stepping where it gives them (a hypervisor may name every Xeon "Intel(R) Xeon(R) Processor"; those numbers tell
    them apart); `fallback` where it has no model name."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block only
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or fallback
    numbers = [f"{key} {fields[key]}" for key in ("cpu family", "model", "stepping") if fields.get(key, "").isdigit()]
    return f"{name} ({', '.join(numbers)})" if name and numbers else name


def cpu_model() -> str:
    """This machine's CPU model (cpu_model_in; where /proc/cpuinfo names none, what the platform says)."""
    return cpu_model_in(read_cpuinfo(), platform.processor() or platform.machine())


@functools.cache
def read_cpuinfo() -> str:
    """This machine's /proc/cpuinfo text ('' where there is none), read once (the kernel writes it anew for each
    read: 0.05-0.3 ms)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def onednn_max_isa_env() -> str | None:
    """This process's oneDNN ISA limit, as oneDNN reads it: ONEDNN_MAX_CPU_ISA, else (unset or
    empty) the older DNNL_MAX_CPU_ISA."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")


def onednn_isa() -> str | None:
    """The instruction set oneDNN's kernels run at on this machine."""
    return onednn_isa_for(read_cpuinfo(), onednn_max_isa_env())


def onednn_runs_bf16() -> bool:
    """Whether oneDNN multiplies bf16 in hardware on this machine, as this process's environment limits it."""
    return onednn_runs_bf16_for(read_cpuinfo(), onednn_max_isa_env())


def onednn_runs_amx() -> bool:
    """Whether oneDNN multiplies bf16 on AMX tiles on this machine, as this process's environment limits it."""
    return onednn_runs_amx_for(read_cpuinfo(), onednn_max_isa_env())


def aten_capability() -> str:
    """torch's own kernels' capability in this process (torch's answer, which honours ATEN_CPU_CAPABILITY)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def describe() -> str:
    """One line for reports: which kernels this process's CPU matmuls and elementwise ops run."""
    return f"oneDNN {onednn_isa() or 'none'}, ATen {aten_capability()}"
