"""Every notebook's runs, for every profile, against stand-in GPUs of the sizes people get.

A stand-in is a `Devices` (what labkit.runtime.devices.detect_devices answers) with a GPU's memory, count and
bf16 support: RunConfig validates each run against it, and labkit.core.memory's prediction of what one rank
holds must fit the device with a margin. No GPU is needed: nothing launches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.runtime import devices as devices_module
from labkit.runtime import hardware
from labkit.runtime.devices import Devices
from labkit.runtime.profiles import PROFILE_NAMES as PROFILES
from labkit.runtime.profiles import default_profile
from labkit.study import examples, notebook_sizes
from labkit.study.device_need import predicted_device_bytes
from labkit.study.notebook_sizes import FIT_MARGIN, NOTEBOOKS, notebook_configs, sizes_for

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


# Each size's memory as CUDA reports it for a card of that size the workshops get (hardware.MEMORY_TOTALS: a T4's
# "16 GB" is 14.75 GiB, an L4's "24 GB" 21.95 GiB, an H100's "80GB" 79.18 GiB), not the datasheet's figure. Other
# drivers and boards differ by up to ~1% (a T4 under driver 12.5: 14.57), inside device_need's 2 GiB overhead.
CARD_OF_SIZE = {16: "T4", 24: "L4", 80: "H100-SXM"}


def gpu(memory_gib: float, count: int, bf16: bool) -> Devices:
    name = {16: "Tesla T4" if not bf16 else "NVIDIA A16", 24: "NVIDIA L4" if bf16 else "Quadro RTX 6000",
            80: "NVIDIA H100 80GB HBM3" if bf16 else "Tesla V100 80GB (stand-in)"}[memory_gib]
    total = int(hardware.MEMORY_TOTALS[CARD_OF_SIZE[int(memory_gib)]])
    return Devices("cuda", count, count, "nccl", bf16, True, name, total)


STAND_INS = [gpu(m, n, b) for m in (16, 24, 80) for n in (1, 4, 8) for b in (True, False)]


def where_profile_runs(profile: str) -> list[Devices]:
    """The stand-ins a GPU profile must fit: `workshop` every size (the lead runs it on an H100 too), `full` 80 GB."""
    return [d for d in STAND_INS if profile == "workshop" or d.total_memory_bytes > 70 * GiB]


# Notebooks whose every run is between ranks: on one GPU they launch nothing (and say so).
ONLY_MULTI_RANK = {"03b"}


@pytest.mark.parametrize("profile", ["workshop", "full"])
@pytest.mark.parametrize("notebook", sorted(NOTEBOOKS))
def test_every_notebooks_runs_are_accepted_and_fit_each_gpu(monkeypatch, tmp_path, profile, notebook):
    checked = 0
    for devices in where_profile_runs(profile):
        monkeypatch.setattr(devices_module, "detect_devices", lambda devices=devices: devices)
        sizes = sizes_for(notebook, devices)[profile]
        configs = notebook_configs(notebook, sizes, devices, work_dir=tmp_path)  # RunConfig accepts each here
        assert configs or (notebook in ONLY_MULTI_RANK and devices.max_ranks == 1), (notebook, devices)
        for label, config in configs.items():
            trained = examples.script_twin(config) if config.script else config  # a script run: what it trains
            if trained.precision == "bf16":
                assert devices.bf16, (notebook, label)  # never bf16 on a T4 (RunConfig refuses it too)
            need = predicted_device_bytes(config)
            assert need <= FIT_MARGIN * devices.total_memory_bytes, (
                f"{notebook} {profile} {label} on {devices.device_name} x{devices.device_count}: "
                f"{need / GiB:.1f} GiB predicted of {devices.total_memory_bytes / GiB:.1f} GiB")
            checked += 1
    assert checked


def test_on_one_gpu_the_zero3_notebooks_run_one_rank_and_03b_launches_nothing(monkeypatch, tmp_path):
    """The lead's machine: one H100 80GB with LABKIT_PROFILE=workshop; every world size is capped at 1."""
    h100 = gpu(80, 1, True)
    monkeypatch.setattr(devices_module, "detect_devices", lambda: h100)
    ranks = {notebook: {label: config.world_size for label, config in notebook_configs(
        notebook, sizes_for(notebook, h100)["workshop"], h100, work_dir=tmp_path).items()}
        for notebook in ("03", "03a", "03b")}
    assert ranks == {"03": {"script, 1 rank(s)": 1, "1 rank(s)": 1}, "03a": {"1 rank(s)": 1}, "03b": {}}
    four = gpu(24, 4, True)
    monkeypatch.setattr(devices_module, "detect_devices", lambda: four)
    labels = {notebook: sorted(notebook_configs(notebook, sizes_for(notebook, four)["workshop"], four,
                                                work_dir=tmp_path)) for notebook in ("03", "03a", "03b")}
    assert "4 ranks, no sampler" in labels["03"] and "script, 4 rank(s)" in labels["03"]
    assert {"4 ranks, no sampler", "4 ranks, no sampler, default reuse distance", "stage 0, 4 ranks"} <= set(
        labels["03a"])
    assert len(labels["03b"]) == 7 and "timed, 4 rank(s)" in labels["03b"]


