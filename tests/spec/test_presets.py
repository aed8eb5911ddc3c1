"""Every shipped preset loads, and the model presets have their published sizes."""

import pytest

from dsauto.spec.cluster import DeviceSpec, HardwareSpec, LinkSpec
from dsauto.spec.loaders import load_cluster, load_hardware, load_model
from dsauto.spec.model import ModelSpec
from dsauto.spec.presets import list_hardware_presets, list_model_presets, preset_file

# Published parameter counts (see the source comment in each preset file).
PUBLISHED_PARAMETERS = {
    "gpt2-xl": 1.56e9,
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.0e9,
    "llama2-70b": 69.0e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "gpt3-175b": 174.6e9,
    "bert-large": 335e6,
}


def test_preset_lists_hold_the_shipped_files():
    assert set(PUBLISHED_PARAMETERS) | {"gpt-tiny"} == set(list_model_presets())
    assert {"cpu", "a100-40gb", "a100-80gb", "h100-80gb", "h200"} == set(list_hardware_presets())
    assert preset_file("models", "no-such-model") is None


@pytest.mark.parametrize("name", list_model_presets())
def test_model_preset_loads_under_its_own_name(name):
    model = load_model(name)
    assert isinstance(model, ModelSpec)
    assert model.name == name


@pytest.mark.parametrize("name", list_model_presets())
def test_model_preset_names_its_source(name):
    assert preset_file("models", name).read_text().startswith("# ")


@pytest.mark.parametrize("name, published", sorted(PUBLISHED_PARAMETERS.items()))
def test_model_preset_matches_published_size(name, published):
    assert load_model(name).num_parameters() == pytest.approx(published, rel=0.02)


def test_gpt_tiny_is_tiny():
    assert load_model("gpt-tiny").num_parameters() < 2e6


@pytest.mark.parametrize("name", list_hardware_presets())
def test_hardware_preset_loads_with_usable_numbers(name):
    hardware = load_hardware(name)
    assert isinstance(hardware, HardwareSpec)
    assert hardware.name == name
    device = hardware.device
    assert 0 < device.memory_reserve_bytes < device.memory_bytes
    assert device.flops(hardware.dtype) > 0
    assert hardware.intra_node.bandwidth_gbps >= hardware.inter_node.bandwidth_gbps
    # GPU presets carry the efficiencies fitted to published runs (benchmarks/fit_device.py), and
    # say so; the CPU preset carries its measured figures.
    assert 0 < device.matmul_efficiency <= 1 and 0 < device.memory_bandwidth_efficiency <= 1
    assert 0 <= device.comm_overlap_efficiency <= 1
    if name != "cpu" and (device.matmul_efficiency, device.memory_bandwidth_efficiency) != (
            DeviceSpec.matmul_efficiency, DeviceSpec.memory_bandwidth_efficiency):
        assert "fit_device.py" in preset_file("hardware", name).read_text()
    assert hardware.intra_node.efficiency == hardware.inter_node.efficiency == LinkSpec.efficiency
    cluster = load_cluster(name)
    assert cluster.nodes == 1 and cluster.world_size == hardware.gpus_per_node


def test_gpu_presets_use_the_datasheet_numbers():
    a100 = load_hardware("a100-80gb").device
    assert a100.memory_bytes == 80 * 2**30
    assert a100.peak_flops == {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}
    h200 = load_hardware("h200")
    assert h200.device.memory_bytes == 143771 * 2**20  # what nvidia-smi reports for an H200 SXM
    assert h200.device.peak_flops == load_hardware("h100-80gb").device.peak_flops
    assert h200.intra_node.bandwidth_gbps == 450 and h200.inter_node.bandwidth_gbps == 50


def test_cpu_preset_matches_the_ci_machine():
    cpu = load_hardware("cpu")
    assert cpu.gpus_per_node == 2 and cpu.dtype == "fp32"
    assert cpu.device.memory_bytes == 8 * 2**30
