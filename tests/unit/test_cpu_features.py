"""Feature detection from given /proc/cpuinfo text and environment values: what oneDNN and ATen will run."""

import os

import pytest
import torch

from vla_node.backends import cpu_features
from vla_node.backends.cpu_features import (
    aten_capability_for,
    cpu_flags,
    cpu_onednn_isa,
    onednn_isa_for,
    onednn_isa_limit,
    onednn_runs_bf16_for,
)
from vla_node.backends.fp16_weights import cpu_has_bf16

HEAD = "processor\t: 0\nvendor_id\t: GenuineIntel\n"
BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma f16c"
AVX2_ONLY = HEAD + f"flags\t\t: {BASE} avx2\n"  # Haswell .. Alder Lake's E-cores: no AVX-512
AVX512 = BASE + " avx2 avx512f avx512dq avx512cd avx512bw avx512vl"
SKYLAKE_X = HEAD + f"flags\t\t: {AVX512}\n"  # AVX-512, no VNNI, no bf16
EPYC_ZEN4 = HEAD + f"flags\t\t: {AVX512} avx512_vnni avx512_bf16 avx512_vbmi2\n"  # AVX-512 BF16, no AMX
SAPPHIRE_RAPIDS = HEAD + (f"flags\t\t: {AVX512} avx_vnni avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile "
                          "amx_int8\n")
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16\n"


def test_flags_are_the_first_flags_line_and_whole_words_only():
    assert cpu_flags(HEAD + "flags\t\t: fpu avx2\nflags\t\t: avx512f\n") == {"fpu", "avx2"}
    assert "avx512_bf16" not in cpu_flags(HEAD + "flags\t\t: fpu avx512_bf16x\n")
    assert cpu_flags(ARM) == cpu_flags("") == frozenset()


@pytest.mark.parametrize("cpuinfo, isa", [
    (AVX2_ONLY, "AVX2"), (SKYLAKE_X, "AVX512_CORE"), (EPYC_ZEN4, "AVX512_CORE_BF16"),
    (SAPPHIRE_RAPIDS, "AVX512_CORE_AMX"), (HEAD + "flags\t\t: fpu sse sse2\n", None), (ARM, None),
])
def test_the_cpu_isa_is_the_highest_set_whose_flags_are_all_there(cpuinfo, isa):
    assert cpu_onednn_isa(cpu_flags(cpuinfo)) == isa
    assert onednn_isa_for(cpuinfo, None) == isa


def test_bf16_flags_above_a_missing_set_do_not_count():
    """avx512_bf16 without AVX-512 core (not a real CPU, a partial flags line): oneDNN's set is AVX2."""
    assert onednn_isa_for(AVX2_ONLY.replace("avx2", "avx2 avx512_bf16"), None) == "AVX2"
    assert not onednn_runs_bf16_for(AVX2_ONLY.replace("avx2", "avx2 avx512_bf16 amx_bf16"), None)


@pytest.mark.parametrize("value, limit", [
    (None, None), ("", None), ("DEFAULT", None), ("all", None), ("bogus", None),  # oneDNN ignores unknown names
    ("AVX2", "AVX2"), ("avx2", "AVX2"), ("Avx512_Core_Bf16", "AVX512_CORE_BF16"),
    ("AVX10_1_512", "AVX512_CORE_FP16"), ("avx10_1_512_amx", "AVX512_CORE_AMX"),
])
def test_the_isa_limit_reads_onednn_names_case_insensitively(value, limit):
    assert onednn_isa_limit(value) == limit


@pytest.mark.parametrize("cpuinfo, max_isa, isa, bf16", [
    (EPYC_ZEN4, None, "AVX512_CORE_BF16", True),
    (EPYC_ZEN4, "AVX2", "AVX2", False),  # what an AVX2-only CPU runs: the bf16 reorder is refused
    (EPYC_ZEN4, "AVX512_CORE", "AVX512_CORE", False),  # bf16 emulated
    (EPYC_ZEN4, "AVX512_CORE_BF16", "AVX512_CORE_BF16", True),
    (EPYC_ZEN4, "AVX512_CORE_AMX", "AVX512_CORE_BF16", True),  # a limit above the CPU changes nothing
    (SAPPHIRE_RAPIDS, None, "AVX512_CORE_AMX", True),
    (SAPPHIRE_RAPIDS, "AVX512_CORE_VNNI", "AVX512_CORE_VNNI", False),
    (SAPPHIRE_RAPIDS, "avx512_core_bf16", "AVX512_CORE_BF16", True),
    (SAPPHIRE_RAPIDS, "AVX2_VNNI", "AVX2_VNNI", False),
    (EPYC_ZEN4, "AVX2_VNNI", "AVX2", False),  # no AVX-VNNI: the best below the limit that the CPU has
    (SKYLAKE_X, None, "AVX512_CORE", False),
    (AVX2_ONLY, "ALL", "AVX2", False),
    (ARM, None, None, False),
])
def test_oneDNN_runs_the_cpu_isa_capped_by_the_limit(cpuinfo, max_isa, isa, bf16):
    assert onednn_isa_for(cpuinfo, max_isa) == isa
    assert onednn_runs_bf16_for(cpuinfo, max_isa) == bf16
    assert cpu_features.onednn_runs_amx_for(cpuinfo, max_isa) == (isa in ("AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16"))
    assert cpu_has_bf16(cpuinfo, "" if max_isa is None else max_isa) == bf16


