"""The device peak table matches the names the runtimes report; a CPU's peak is measured by a timed GEMM."""

import pytest
import torch

from mmfsdp.parallel.peak import device_name, measure_gemm_tflops, table_peak_tflops


@pytest.mark.parametrize(
    "name, bf16, fp32",
    [
        ("NVIDIA H100 80GB HBM3", 989.0, 67.0),
        ("NVIDIA H100 PCIe", 756.0, 51.0),
        ("NVIDIA H100 NVL", 835.0, 60.0),
        ("NVIDIA H200", 989.0, 67.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 19.5),
        ("NVIDIA B200", 2250.0, 75.0),
        ("Ascend910B2", 376.0, 94.0),
        ("Ascend910B3", 313.0, 75.0),
        ("Ascend950PR", 500.0, 125.0),
    ],
)
def test_parallel_peak_table_matches_device_names(name, bf16, fp32):
    assert table_peak_tflops(name, torch.bfloat16) == bf16
    assert table_peak_tflops(name, torch.float16) == bf16
    assert table_peak_tflops(name, torch.float32) == fp32


def test_parallel_peak_unknown_device_has_no_table_entry():
    assert table_peak_tflops("NVIDIA GeForce RTX 4090", torch.bfloat16) is None
    assert device_name(torch.device("cpu")) == "cpu"


def test_parallel_peak_cpu_gemm_is_measured_without_touching_the_global_rng():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    tflops = measure_gemm_tflops(torch.device("cpu"), torch.float32, size=128, seconds=0.02)
    assert 0 < tflops < 100
    assert torch.equal(torch.rand(4), expected)
