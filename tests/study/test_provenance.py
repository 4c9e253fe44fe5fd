"""Where results come from: the banner on results measured on another device kind, the answer profiles'
'untested' labels, and the workshop profile's sizing (no launches)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from labkit.cli import build_parser
from labkit.core import memory
from labkit.runtime.devices import Devices
from labkit.study.answer import PROFILES, points
from labkit.study.report import build_report, provenance_banner

REFERENCE = Path(__file__).resolve().parents[2] / "data" / "reference-ci"
CPU_MACHINE = json.loads((REFERENCE / "machine.json").read_text())


def devices(accelerator: str, name: str, count: int = 1) -> Devices:
    return Devices(accelerator=accelerator, device_count=count, max_ranks=count, backend="nccl", bf16=True,
                   fp16=True, device_name=name, total_memory_bytes=24 * 2**30)


def test_cpu_results_on_a_gpu_machine_get_a_banner() -> None:
    text = provenance_banner(CPU_MACHINE, devices("cuda", "NVIDIA L4", 4))
    assert text and "measured on cpu" in text and "4 x cuda: NVIDIA L4" in text and "emulated" in text


def test_same_device_kind_gets_none_and_another_gpu_kind_does() -> None:
    here = devices("cpu", "Some other Xeon", 1)  # every CPU is one kind: the CPU model is not compared
    assert provenance_banner(CPU_MACHINE, here) is None
    h100 = {"accelerator": "cuda", "device": "NVIDIA H100 80GB HBM3", "devices": 8, "profile": "full"}
    assert provenance_banner(h100, devices("cuda", "NVIDIA H100 80GB HBM3", 8)) is None
    assert "NVIDIA H100" in provenance_banner(h100, devices("cuda", "Tesla T4", 4))
    assert "unknown" in provenance_banner(None, here)


def test_another_profile_is_said_even_on_the_same_kind() -> None:
    # Notebook 04 falls back to data/reference-ci when there are no results for the asked profile.
    text = provenance_banner(CPU_MACHINE, devices("cpu", "x"), profile="full")
    assert text and "'ci' profile's results" in text and "'full'" in text
    assert provenance_banner(CPU_MACHINE, devices("cpu", "x"), profile="ci") is None


def test_report_top_carries_the_banner(tmp_path: Path) -> None:
    results = pd.read_csv(REFERENCE / "results.csv")
    page = build_report(results, tmp_path / "gpu.html", machine=CPU_MACHINE, profile={"name": "ci"},
                        devices=devices("cuda", "NVIDIA A10G", 1)).read_text()
    banner = page.index("class='banner'")
    assert banner < page.index("<h1>") and "measured on cpu" in page[banner:page.index("<h1>")]
    same = build_report(results, tmp_path / "cpu.html", machine=CPU_MACHINE, profile={"name": "ci"},
                        devices=devices("cpu", "x")).read_text()
    assert "class='banner'" not in same


@pytest.mark.parametrize("name", ["workshop", "full"])
def test_gpu_profiles_are_labelled_untested_in_notes_and_report(name: str, tmp_path: Path) -> None:
    import dataclasses

    profile = PROFILES[name]
    assert any("untested" in note.lower() for note in profile.notes)
    page = build_report(pd.read_csv(REFERENCE / "results.csv"), tmp_path / "r.html", machine=CPU_MACHINE,
                        profile=dataclasses.asdict(profile), devices=None).read_text()
    assert "class='banner'" in page and "Untested" in page[:page.index("<h1>")]


def test_workshop_profile_fits_16_gb_and_is_a_cli_choice() -> None:
    profile = PROFILES["workshop"]
    model = profile.model
    psi = memory.n_params_mlp(model["input_size"], model["hidden"], model["depth"], 10)
    # Stage 0 model states leave most of a 16 GB device for activations (the estimate in docs/answer.md).
    assert memory.model_state_bytes(psi, 0, 1, model["precision"])["device_bytes"] < 16e9 / 10
    # 4 strategies x 2 batches + ZeRO-2 once + 3 accumulation points + 2 LR rules x 2 batches, plus the
    # rank-growth series on more than one rank (docs/answer.md counts 16 on 1 GPU, 18 on 2): a sweep sized for
    # minutes on one GPU, not the full grid.
    assert 16 <= len(points(profile)) <= 30
    assert len(points(profile)) < len(points(PROFILES["full"]))
    assert build_parser().parse_args(["answer", "--profile", "workshop"]).profile == "workshop"
    assert "docs/answer.md" in " ".join(profile.notes)
