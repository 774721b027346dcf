import pytest
import torch
import torch.distributed as dist

from mmfsdp.config import ConfigError
from mmfsdp.parallel import (
    MeshPlan,
    ParallelConfig,
    backend_for,
    build_parallel_dims,
    detect_device_type,
    device_count,
    device_for_local_rank,
    init_process_group,
    peak_memory_gb,
    reset_peak_memory,
    synchronize,
)


def test_parallel_detect_device_type_on_this_machine(monkeypatch):
    monkeypatch.delenv("MMFSDP_DEVICE", raising=False)
    expected = "cuda" if torch.cuda.is_available() else None
    found = detect_device_type()
    assert found in ("cuda", "npu", "cpu")
    if expected:
        assert found == expected


def test_parallel_device_override(monkeypatch):
    monkeypatch.setenv("MMFSDP_DEVICE", "CPU")
    assert detect_device_type() == "cpu"
    monkeypatch.setenv("MMFSDP_DEVICE", "tpu")
    with pytest.raises(ConfigError, match="MMFSDP_DEVICE: 'tpu' is not one of cuda, npu, cpu"):
        detect_device_type()


def test_parallel_backends_and_local_devices(monkeypatch):
    assert [backend_for(t) for t in ("cuda", "npu", "cpu")] == ["nccl", "hccl", "gloo"]
    with pytest.raises(ValueError, match="unknown device type 'xpu2'"):
        backend_for("xpu2")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_for_local_rank("cuda") == torch.device("cuda", 3)
    assert device_for_local_rank("cpu") == torch.device("cpu")
    assert device_count("cpu") == 1
    assert device_count("cuda") == torch.cuda.device_count()


def test_parallel_cpu_memory_helpers():
    device = torch.device("cpu")
    reset_peak_memory(device)
    synchronize(device)
    before = peak_memory_gb(device)
    block = torch.ones(64, 1024, 1024, dtype=torch.uint8)  # 64 MiB, touched
    after = peak_memory_gb(device)
    assert 0 < before <= after
    assert after >= block.numel() / (1 << 30)


def test_parallel_single_process_group_and_mesh(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    try:
        assert init_process_group("cpu") == torch.device("cpu")
        assert (dist.get_world_size(), dist.get_rank(), dist.get_backend()) == (1, 0, "gloo")
        assert init_process_group("cpu") == torch.device("cpu")  # a second call keeps the group
        dims = build_parallel_dims(MeshPlan.from_config(ParallelConfig(), 1), "cpu")
        assert (dims.dp_rank, dims.dp_size, dims.cp_rank, dims.cp_size) == (0, 1, 0, 1)
        assert dims.fsdp_mesh.mesh_dim_names == ("dp_shard_cp",) and dims.fsdp_mesh.size() == 1
    finally:
        dist.destroy_process_group()


def test_parallel_collective_timeout_reaches_the_process_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="timeout_s must be > 0 seconds, got 0"):
        init_process_group("cpu", timeout_s=0)
    assert not dist.is_initialized()
    try:
        init_process_group("cpu", timeout_s=7)
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == 7
    finally:
        dist.destroy_process_group()


def test_parallel_timeout_keys_are_checked():
    assert (ParallelConfig().collective_timeout_s, ParallelConfig().heartbeat_timeout_s) == (1800.0, 600.0)
    assert ParallelConfig(heartbeat_timeout_s=0).heartbeat_timeout_s == 0
    with pytest.raises(ConfigError, match="collective_timeout_s: must be > 0 seconds, got 0"):
        ParallelConfig(collective_timeout_s=0)
    with pytest.raises(ConfigError, match="heartbeat_timeout_s: must be >= 0 seconds"):
        ParallelConfig(heartbeat_timeout_s=-1)