def test_03s_script_runs_train_its_model_in_the_profiles_precision(monkeypatch, tmp_path):
    """Example 3's script gets the parameters cell's width, depth and samples, and a copy of its DeepSpeed config
    with the half precision turned on: its twin is 03's ZeRO-3 model at the config's micro-batch of 64."""
    t4 = gpu(16, 2, False)
    monkeypatch.setattr(devices_module, "detect_devices", lambda: t4)
    sizes = sizes_for("03", t4)["workshop"]
    configs = notebook_configs("03", sizes, t4, work_dir=tmp_path)
    script = configs["script, 2 rank(s)"]
    assert script.script and script.script.endswith("ex3_zero3.py") and script.steps == 2 * sizes["timing_steps"]
    variant = json.loads((tmp_path / "ex3_ds_config.json").read_text())
    assert variant["fp16"] == {"enabled": True} and variant["bf16"] == {"enabled": False}
    twin = examples.script_twin(script)
    worker = configs["2 rank(s)"]
    assert (twin.example, twin.precision, twin.world_size, twin.micro_batch) == ("zero3", "fp16", 2, 64)
    assert (twin.hidden, twin.depth, twin.dataset_size) == (worker.hidden, worker.depth, worker.dataset_size)
    assert predicted_device_bytes(script) == predicted_device_bytes(worker)  # the same model, batch, ranks, dtype


def test_04a_runs_the_lr_lessons_on_one_rank_in_every_profile(monkeypatch):
    """04a launches the five LR runs of lessons.LR_LESSONS (measured for the MLP), one rank each, whatever the profile
    and the GPUs: the same labels its cells launch."""
    from labkit.study import lessons

    expected = sorted({**lessons.sgd_scaling_configs("mlp"), **lessons.warmup_configs("mlp")})
    for devices in (gpu(16, 1, False), gpu(80, 8, True), Devices("cpu", 1, 2, "gloo", True, False, "CPU", 24 * GiB)):
        monkeypatch.setattr(devices_module, "detect_devices", lambda devices=devices: devices)
        for profile, sizes in sizes_for("04a", devices).items():
            configs = notebook_configs("04a", sizes, devices)
            assert sorted(configs) == expected and len(expected) == 5, (profile, devices.device_name)
            assert {(c.world_size, c.stage, c.model) for c in configs.values()} == {(1, 0, "mlp")}


def test_half_precision_is_bf16_where_native_and_fp16_on_a_t4():
    t4, l4, cpu = gpu(16, 1, False), gpu(24, 1, True), Devices("cpu", 1, 2, "gloo", True, False, "CPU", 24 * GiB)
    assert sizes_for("02", t4)["workshop"]["precision"] == "fp16"
    assert sizes_for("02", l4)["workshop"]["precision"] == "bf16"
    assert notebook_sizes.precision_for("half", cpu) == "fp32"
    assert sizes_for("00", gpu(24, 4, True))["workshop"]["world_size"] == 4  # "all": every GPU
    assert sizes_for("05", Devices("cpu", 1, 1, "gloo", True, False, "CPU", GiB))["ci"]["world_size"] == 1


def test_ci_runs_are_accepted_on_this_machine_class(monkeypatch):
    cpu = Devices("cpu", 1, 2, "gloo", True, False, "CPU", 24 * GiB)  # the 2-core CI machine
    monkeypatch.setattr(devices_module, "detect_devices", lambda: cpu)
    for notebook in NOTEBOOKS:
        assert notebook_configs(notebook, sizes_for(notebook, cpu)["ci"], cpu)


def test_the_default_profile_follows_the_gpus_memory_and_count():
    assert default_profile(Devices("cpu", 1, 2, "gloo", True, False, "CPU", 24 * GiB)) == "ci"
    assert default_profile(gpu(16, 1, False)) == "workshop" and default_profile(gpu(24, 4, True)) == "workshop"
    assert default_profile(gpu(80, 8, True)) == "full"
    assert default_profile(gpu(80, 1, True)) == "workshop"  # one 80 GB GPU: full is sized for a node
    small = Devices("cuda", 1, 1, "nccl", False, True, "GeForce GTX 1080", 8 * GiB)
    assert default_profile(small) == "ci"


def test_labkit_profile_workshop_is_accepted(monkeypatch):
    from labkit.runtime.profiles import current_profile

    monkeypatch.setenv("LABKIT_PROFILE", "workshop")
    assert current_profile() == "workshop" and PROFILES == ("ci", "workshop", "full")
    monkeypatch.setenv("LABKIT_PROFILE", "huge")
    with pytest.raises(ValueError, match="LABKIT_PROFILE: must be one of ci, workshop, full, got 'huge'"):
        current_profile()


def test_parameters_cells_read_their_sizes_from_the_module():
    """The notebooks keep `profile = current_profile()` in their parameters cell and take SIZES from here."""
    names = []
    for notebook in sorted(REPO.glob("notebooks/0[0-5]*-*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        (parameters,) = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        source = "".join(parameters["source"])
        assert "profile = current_profile()" in source, notebook.name
        key = notebook.name.split("-")[0]
        if key in NOTEBOOKS:
            names.append(key)
            assert f'SIZES = sizes_for("{key}")' in source, notebook.name
            assert "dict(" not in source, notebook.name  # no sizes left in the cell
    assert {"03", "03a", "03b", "04a"} <= set(names)


@pytest.mark.parametrize("notebook", ["03", "03a", "03b"])
def test_multi_rank_notebooks_say_what_one_gpu_skips_right_after_their_parameters(notebook):
    """A learner's Run All on one GPU goes on: the cell after the parameters says what is skipped, and why."""
    (path,) = REPO.glob(f"notebooks/{notebook}-*.ipynb")
    cells = json.loads(path.read_text())["cells"]
    (at,) = [i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert "lessons.skipped_multi_rank(" in "".join(cells[at + 1]["source"]), path.name
    assert "lessons.check(world >= 2" not in path.read_text()  # 03b stopped Run All on one GPU before


def test_an_unknown_notebook_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown notebook '99'; known: 00, 01, "):  # a bare KeyError '99' before
        sizes_for("99")