@pytest.mark.parametrize("cpuinfo, env, capability", [
    (EPYC_ZEN4, None, "AVX512"), (EPYC_ZEN4, "avx2", "AVX2"), (EPYC_ZEN4, "default", "DEFAULT"),
    (EPYC_ZEN4, "AVX2", "AVX512"),  # torch compares exactly and ignores (with a warning) anything else
    (AVX2_ONLY, None, "AVX2"), (AVX2_ONLY.replace(" fma", ""), None, "DEFAULT"), (ARM, None, "DEFAULT"),
])
def test_aten_capability_follows_torch_rules(cpuinfo, env, capability):
    assert aten_capability_for(cpuinfo, env) == capability


def test_the_machine_wrappers_read_this_process():
    cpuinfo = cpu_features.read_cpuinfo()
    limit = cpu_features.onednn_max_isa_env()
    assert cpu_features.onednn_isa() == onednn_isa_for(cpuinfo, limit)
    assert cpu_features.onednn_runs_bf16() == onednn_runs_bf16_for(cpuinfo, limit) == cpu_has_bf16()
    assert cpu_features.onednn_runs_amx() == cpu_features.onednn_runs_amx_for(cpuinfo, limit)
    assert cpu_features.aten_capability() == torch.backends.cpu.get_cpu_capability()
    if cpu_flags(cpuinfo) >= {"avx2", "fma"}:  # an x86-64 Linux machine: our rules agree with torch's answer
        assert aten_capability_for(cpuinfo, os.environ.get("ATEN_CPU_CAPABILITY")) == cpu_features.aten_capability()
    assert cpu_features.describe().startswith("oneDNN ")


def test_the_environment_limit_is_read_as_onednn_reads_it(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert cpu_features.onednn_max_isa_env() is None
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")  # the older prefix
    assert cpu_features.onednn_max_isa_env() == "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "")  # empty: oneDNN falls back to the older prefix
    assert cpu_features.onednn_max_isa_env() == "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert cpu_features.onednn_max_isa_env() == "AVX512_CORE"


def test_the_cpu_model_names_the_x86_family_model_and_stepping_of_the_first_processor():
    kvm_xeon = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\n"
                "model name\t: Intel(R) Xeon(R) Processor\nstepping\t: 1\nflags\t\t: fpu\n\n"
                "processor\t: 1\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Another\nstepping\t: 2\n")
    assert cpu_features.cpu_model_in(kvm_xeon) == "Intel(R) Xeon(R) Processor (cpu family 6, model 167, stepping 1)"
    assert cpu_features.cpu_model_in("\n" + kvm_xeon) == cpu_features.cpu_model_in(kvm_xeon)  # leading blank lines
    # no numbers (an ARM core): the name alone; no name: the fallback
    assert cpu_features.cpu_model_in("processor\t: 0\nmodel name\t: ARMv8 Processor rev 1 (v8l)\n") == (
        "ARMv8 Processor rev 1 (v8l)")
    assert cpu_features.cpu_model_in(ARM, "aarch64") == "aarch64"
    assert cpu_features.cpu_model_in("", "x86_64") == "x86_64"
    # a model field that is not a number (some hypervisors leave it blank) is left out
    assert cpu_features.cpu_model_in("model name\t: EPYC\ncpu family\t: 25\nmodel\t\t: \n") == "EPYC (cpu family 25)"
    names = [line.split(":", 1)[1].strip() for line in cpu_features.read_cpuinfo().splitlines()
             if line.startswith("model name")]
    if names:  # this machine: its first model name, whatever follows it
        assert cpu_features.cpu_model().startswith(names[0])
