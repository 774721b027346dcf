"""A CPU's measured peak (the MFU denominator) is stored per machine and shape, and read instead of timed again.

`resolve_peak_tflops` on one process with `$XDG_CACHE_HOME` in a temporary directory: the first call times the GEMM
and writes the file; the second reads the same number without timing (the timer is replaced by one that fails);
another dtype (another key) is timed again; a damaged file is measured over and rewritten; `tools.peak_tflops`
wins over all of it. The 2-rank path (rank 0's file decides for every rank, one broadcast) runs in every
multi-process test of the suite.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmfsdp.parallel import peak
from mmfsdp.train import mfu

CPU = torch.device("cpu")


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "mmfsdp" / "peak_tflops.json"


def _timer(values: list[float]):
    def measure(device, dtype):
        if not values:
            raise AssertionError("timed again although the peak is stored")
        return values.pop(0)

    return measure


def test_a_measured_peak_is_stored_and_read_back(cache_home, monkeypatch):
    monkeypatch.setattr(mfu, "measure_gemm_tflops", _timer([0.125]))
    value, source = mfu.resolve_peak_tflops(CPU, torch.float32, None)
    assert value == 0.125 and "measured by a 512x512" in source
    key = peak.measured_peak_key(CPU, torch.float32, 1)
    assert json.loads(cache_home.read_text()) == {key: 0.125}

    value, source = mfu.resolve_peak_tflops(CPU, torch.float32, None)  # the timer would fail now
    assert value == 0.125 and str(cache_home) in source and "delete it" in source

    monkeypatch.setattr(mfu, "measure_gemm_tflops", _timer([0.5]))
    assert mfu.resolve_peak_tflops(CPU, torch.bfloat16, None)[0] == 0.5  # another key
    assert len(json.loads(cache_home.read_text())) == 2
    assert mfu.resolve_peak_tflops(CPU, torch.float32, None)[0] == 0.125
    assert mfu.resolve_peak_tflops(CPU, torch.float32, 7.0) == (7.0, "tools.peak_tflops")


def test_a_damaged_file_is_measured_over(cache_home, monkeypatch):
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text("{not json")
    monkeypatch.setattr(mfu, "measure_gemm_tflops", _timer([0.25]))
    assert mfu.resolve_peak_tflops(CPU, torch.float32, None)[0] == 0.25
    assert list(json.loads(cache_home.read_text()).values()) == [0.25]


def test_the_key_names_what_the_rate_depends_on():
    key = peak.measured_peak_key(CPU, torch.float32, 4)
    assert "float32" in key and f"{torch.get_num_threads()} threads" in key and "4 ranks" in key
    assert torch.__version__ in key and key != peak.measured_peak_key(CPU, torch.float32, 2)
