"""Read Baidu DeepBench's published NVIDIA training GEMM results into labkit's published-GEMM JSON.

    git -C DeepBench show 30c51150869ee217f150ef5f31dc69241ed23b49:results/train/DeepBench_NV_V100.xlsx > v100.xlsx
    python data/published/gemm/from_deepbench.py v100.xlsx --gpu "NVIDIA V100 (DGX-1, SXM2)" \
        --presets V100-16GB V100-32GB --file results/train/DeepBench_NV_V100.xlsx \
        --setup "NVIDIA DGX-1, CUDA 10.1.243, cuDNN 7.6.2.24, driver 418.67; its Specs sheet" \
        > data/published/gemm/deepbench-v100.json

(deepbench-t4.json: DeepBench_NV_T4.xlsx, --gpu "NVIDIA T4" --presets T4 and that file's Specs sheet.)

Standard library only (an .xlsx is a zip of XML). Every row of the "Dense Matrix Multiplication" tables of the
"Results FP32" and "Results - FP16 ip, Mixed math" sheets is copied as published (M, N, K, transposes, time in ms);
`padded` gives the dimensions DeepBench's harness ran an fp16 GEMM at: code/nvidia/gemm_bench.cu at the same
commit pads M and K (NN, TN), M and N (NT) or all three (TT) to multiples of 8 so cuBLAS 10 uses tensor cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
import zipfile

NS = {"m": "http://schemas.openxmlformats.org/spreadsheetml/2006/main"}
SHEETS = {"Results FP32": "fp32", "Results - FP16 ip, Mixed math": "fp16"}
REPO, COMMIT = "baidu-research/DeepBench", "30c51150869ee217f150ef5f31dc69241ed23b49"


def _cells(book: zipfile.ZipFile, target: str, strings: list[str]) -> list[dict[str, str]]:
    rows = []
    for row in ET.fromstring(book.read(f"xl/{target}")).iter(f"{{{NS['m']}}}row"):
        cells = {}
        for cell in row:
            value = cell.find("m:v", NS)
            if value is not None:
                column = "".join(ch for ch in cell.get("r", "") if ch.isalpha())
                cells[column] = strings[int(value.text)] if cell.get("t") == "s" else value.text
        rows.append(cells)
    return rows


def _padded(m: int, n: int, k: int, a_t: bool, b_t: bool) -> list[int]:
    up = lambda x: -(-x // 8) * 8  # noqa: E731
    if not b_t:            # NN and TN: M and K
        return [up(m), n, up(k)]
    if not a_t:            # NT: M and N
        return [up(m), up(n), k]
    return [up(m), up(n), up(k)]  # TT


def read(path: str) -> dict[str, list[dict]]:
    book = zipfile.ZipFile(path)
    strings = ["".join(t.text or "" for t in si.iter(f"{{{NS['m']}}}t"))
               for si in ET.fromstring(book.read("xl/sharedStrings.xml"))]
    rels = {r.get("Id"): r.get("Target") for r in ET.fromstring(book.read("xl/_rels/workbook.xml.rels"))}
    out: dict[str, list[dict]] = {}
    for sheet in ET.fromstring(book.read("xl/workbook.xml")).iter(f"{{{NS['m']}}}sheet"):
        dtype = SHEETS.get(sheet.get("name", ""))
        if dtype is None:
            continue
        rid = sheet.get("{http://schemas.openxmlformats.org/officeDocument/2006/relationships}id")
        rows, in_gemm = [], False
        for cells in _cells(book, rels[rid], strings):
            if cells.get("A"):                      # a table's title row
                in_gemm = cells["A"] == "Dense Matrix Multiplication"
                continue
            if not in_gemm or not cells.get("I") or not cells.get("C", "").isdigit():
                continue
            m, n, k = int(cells["C"]), int(cells["D"]), int(cells["E"])
            a_t, b_t = cells["F"] == "T", cells["G"] == "T"
            rows.append({"label": f"{cells.get('B', '')} {m}x{n}x{k} {cells['F']}{cells['G']}".strip(),
                         "m": m, "n": n, "k": k, "a_t": a_t, "b_t": b_t, "ms": float(cells["I"]),
                         "padded": _padded(m, n, k, a_t, b_t) if dtype == "fp16" else [m, n, k]})
        out[dtype] = rows
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xlsx")
    parser.add_argument("--gpu", required=True, help="the GPU as DeepBench's Specs sheet names it")
    parser.add_argument("--presets", nargs="+", required=True, help="labkit.runtime.hardware presets it describes")
    parser.add_argument("--file", required=True, help="the file's path in DeepBench")
    parser.add_argument("--setup", default="", help="the Specs sheet's software and machine, in words")
    args = parser.parse_args()
    shapes = read(args.xlsx)
    json.dump({"format": "labkit-published-gemm/1", "gpu": args.gpu, "presets": args.presets,
               "source": f"published: Baidu DeepBench, {REPO}@{COMMIT} {args.file} ({args.setup})",
               "shapes": shapes}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
